"""vLLM's LoRA layers with slots as big as their adapter.

vLLM gives each LoRA layer ``--max-loras`` slots, every one padded to
``--max-lora-rank`` for every module it can wrap, and copies an adapter into
a slot when it activates it, beside the copy its CPU cache
(``--max-cpu-loras``) keeps.  On a CPU both copies live in the same RAM.

With the plugin active, a layer lorahook serves gets no such storage: when
vLLM creates the layer's LoRA weights, it gets *placeholders* -- tensors of
the shapes vLLM expects, whose every element is one zero (no memory) -- and a
:class:`SlotTable` (a :class:`~lorahook._core.slot_pairs.SlotPairs` made by
``per_slot``).  When vLLM sets a slot, its own ``set_lora`` runs against
recorders standing in for the stacked tensors, so vLLM's packing and slicing
rules stay vLLM's; the table then refers to the adapter's tensors in vLLM's
CPU cache, at their own rank, in the model's dtype:

* ``A`` ``(rank, d_in)`` is read where it lies;
* ``B`` is needed transposed, ``(rank, d_out)``: its values are moved once into
  that layout, in place, so that the cache's own tensor is the transposed one
  (the same values, viewed with other strides): no second copy of the adapter.

Activating an adapter costs that adapter's tensors' bytes at most (the first
time, the move of ``B``), never a pass over the other slots, and a slot
costs what its adapter holds whatever ``--max-loras`` and
``--max-lora-rank`` say.  A layer kind lorahook does not serve this way (an
embedding, whose forward reads vLLM's stacked ``A`` itself; sharded layers;
MoE) keeps vLLM's slots, and one log line names it.
``LORAHOOK_VLLM_SLOTS=stacked`` keeps vLLM's slots for every layer.

``LORAHOOK_VLLM_ADAPTER_DTYPE=int8`` holds the slots lorahook serves in int8
instead: when vLLM sets a slot, its factors are quantized once (a float32
scale per row of ``A`` and per output, symmetric, to nearest) into arrays the
table keeps, and the kernel reads them in place, widening in registers; a
step reads a quarter of float32's bytes of each adapter (half of
bfloat16's).  vLLM's CPU cache keeps its own copy in the LoRA dtype.
"""
from __future__ import annotations

import copy
import logging
import os
import weakref

import torch

from lorahook._values import quantized
from lorahook._core.slot_pairs import SlotPairs, apply_pairs_tensors
from lorahook.vllm.tensors import HALF, array_of

logger = logging.getLogger("vllm.lorahook")

_KINDS = {torch.float32: "float32", **HALF}

# the layer classes whose LoRA weights lorahook holds itself (vLLM's own classes, by name;
# a subclass of one of them is not served unless named here)
SERVED = frozenset({
    "ColumnParallelLinearWithLoRA", "MergedColumnParallelLinearWithLoRA",
    "MergedColumnParallelLinearVariableSliceWithLoRA", "QKVParallelLinearWithLoRA",
    "MergedQKVParallelLinearWithLoRA", "RowParallelLinearWithLoRA", "ReplicatedLinearWithLoRA",
    "LogitsProcessorWithLoRA",
})
_WHY_NOT = {
    "VocabParallelEmbeddingWithLoRA": "its forward reads vLLM's stacked A itself",
    "ClassificationHeadWithLoRA": "a classifier head's slots hold whole weights",
}

# the tables, by where their placeholders live: a compiled graph may hand the wrapper
# other tensor objects (aliases) of the same placeholders
_tables: "weakref.WeakValueDictionary[int, SlotTable]" = weakref.WeakValueDictionary()
_said: set = set()  # what has been logged once


def table_of(t) -> "SlotTable | None":
    """The slot table whose placeholder ``t`` is (or aliases), else ``None``."""
    try:
        return _tables.get(t.data_ptr())
    except (AttributeError, RuntimeError):
        return None


def _once(key, level, msg, *args) -> None:
    if key not in _said:
        _said.add(key)
        logger.log(level, msg, *args)


