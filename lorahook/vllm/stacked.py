"""vLLM's own stacked slot tensors, as the kernels read them.

The layers that keep vLLM's slots (``LORAHOOK_VLLM_SLOTS=stacked``, or a
layer kind :mod:`lorahook.vllm.slots` does not serve) hold every slot in one
tensor per factor, padded to ``--max-lora-rank``: :class:`Pairs` reads a
projection's at each slot's real rank, :class:`Stacked` gives the few calls
the pairs kernel does not take their float32 copies.
"""
from __future__ import annotations

import numpy as np
import torch

from lorahook._core.slot_pairs import SlotPairs
from lorahook.vllm.tensors import HALF, Fallback, array_of

__all__ = ["Stacked", "Pairs"]


class Stacked:
    """One of vLLM's stacked weight tensors as the kernels take it (see ``_factor``).

    ``view``: the tensor as a ``(slots, rows, cols)`` numpy view (16-bit kinds
    in ``kinds``); ``copy``: the float32 copy the kernels use instead (``B``
    transposed), or ``None`` when the view is used as it is; ``version``: the
    tensor's version counter when the copy was made.
    """

    __slots__ = ("tensor", "view", "kinds", "copy", "version")

    def __init__(self, t: torch.Tensor, transpose: bool):
        self.tensor = t
        self.kinds: list = []
        view = array_of(t, self.kinds)
        self.view = view.reshape(view.shape[0], view.shape[-2], view.shape[-1])
        self.copy, self.version = None, -1
        try:
            t._version
        except RuntimeError:  # no version counter: it cannot tell when to copy again
            return
        if transpose or t.dtype != torch.float32:
            shape = self.view.shape
            self.copy = np.empty((shape[0], shape[2], shape[1]) if transpose else shape,
                                 np.float32)


def _slot_ranks(a: torch.Tensor, b: torch.Tensor, out: np.ndarray) -> None:
    """Each slot's real rank, written into ``out``: the last rank row of ``A`` or column of
    ``B`` that holds a non-zero value, plus one (0 for an empty slot).

    vLLM pads every slot to ``--max-lora-rank`` with zeros; the padding adds
    nothing to a finite row, so it is never read.
    """
    slots, rmax = a.shape[0], a.shape[-2]
    used = (a.reshape(slots, rmax, -1) != 0).any(dim=2)
    used |= (b.reshape(slots, -1, rmax) != 0).any(dim=1)
    steps = torch.arange(1, rmax + 1, dtype=torch.int32)
    out[:] = (used.to(torch.int32) * steps).amax(dim=1).numpy()


class Pairs:
    """A projection's stacked ``A`` and ``B`` tensors as :func:`apply_pairs` takes them.

    ``A`` is read in place, in the model's dtype; ``B`` is kept transposed,
    ``(slots, rank, d_out)``, in the same dtype (about as many bytes as vLLM's
    own ``B``); each slot's real rank is found from the weights.  The copy and
    the ranks are made again only when vLLM writes the tensors (it bumps
    their version counters when it activates an adapter in a slot), never
    per step.
    """

    __slots__ = ("a", "b", "bt", "ranks", "versions", "pairs", "dtype", "half", "width", "used")

    def __init__(self, a, b):
        if isinstance(a, torch.Tensor):
            a, b = (a,), (b,)
        a, b = tuple(a), tuple(b)
        dtype = a[0].dtype
        for t in (*a, *b):
            if (t.dtype != dtype or dtype not in (torch.float32, *HALF) or t.device.type != "cpu"
                    or t.dim() != 4 or t.shape[1] != 1 or not t.is_contiguous()):
                raise Fallback
            t._version  # noqa: B018 -- made under inference_mode: no counter, no way to follow writes
        self.a, self.b = a, b
        self.bt = tuple(torch.empty((t.shape[0], t.shape[3], t.shape[2]), dtype=dtype) for t in b)
        self.ranks = tuple(np.zeros(t.shape[0], np.int32) for t in a)
        self.versions = [None] * len(a)
        self.dtype = dtype
        self.half = HALF.get(dtype)
        self.used = False  # whether any slot has a rank above 0
        self.width = sum(t.shape[2] for t in b)
        self.pairs = SlotPairs([array_of(t, []).reshape(t.shape[0], t.shape[2], t.shape[3])
                                for t in a], [array_of(t, []) for t in self.bt], self.ranks,
                               half=self.half)

    def refresh(self) -> bool:
        """Follow vLLM's writes into the slots: copy ``B`` and find the ranks again.

        True when vLLM had written a slot since the last call.
        """
        done = False
        for i, (a, b) in enumerate(zip(self.a, self.b)):
            version = (a._version, b._version)
            if version != self.versions[i]:
                self.bt[i].copy_(b.detach()[:, 0].transpose(1, 2))
                _slot_ranks(a.detach(), b.detach(), self.ranks[i])
                self.versions[i] = version
                done = True
        if done:
            self.used = any(bool(r.any()) for r in self.ranks)
        return done
