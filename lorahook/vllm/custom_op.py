"""``torch.ops.lorahook.punica``: the custom op a compiled graph calls for each wrapper call.

Opaque to Dynamo, ``y`` written in place, a fake implementation for tracing;
the op finds its wrapper by a handle tensor and reads the step's grouping
from it when it runs, so one graph serves every step.
"""
from __future__ import annotations

import weakref

import torch

__all__ = ["wrappers", "pack_call", "slices_of"]

# The live wrappers, by where their ``_handle`` tensor lives.  A graph takes the handle
# as an input like any tensor of the model (bound from the live wrapper each time it
# runs, also when vLLM loads the graph from its compile cache in another process), and
# the op finds the wrapper, and the step's grouping in it, when it runs.
wrappers: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()

_SCHEMA = ("punica(Tensor wrapper, int call, Tensor(a!) y, Tensor x, Tensor[] a, Tensor[] b, "
           "float scale) -> ()")

# A graph calls the op once per LoRA projection of every layer, and each argument costs
# the dispatcher a conversion on every call: the per-call constants travel as one int
# (see pack_call), and a projection's output slices are read from its B tensors' shapes.
_METHODS = ("linear", "shrink", "expand", "embedding", "logits")


def pack_call(method: str, offset: int, add: bool) -> int:
    """``method``, ``add`` and the output ``offset`` as the op's one ``call`` int."""
    return _METHODS.index(method) | (bool(add) << 3) | (int(offset) << 4)


def slices_of(b, slices) -> tuple:
    """A projection's output slices: as given, else (in a compiled graph) ``B``'s heights."""
    return tuple(slices) if slices is not None else tuple(t.shape[-2] for t in b)


def _punica(wrapper, call, y, x, a, b, scale) -> None:
    """``torch.ops.lorahook.punica``: one wrapper call, run by the wrapper whose handle is ``wrapper``."""
    target = wrappers.get(wrapper.data_ptr())
    if target is None:
        raise RuntimeError("lorahook: the tensor given as the punica wrapper's handle is no "
                           "live wrapper's in this process")
    target.run_call(_METHODS[call & 7], y, x, a, b, scale, None, call >> 4, bool(call & 8))


def _punica_fake(wrapper, call, y, x, a, b, scale) -> None:
    """What tracing sees: the op writes ``y`` in place and returns nothing."""
    return None


def _define_op() -> None:
    """Register ``lorahook::punica`` once per process: opaque to Dynamo, ``y`` mutated."""
    try:
        torch.ops.lorahook.punica  # noqa: B018 -- defined already (this module reloaded)
        return
    except (AttributeError, RuntimeError):
        pass
    library = torch.library.Library("lorahook", "FRAGMENT")
    library.define(_SCHEMA)
    library.impl("punica", _punica, "CPU")
    torch.library.register_fake("lorahook::punica", _punica_fake, lib=library)
    _define_op.library = library  # a Library's registrations last as long as it does


_define_op()