def adapter_dtype() -> str | None:
    """``LORAHOOK_VLLM_ADAPTER_DTYPE``: ``int8``, or ``None`` (unset or ``auto``: vLLM's LoRA dtype)."""
    raw = os.environ.get("LORAHOOK_VLLM_ADAPTER_DTYPE", "").strip()
    if raw in ("", "auto"):
        return None
    if raw == "int8":
        return raw
    raise ValueError(f"LORAHOOK_VLLM_ADAPTER_DTYPE must be 'auto' or 'int8', got {raw!r}")


def _placeholder(shape, dtype) -> torch.Tensor:
    """A tensor of ``shape`` whose elements are all one zero: vLLM reads its shape and dtype."""
    return torch.zeros(1, dtype=dtype).view((1,) * len(shape)).expand(shape)


class SlotTable:
    """One layer's slots, each referring to its adapter's own tensors.

    ``pairs`` is what the kernel reads; ``dtype``, ``half``, ``width`` and
    ``used`` (whether any slot holds an adapter) are what the wrapper asks of
    a projection's pairs; ``a`` and ``b`` the placeholders vLLM keeps (one per
    slice, or one tensor for a layer that keeps one).
    """

    __slots__ = ("name", "pairs", "dtype", "half", "width", "d_outs", "a", "b", "_held", "used",
                 "log", "int8", "__weakref__")

    def __init__(self, name, n_slots, d_in, d_outs, dtype, rank, tupled, int8=False):
        self.name = name
        self.int8 = bool(int8)
        self.pairs = SlotPairs.per_slot(n_slots, d_in, d_outs, _KINDS[dtype],
                                        weights="int8" if self.int8 else None)
        self.dtype = dtype
        self.half = HALF.get(dtype)
        self.width = sum(d_outs)
        self.d_outs = tuple(d_outs)
        self.log = None  # while vLLM's set_lora runs: what it writes (see _recorded)
        a = tuple(_placeholder((n_slots, 1, rank, d_in), dtype) for _ in d_outs)
        b = tuple(_placeholder((n_slots, 1, d, rank), dtype) for d in d_outs)
        self.a, self.b = (a, b) if tupled else (a[0], b[0])
        for t in (*a, *b):
            _tables[t.data_ptr()] = self
        self._held = [0] * n_slots  # slices that hold an adapter, per slot
        self.used = False

    def refresh(self) -> bool:
        """Nothing to follow: vLLM's slot writes reach :meth:`set` (the stacked pairs' protocol)."""
        return False

    @property
    def n_slices(self) -> int:
        return self.pairs.n_slices

    def set(self, index: int, factors) -> None:
        """Slot ``index`` holds ``factors``: per slice, ``(A, B)`` as vLLM wrote them, or ``None``.

        Every slice is checked and laid out before any slot changes: a
        refused adapter leaves the slot as it was.
        """
        laid = [None if f is None else self._lay(i, *f) for i, f in enumerate(factors)]
        for i, f in enumerate(laid):
            if f is None:
                self.pairs.clear_slot(i, index)
            else:
                self.pairs.set_slot(i, index, *f)
        self._held[index] = sum(f is not None for f in laid)
        self.used = any(self._held)

    def clear(self, index: int) -> None:
        for i in range(self.pairs.n_slices):
            self.pairs.clear_slot(i, index)
        self._held[index] = 0
        self.used = any(self._held)

    def _lay(self, i, a, b):
        """Slice ``i``'s ``A`` ``(k, <= d_in)`` and ``B`` ``(<= d_out, k)`` as the kernel reads them.

        ``A`` as it is when it is C-contiguous in the table's dtype; ``B``'s
        values moved into the transposed layout in place (the tensor vLLM's
        cache holds keeps its shape and values, with strides ``(1, d_out)``),
        once: an adapter activated again is read as it lies.  Narrower
        factors (vLLM pads them with zeros) and other dtypes are copied.  An
        int8 table quantizes them instead: ``(A8, B^T8, (a_scale, b_scale))``.
        """
        d_in, d_out = self.pairs.d_in, self.d_outs[i]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or a.shape[0] < 1 \
                or a.shape[1] > d_in or b.shape[0] > d_out:
            raise ValueError(f"lorahook: {self.name}: an adapter's A {tuple(a.shape)} and B "
                             f"{tuple(b.shape)} do not fit slice {i} (A: (rank, at most "
                             f"{d_in}), B: (at most {d_out}, rank))")
        if a.device.type != "cpu" or b.device.type != "cpu":
            raise ValueError(f"lorahook: {self.name}: an adapter's tensors must be on the CPU, "
                             f"got {a.device} and {b.device}")
        k = a.shape[0]
        if self.int8:
            return self._quantized(a, b, d_in, d_out)
        with torch.inference_mode():  # vLLM's cache may hold inference tensors
            if a.shape[1] == d_in and a.dtype == self.dtype and a.is_contiguous():
                at = a
            elif a.shape[1] == d_in and a.dtype == self.dtype:
                at = a.contiguous()
                a.set_(at.untyped_storage(), at.storage_offset(), a.shape, at.stride())
            else:
                at = torch.zeros((k, d_in), dtype=self.dtype)
                at[:, :a.shape[1]] = a
            if b.shape[0] == d_out and b.dtype == self.dtype and b.stride() == (1, d_out):
                bt = b.t()  # laid out at an earlier activation
            elif b.shape[0] == d_out and b.dtype == self.dtype:
                bt = b.t().contiguous()
                b.set_(bt.untyped_storage(), bt.storage_offset(), b.shape, (1, d_out))
            else:
                bt = torch.zeros((k, d_out), dtype=self.dtype)
                bt[:, :b.shape[0]] = b.t()
        return array_of(at.detach(), []), array_of(bt.detach(), [])

    @staticmethod
    def _quantized(a, b, d_in, d_out):
        """``A`` and ``B^T`` (zero-padded to the slice's widths) in int8, with their scales."""
        k = a.shape[0]
        with torch.inference_mode():
            a32 = torch.zeros((k, d_in), dtype=torch.float32)
            a32[:, :a.shape[1]] = a
            bt32 = torch.zeros((k, d_out), dtype=torch.float32)
            bt32[:, :b.shape[0]] = b.t()
        if not (torch.isfinite(a32).all() and torch.isfinite(bt32).all()):
            raise ValueError("lorahook: an adapter's A or B holds values that are not finite")
        (qa, sa), (qbt, sb) = quantized(a32.numpy(), 1), quantized(bt32.numpy(), 0)
        return qa, qbt, (sa, sb)

    def apply_converted(self, rows, covered, x, y, scale, add, team) -> None:
        """The call on rows the fast path does not take (another dtype or layout).

        ``x`` converted to the table's dtype, the delta made apart, then added
        to (or written into) ``y``'s covered rows (``covered``: their
        indices); never vLLM's own op, which would read the placeholders.
        """
        x2 = x.reshape(-1, x.shape[-1]).to(self.dtype).contiguous()
        if x2.shape[1] != self.pairs.d_in:
            raise ValueError(f"lorahook: {self.name}: rows of width {x2.shape[1]}, expected "
                             f"{self.pairs.d_in}")
        delta = torch.zeros((x2.shape[0], self.width), dtype=self.dtype)
        apply_pairs_tensors(rows, x2, delta, self.pairs, self.dtype, scale, add=False, team=team)
        try:
            y2 = y.view(-1, y.shape[-1])
        except RuntimeError as exc:
            raise RuntimeError(f"lorahook: {self.name}: the output's layout has no 2-D view "
                               f"(shape {tuple(y.shape)}, strides {y.stride()})") from exc
        if y2.shape[1] < self.width:
            raise ValueError(f"lorahook: {self.name}: an output of width {y2.shape[1]}, "
                             f"expected at least {self.width}")
        part = delta.index_select(0, covered).to(y.dtype)
        if add:
            y2[covered, :self.width] += part
        else:
            y2[covered, :self.width] = part


