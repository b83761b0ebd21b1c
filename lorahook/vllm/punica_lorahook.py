"""The punica wrapper vLLM's CPU LoRA runs through when the plugin is active.

vLLM's CPU wrapper, whose methods it overrides one for one, copies every
token's ``A`` and ``B`` out of the stacked slot weights before an ``einsum``.
This wrapper groups the step's rows by slot once, in
:meth:`~PunicaWrapperLorahook.update_metadata`, and every linear projection
(and the logits) then runs the pairs kernel on vLLM's own tensors: a layer's
slot table (:mod:`lorahook.vllm.slots`) or vLLM's stacked slots
(:mod:`lorahook.vllm.stacked`).  Compiled, each call is the custom op of
:mod:`lorahook.vllm.custom_op`.
"""
from __future__ import annotations

import logging
import os
from typing import Any

import torch
from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

from lorahook._core.slot_rows import SlotRows, apply_slots
from lorahook._core.slot_pairs import apply_pairs, apply_pairs_tensors, openmp_team
from lorahook.vllm.custom_op import pack_call, slices_of, wrappers
from lorahook.vllm.profile import Profile, clock
from lorahook.vllm.slots import SlotTable, table_of
from lorahook.vllm.stacked import Pairs, Stacked
from lorahook.vllm.tensors import Fallback, one_kind, rows_as, rows_of

__all__ = ["PunicaWrapperLorahook", "QUALNAME"]

#: What ``current_platform.get_punica_wrapper()`` names once the plugin is active.
QUALNAME = "lorahook.vllm.PunicaWrapperLorahook"

# vLLM's handler prints loggers under "vllm"; this one sits beside vLLM's own.
logger = logging.getLogger("vllm.lorahook")

_UNSEEN = object()  # a cache's "no entry" (an entry may be None)


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