# ---------------------------------------------------------------------------
# vLLM's set_lora and reset_lora, run against recorders
# ---------------------------------------------------------------------------

class _Recorder:
    """Stands in for one stacked tensor while vLLM's ``set_lora`` runs.

    ``stacked[index, 0, :r, :c].copy_(src)`` and ``stacked[index] = 0`` are
    written to the table's log as ``("copy", side, slice, key, src)`` and
    ``("fill", side, slice, key, value)``; anything else vLLM reads (its
    shape, dtype, device) is the placeholder's.
    """

    def __init__(self, placeholder, side, i, log):
        self._placeholder, self._side, self._i, self._log = placeholder, side, i, log

    def __getattr__(self, name):
        return getattr(self._placeholder, name)

    def __getitem__(self, key):
        return _Target(self, key)

    def __setitem__(self, key, value):
        self._log.append(("fill", self._side, self._i, key, value))


class _Target:
    def __init__(self, recorder, key):
        self._recorder, self._key = recorder, key

    def copy_(self, src, non_blocking=False):
        r = self._recorder
        r._log.append(("copy", r._side, r._i, self._key, src))
        return self


def _check_key(key, index, name):
    """A recorded key must name slot ``index`` and a region from the origin."""
    parts = key if isinstance(key, tuple) else (key,)
    ok = bool(parts) and parts[0] == index
    for p in parts[1:]:
        if isinstance(p, slice):
            ok = ok and p.start in (None, 0) and p.step in (None, 1)
        else:
            ok = ok and p == 0
    if not ok:
        raise TypeError(f"lorahook: {name}: vLLM wrote {key!r} while setting slot {index}, a "
                        "region lorahook does not follow")


def _recorded(layer, table, index, run):
    """Run vLLM's ``run()`` with recorders in place of ``layer``'s stacked tensors.

    Returns each slice's ``[A, B]`` as vLLM would have written them into slot
    ``index`` (``None`` for a slice it left empty).
    """
    log: list = []
    a, b = table.a, table.b
    tupled = isinstance(a, tuple)
    ra = tuple(_Recorder(t, 0, i, log) for i, t in enumerate(a if tupled else (a,)))
    rb = tuple(_Recorder(t, 1, i, log) for i, t in enumerate(b if tupled else (b,)))
    layer.lora_a_stacked, layer.lora_b_stacked = (ra, rb) if tupled else (ra[0], rb[0])
    table.log = log
    try:
        run()
    finally:
        table.log = None
        layer.lora_a_stacked, layer.lora_b_stacked = a, b
    factors = [[None, None] for _ in range(table.n_slices)]
    for entry in log:
        if entry[0] == "reset":
            factors = [[None, None] for _ in range(table.n_slices)]
            continue
        kind, side, i, key, value = entry
        _check_key(key, index, table.name)
        if kind == "fill" and not (isinstance(value, (int, float)) and value == 0):
            raise TypeError(f"lorahook: {table.name}: vLLM filled a slot with {value!r}")
        factors[i][side] = value if kind == "copy" else None
    return factors


# ---------------------------------------------------------------------------
# the patch of vLLM's LoRA layer classes
# ---------------------------------------------------------------------------

def _served(layer, lora_config) -> str | None:
    """Why ``layer`` keeps vLLM's slots, or ``None`` when lorahook holds its slots."""
    name = type(layer).__name__
    if os.environ.get("LORAHOOK_VLLM_SLOTS", "").strip() == "stacked":
        return "LORAHOOK_VLLM_SLOTS=stacked"
    if name not in SERVED or not type(layer).__module__.startswith("vllm.lora.layers"):
        return _WHY_NOT.get(name, "lorahook does not know how this layer reads its slots")
    if getattr(lora_config, "fully_sharded_loras", False) or getattr(layer, "tp_size", 1) != 1:
        return "its slots are sharded over tensor-parallel ranks"
    if lora_config.lora_dtype not in _KINDS:
        return f"the LoRA dtype is {lora_config.lora_dtype}"
    device = getattr(layer, "device", None)
    if device is not None and torch.device(device).type != "cpu":
        return f"it lives on {device}"
    return None