class PunicaWrapperLorahook(PunicaWrapperCPU):
    """vLLM's CPU punica wrapper with lorahook's grouped kernels behind every method.

    The slot grouping of the step's tokens (and of its sampled rows, for the
    logits) is built once per :meth:`update_metadata`; each linear projection
    and the logits then run the pairs kernel
    (:func:`lorahook._core.slot_pairs.apply_pairs_tensors`) on a layer's slot table
    or on vLLM's stacked slots, and the calls it does not take (a shrink or an
    expand alone, embeddings, classifier heads) run
    :func:`lorahook._core.slot_rows.apply_slots`.  Results equal vLLM's CPU ops to
    float32 rounding (a row's result does not depend on the other slots' rows;
    16-bit outputs are rounded once).
    """

    def __init__(self, max_num_batched_tokens: int, max_batches: int,
                 device: torch.device | str, **kwargs):
        super().__init__(max_num_batched_tokens, max_batches, device, **kwargs)
        self._tokens: SlotRows | None = None
        self._sampled: SlotRows | None = None
        # vLLM's stacked weights as the kernels take them, made once per tensor (they
        # live as long as the model), by where the tensor lives; each entry keeps its tensor
        self._views: dict[tuple, Stacked] = {}
        # a projection's (A, B) tuples as apply_pairs takes them, by where they live
        # (None: that projection goes the apply_slots way)
        self._pairs: dict[tuple, tuple] = {}
        self._pairs_by_id: dict[tuple, Pairs | None] = {}  # the same, by the tensors' ids
        self._team = None
        self._threads = 0
        self.profile = Profile.from_env()
        # how torch.ops.lorahook.punica finds this wrapper from a compiled graph
        self._handle = torch.zeros(1, dtype=torch.int8)
        wrappers[self._handle.data_ptr()] = self

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
        t0 = clock()
        super().update_metadata(mapping, lora_index_to_id, max_loras, vocab_size, **kwargs)
        if not self._threads:
            self._start_team()
        slots = len(lora_index_to_id)
        self._tokens = SlotRows(self.token_lora_indices.numpy(), slots)
        self._sampled = SlotRows(self.sampler_indices.numpy(), slots)
        if self.profile is not None:
            self.profile.step(clock() - t0)

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
            raise Fallback
        key = (t.data_ptr(), tuple(t.shape), t.dtype)  # where it lives (see _pairs_of)
        entry = self._views.get(key)
        if entry is None:
            entry = self._views[key] = Stacked(t, transpose)
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
    def _pairs_of(self, a, b) -> Pairs | None:
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
                entry = entry if entry is not None else Pairs(a, b)
            except (Fallback, RuntimeError) as exc:
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
            if slices and tuple(slices) != slices_of(b, None):
                raise ValueError(f"lorahook: the {method} call's output slices {tuple(slices)} "
                                 f"are not its B tensors' heights {slices_of(b, None)}")
            torch.ops.lorahook.punica(self._handle, pack_call(method, offset, add), y, x, list(a),
                                      list(b), float(scale))
        else:
            self.run_call(method, y, x, a, b, scale, slices, offset, add)

    def run_call(self, method: str, y, x, a, b, scale, slices, offset, add) -> None:
        """``method`` on lorahook's kernels over the step's rows, or on vLLM's own op.

        A step without an adapter row returns at once; a call a kernel raises
        ``Fallback`` for (before it writes anything) goes to vLLM's CPU wrapper.
        """
        rows = self._sampled if method == "logits" else self._tokens
        if rows is None or rows.n_covered == 0:
            return
        try:
            getattr(self, "_" + method)(rows, y, x, a, b, scale, slices, offset, add)
        except Fallback:
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
            own.add_lora_linear(self, y, x, tuple(a), tuple(b), scale, slices_of(b, slices))
        elif method == "shrink":
            own.add_shrink(self, y, x, tuple(a), scale)
        elif method == "expand":
            own.add_expand(self, y, x, tuple(b), slices_of(b, slices), offset_start=offset,
                           add_inputs=add)
        elif method == "embedding":
            own.add_lora_embedding(self, y, x, b[0], add_inputs=add)
        else:
            own.add_lora_logits(self, y, x, a[0], b[0], scale)

    # -- lorahook's kernels -----------------------------------------------------------------
    def _linear(self, rows, y, x, a_stacked, b_stacked, scale, output_slices, offset, add):
        t0 = clock()
        pairs = self._pairs_of(a_stacked, b_stacked)
        if pairs is not None and x.dtype == y.dtype == pairs.dtype:
            if pairs.refresh() and self.profile is not None:
                self.profile.add(("slot writes", x.shape[-1], slices_of(b_stacked, output_slices)),
                                 clock() - t0)
                t0 = clock()
            kind = "linear"
            # a projection no adapter in the slots touches: done.  The tensors' own layout
            # first (NumPy views of a decode step's rows cost more than its kernel), then
            # views of other layouts (3-D, say), else vLLM's op
            if (pairs.used or not add) and not apply_pairs_tensors(
                    rows, x, y, pairs.pairs, pairs.dtype, scale, add=add, team=self._team):
                xa, ya = rows_as(x, pairs.half), rows_as(y, pairs.half)
                if ya.shape[1] != pairs.width:
                    raise Fallback
                apply_pairs(rows, xa, ya, pairs.pairs, scale, add=add, half=pairs.half,
                            team=self._team)
        else:
            if isinstance(pairs, SlotTable):  # rows of another dtype: see run_call
                raise Fallback
            kind = "linear (apply_slots)"
            half = []
            xa, ya = rows_of(x, half), rows_of(y, half)
            calls = []
            offset = 0
            for a_t, b_t, size in zip(a_stacked, b_stacked, slices_of(b_stacked, output_slices),
                                      strict=True):
                b, _, _ = self._b(b_t, half)
                calls.append((self._factor(a_t, half)[0], b, ya[:, offset:offset + size]))
                offset += size
            hk = one_kind(half)
            for a, b, out in calls:
                apply_slots(rows, xa, out, a, scale=scale, add=add, half=hk, **b)
        if self.profile is not None:
            self.profile.add((kind, x.shape[-1], slices_of(b_stacked, output_slices)),
                             clock() - t0)

    def _shrink(self, rows, y, x, a_stacked, b_stacked, scale, slices, offset, add):
        half: list = []
        xa = rows_of(x, half)
        outs = [rows_of(y[i], half) for i in range(len(a_stacked))]
        weights = [self._factor(a_t, half)[0] for a_t in a_stacked]
        kind = one_kind(half)
        for a, out in zip(weights, outs):
            # vLLM's CPU op writes (not adds) a token's shrunk rows
            apply_slots(rows, xa, out[:, :a.shape[1]], a=a, scale=scale, add=False, half=kind)

    def _expand(self, rows, y, x, a_stacked, b_stacked, scale, output_slices, offset, add):
        half: list = []
        ya = rows_of(y, half)
        calls = []
        for i, (b_t, size) in enumerate(zip(b_stacked, slices_of(b_stacked, output_slices),
                                                 strict=True)):
            b, _, rank = self._b(b_t, half)
            calls.append((rows_of(x[i], half)[:, :rank], b, ya[:, offset:offset + size]))
            offset += size
        kind = one_kind(half)
        for xi, b, out in calls:
            apply_slots(rows, xi, out, add=add, half=kind, **b)

    def _embedding(self, rows, y, x, a_stacked, b_stacked, scale, slices, offset, add):
        half: list = []
        ya, xa = rows_of(y, half), rows_of(x, half)
        b, d_out, _ = self._b(b_stacked[0], half)
        if d_out > ya.shape[1]:
            raise Fallback
        apply_slots(rows, xa, ya[:, :d_out], add=add, half=one_kind(half), **b)

    def _logits(self, rows, y, x, a_stacked, b_stacked, scale, slices, offset, add):
        t0 = clock()
        pairs = self._pairs_of(a_stacked, b_stacked)
        if pairs is not None and x.dtype == y.dtype == pairs.dtype:
            if pairs.refresh() and self.profile is not None:
                self.profile.add(("slot writes", x.shape[-1], (y.shape[-1],)), clock() - t0)
                t0 = clock()
            kind = "logits"
            if pairs.used:
                ya, xa = rows_as(y, pairs.half), rows_as(x, pairs.half)
                if pairs.width > ya.shape[1]:  # logits padded narrower than the vocabulary
                    raise Fallback
                apply_pairs(rows, xa, ya[:, :pairs.width], pairs.pairs, scale, half=pairs.half,
                            team=self._team)
        else:
            if isinstance(pairs, SlotTable):
                raise Fallback
            kind = "logits (apply_slots)"
            half = []
            ya, xa = rows_of(y, half), rows_of(x, half)
            a, _ = self._factor(a_stacked[0], half)
            b, d_out, _ = self._b(b_stacked[0], half)
            if d_out > ya.shape[1]:
                raise Fallback
            apply_slots(rows, xa, ya[:, :d_out], a, scale=scale, half=one_kind(half), **b)
        if self.profile is not None:
            self.profile.add((kind, x.shape[-1], (y.shape[-1],)), clock() - t0)

    def _full_linear(self, y, x, weight_stacked, bias_stacked, module_enabled):
        rows = self._sampled
        if rows is None or rows.n_covered == 0:
            return
        half: list = []
        try:
            xa = rows_of(x, half)
            w, _ = self._factor(weight_stacked, half)
            kind = one_kind(half)
        except Fallback:
            PunicaWrapperCPU.apply_lora_full_linear(self, y, x, weight_stacked, bias_stacked,
                                                    module_enabled)
            return
        adapter_y = torch.zeros((xa.shape[0], w.shape[1]), dtype=torch.float32)
        apply_slots(rows, xa, adapter_y.numpy(), b=w, half=kind)
        y.copy_(self._select_full_linear_output(y, adapter_y, bias_stacked, module_enabled))