def _probe(layer, original, lora_config, model_config):
    """vLLM's own weights for one slot of rank 1: the slices' shapes, without the memory.

    Returns ``(d_in, d_outs, tupled)`` or the reason the shapes are not the
    ones lorahook serves.
    """
    probe = copy.copy(lora_config)
    object.__setattr__(probe, "max_lora_rank", 1)
    try:
        original(layer, 1, probe, model_config)
    finally:
        layer.lora_config = lora_config
    a, b = layer.lora_a_stacked, layer.lora_b_stacked
    tupled = isinstance(a, tuple)
    a, b = (tuple(a), tuple(b)) if tupled else ((a,), (b,))
    if not 1 <= len(a) <= 8 or len(a) != len(b):
        return f"it has {len(a)} slices"
    for t, side in ((*zip(a, "a" * len(a)), *zip(b, "b" * len(b)))):
        if t.dim() != 4 or t.shape[0] != 1 or t.shape[1] != 1 or (
                t.shape[2] if side == "a" else t.shape[3]) != 1:
            return f"its stacked {side.upper()} has shape {tuple(t.shape)}"
    d_in = {t.shape[3] for t in a}
    if len(d_in) != 1:
        return f"its slices read inputs of widths {sorted(d_in)}"
    return d_in.pop(), [t.shape[2] for t in b], tupled


def _create(original):
    def create_lora_weights(self, max_loras, lora_config, model_config=None, *args, **kwargs):
        why = _served(self, lora_config) if not args and not kwargs else "of its arguments"
        if why is None:
            got = _probe(self, original, lora_config, model_config)
            if isinstance(got, str):
                why = got
        int8 = adapter_dtype() == "int8"
        if why is not None:
            _once(("kept", type(self).__name__, why), logging.INFO,
                  "lorahook: %s layers keep vLLM's slots (--max-loras x --max-lora-rank%s): %s",
                  type(self).__name__, ", in vLLM's LoRA dtype, not int8" if int8 else "", why)
            return original(self, max_loras, lora_config, model_config, *args, **kwargs)
        d_in, d_outs, tupled = got
        table = SlotTable(type(self).__name__, max_loras, d_in, d_outs, lora_config.lora_dtype,
                          lora_config.max_lora_rank, tupled, int8)
        if int8:
            _once("int8", logging.INFO, "lorahook: adapters held in int8 in lorahook's slots "
                  "(LORAHOOK_VLLM_ADAPTER_DTYPE=int8), a scale per row of A and per output")
        self.lora_a_stacked, self.lora_b_stacked = table.a, table.b
        self._lorahook_slots = table
        _once("served", logging.INFO,
              "lorahook: LoRA slots refer to each adapter's own tensors at its own rank (no "
              "--max-lora-rank padding, no copy of vLLM's CPU cache)")
    create_lora_weights.lorahook = True
    return create_lora_weights


def _set(original):
    def set_lora(self, index, lora_a, lora_b, *args, **kwargs):
        table = self.__dict__.get("_lorahook_slots")
        if table is None or table.log is not None:  # vLLM's slots, or a set_lora's super()
            return original(self, index, lora_a, lora_b, *args, **kwargs)
        factors = _recorded(self, table, index,
                            lambda: original(self, index, lora_a, lora_b, *args, **kwargs))
        for i, (a, b) in enumerate(factors):
            if (a is None) != (b is None):
                raise TypeError(f"lorahook: {table.name}: vLLM set slice {i} of slot {index} "
                                "with only one of A and B")
        table.set(index, [None if a is None else (a, b) for a, b in factors])
    set_lora.lorahook = True
    return set_lora


def _reset(original):
    def reset_lora(self, index, *args, **kwargs):
        table = self.__dict__.get("_lorahook_slots")
        if table is None:
            return original(self, index, *args, **kwargs)
        if table.log is not None:  # inside set_lora: the slot is set as a whole after it
            table.log.append(("reset",))
        else:
            table.clear(index)
    reset_lora.lorahook = True
    return reset_lora


def patch_layers() -> None:
    """Give vLLM's LoRA layer classes lorahook's slots (see the module's docstring); idempotent."""
    import vllm.lora.layers as layers

    for name in layers.__all__:
        cls = getattr(layers, name, None)
        if not isinstance(cls, type) or not issubclass(cls, layers.BaseLayerWithLoRA):
            continue
        for method, wrap in (("create_lora_weights", _create), ("set_lora", _set),
                             ("reset_lora", _reset)):
            current = getattr(cls, method, None)
            if current is None or getattr(current, "lorahook", False):
                continue
            setattr(cls, method, wrap(current))
