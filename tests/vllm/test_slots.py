"""lorahook.vllm.slots: LoRA layers whose slots refer to each adapter's own tensors.

vLLM's layer classes are stood in for by a miniature of one (the same
``create_lora_weights`` / ``set_lora`` / ``reset_lora`` code shape as vLLM's
merged column-parallel layer, under its name), so the table, the recorders
and the in-place layout of ``B`` are tested here without an engine; the real
classes run in tests/vllm/test_engine.py.  Results against float64.
"""
import types

import numpy as np
import pytest

from required import need

need("torch", "LORAHOOK_REQUIRE_VLLM")
need("vllm", "LORAHOOK_REQUIRE_VLLM")
import torch  # noqa: E402

from lorahook.vllm import slots  # noqa: E402
from lorahook._core.slot_rows import SlotRows  # noqa: E402
from lorahook._core.slot_pairs import apply_pairs_tensors  # noqa: E402

D_IN, OUTS = 24, (40, 16)


class Merged(torch.nn.Module):
    """vLLM's ``MergedColumnParallelLinearWithLoRA`` in miniature: two slices, lists of factors."""

    n_slices = 2
    input_size = D_IN
    output_slices = OUTS
    tp_size = 1
    device = torch.device("cpu")

    def create_lora_weights(self, max_loras, lora_config, model_config=None):
        self.lora_config = lora_config
        rank, dt = lora_config.max_lora_rank, lora_config.lora_dtype
        self.lora_a_stacked = tuple(torch.zeros(max_loras, 1, rank, self.input_size, dtype=dt)
                                    for _ in range(self.n_slices))
        self.lora_b_stacked = tuple(torch.zeros(max_loras, 1, d, rank, dtype=dt)
                                    for d in self.output_slices)

    def reset_lora(self, index):
        for s in range(self.n_slices):
            self.lora_a_stacked[s][index] = 0
            self.lora_b_stacked[s][index] = 0

    def set_lora(self, index, lora_a, lora_b):
        self.reset_lora(index)
        for i in range(self.n_slices):
            if (a := lora_a[i]) is not None:
                self.lora_a_stacked[i][index, 0, :a.shape[0], :a.shape[1]].copy_(
                    a, non_blocking=True)
            if (b := lora_b[i]) is not None:
                self.lora_b_stacked[i][index, 0, :b.shape[0], :b.shape[1]].copy_(
                    b, non_blocking=True)


Merged.__name__ = Merged.__qualname__ = "MergedColumnParallelLinearWithLoRA"
Merged.__module__ = "vllm.lora.layers.column_parallel_linear"


class Unknown(Merged):
    """A layer class lorahook does not know: it keeps vLLM's slots."""


def _patched(cls):
    """``cls`` with lorahook's wrappers, as patch_layers gives vLLM's classes."""
    sub = type(cls.__name__, (cls,), {"__module__": cls.__module__})
    for method, wrap in (("create_lora_weights", slots._create), ("set_lora", slots._set),
                         ("reset_lora", slots._reset)):
        setattr(sub, method, wrap(getattr(cls, method)))
    return sub


def _config(rank=64, dtype=torch.float32):
    return types.SimpleNamespace(max_lora_rank=rank, lora_dtype=dtype, fully_sharded_loras=False)


def _adapter(rank, dtype=torch.float32, seed=0, inference=False):
    g = torch.Generator().manual_seed(seed)
    a = [torch.randn(rank, D_IN, generator=g) for _ in OUTS]
    b = [torch.randn(d, rank, generator=g) for d in OUTS]
    if inference:  # as vLLM's cache may hold them
        with torch.inference_mode():
            return [t.to(dtype) for t in a], [t.to(dtype) for t in b]
    return [t.to(dtype) for t in a], [t.to(dtype) for t in b]


def _layer(max_loras, max_rank, dtype=torch.float32, cls=Merged):
    """A patched layer whose LoRA weights vLLM has created."""
    layer = _patched(cls)()
    layer.create_lora_weights(max_loras, _config(max_rank, dtype))
    return layer


def _assert_delta(layer, slot_of_row, adapters, seed=0):
    """The layer's delta on random rows equals float64's (float32 accuracy)."""
    x = torch.randn(len(slot_of_row), D_IN, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(seed))
    got, want = _delta(layer, slot_of_row, x, adapters)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-4)
    return got


def _delta(layer, slot_of_row, x, adapters):
    """The layer's delta through lorahook's kernel, and float64's."""
    table = layer._lorahook_slots
    rows = SlotRows(np.asarray(slot_of_row), table.pairs.n_slots)
    y = torch.zeros(len(slot_of_row), sum(OUTS), dtype=table.dtype)
    assert apply_pairs_tensors(rows, x.to(table.dtype), y, table.pairs, table.dtype, 1.0)
    want = torch.zeros(len(slot_of_row), sum(OUTS), dtype=torch.float64)
    for r, s in enumerate(slot_of_row):
        if s >= 0 and s in adapters:
            a, b = adapters[s]
            want[r] = torch.cat([(bi.double() @ (ai.double() @ x[r].to(table.dtype).double()))
                                 if ai is not None else torch.zeros(d, dtype=torch.float64)
                                 for ai, bi, d in zip(a, b, OUTS)])
    return y.double(), want


def test_slots_hold_nothing_until_an_adapter_and_then_its_own_rank():
    layer = _layer(256, 64)
    table = layer._lorahook_slots
    # vLLM sees its shapes and dtype, and the placeholders hold one element each
    assert [tuple(t.shape) for t in layer.lora_a_stacked] == [(256, 1, 64, D_IN)] * 2
    assert [tuple(t.shape) for t in layer.lora_b_stacked] == [(256, 1, d, 64) for d in OUTS]
    for t in (*layer.lora_a_stacked, *layer.lora_b_stacked):
        assert t.untyped_storage().nbytes() == 4 and slots.table_of(t) is table
    assert layer.lora_config.max_lora_rank == 64  # vLLM's own config is kept
    assert not table.used
    a8, b8 = _adapter(8, seed=1)
    b8_before = [t.clone() for t in b8]
    layer.set_lora(3, a8, b8)
    assert table.used and [table.pairs.ranks(i)[3] for i in range(2)] == [8, 8]
    for b, before in zip(b8, b8_before):  # the cache's B: same values, transposed layout
        assert torch.equal(b, before) and b.stride() == (1, b.shape[0])
    a16, b16 = _adapter(16, seed=2)
    a16[1] = b16[1] = None  # an adapter on the first slice only
    layer.set_lora(0, a16, b16)
    got = _assert_delta(layer, [3, 0, -1, 3, 1, 0], {3: (a8, b8), 0: (a16, b16)})
    assert torch.equal(got[2], torch.zeros(sum(OUTS), dtype=torch.float64))


def test_an_adapter_set_again_is_read_where_it_lies():
    layer = _layer(4, 64)
    a, b = _adapter(8, seed=3)
    layer.set_lora(0, a, b)
    where = [t.data_ptr() for t in b]
    layer.set_lora(2, a, b)  # activated again (another slot): no copy, no new layout
    assert [t.data_ptr() for t in b] == where
    _assert_delta(layer, [0, 2, 1], {0: (a, b), 2: (a, b)})


def test_a_slot_reused_at_another_rank_and_reset():
    layer = _layer(2, 64)
    table = layer._lorahook_slots
    a64, b64 = _adapter(64, seed=4)
    layer.set_lora(1, a64, b64)
    a4, b4 = _adapter(4, seed=5, inference=True)  # inference tensors, as a cache may hold
    layer.set_lora(1, a4, b4)
    assert [table.pairs.ranks(i)[1] for i in range(2)] == [4, 4]
    _assert_delta(layer, [1, 1], {1: (a4, b4)})
    layer.reset_lora(1)
    assert not table.used and table.pairs.ranks(0)[1] == 0
    assert torch.count_nonzero(_assert_delta(layer, [1, 1], {})) == 0


def test_bfloat16_slots_against_float64():
    layer = _layer(3, 16, torch.bfloat16)
    a, b = _adapter(16, torch.bfloat16, seed=6)
    layer.set_lora(2, a, b)
    x = torch.randn(5, D_IN, dtype=torch.float64)
    got, want = _delta(layer, [2, -1, 2, 2, 0], x, {2: (a, b)})
    xb = x.to(torch.bfloat16).double().abs()
    mag = torch.cat([(bi.double().abs() @ (ai.double().abs() @ xb.T)).T for ai, bi in zip(a, b)],
                    dim=1)
    # float32 sums of the bfloat16 products, each output rounded once to bfloat16
    assert torch.all((got - want).abs()[[0, 2, 3]] <= 8e-3 * mag[[0, 2, 3]])
    assert torch.count_nonzero(got[[1, 4]]) == 0


def test_a_refused_adapter_leaves_the_slot_as_it_was():
    layer = _layer(2, 8)
    a, b = _adapter(8, seed=7)
    layer.set_lora(0, a, b)
    bad_a, bad_b = _adapter(8, seed=8)
    bad_b[1] = torch.randn(OUTS[1] + 3, 8)  # taller than the slice
    with pytest.raises(ValueError, match="do not fit slice 1"):
        layer.set_lora(0, bad_a, bad_b)
    _assert_delta(layer, [0, 0], {0: (a, b)})


def test_rows_of_another_dtype_go_through_the_same_kernel():
    layer = _layer(2, 8)
    table = layer._lorahook_slots
    a, b = _adapter(8, seed=9)
    layer.set_lora(1, a, b)
    x = torch.randn(4, D_IN, dtype=torch.float64)
    rows = SlotRows(np.array([1, -1, 1, 0]), 2)
    y = torch.full((4, sum(OUTS)), 2.0, dtype=torch.float64)
    covered = torch.tensor([0, 2, 3])
    table.apply_converted(rows, covered, x, y, 1.0, True, None)
    _, want = _delta(layer, [1, -1, 1, 0], x, {1: (a, b)})
    assert torch.allclose(y, want + 2.0, rtol=1e-5, atol=1e-4)


def test_unknown_layers_and_the_switch_keep_vllms_slots(monkeypatch, caplog):
    layer = _layer(3, 8, cls=Unknown)
    assert "_lorahook_slots" not in layer.__dict__
    assert layer.lora_a_stacked[0].untyped_storage().nbytes() == 3 * 8 * D_IN * 4
    a, b = _adapter(8, seed=10)
    layer.set_lora(1, a, b)  # vLLM's own copy into its slots
    assert torch.equal(layer.lora_a_stacked[0][1, 0], a[0])
    monkeypatch.setenv("LORAHOOK_VLLM_SLOTS", "stacked")
    layer = _layer(3, 8)
    assert "_lorahook_slots" not in layer.__dict__
    assert layer.lora_b_stacked[1].shape == (3, 1, OUTS[1], 8)


def _dequantized(adapter):
    """An adapter's factors as an int8 table holds them (numpy's rounding, float64)."""
    from lora_refs import int8_values
    a, b = adapter
    return ([None if t is None else torch.from_numpy(int8_values(t.float().numpy(), 1))
             for t in a],   # a scale per row of A
            [None if t is None else torch.from_numpy(int8_values(t.float().numpy(), 1))
             for t in b])   # and per output: per row of B


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_int8_slots_against_float64_on_the_dequantized_factors(monkeypatch, dtype):
    monkeypatch.setenv("LORAHOOK_VLLM_ADAPTER_DTYPE", "int8")
    layer = _layer(3, 16, dtype)
    table = layer._lorahook_slots
    assert table.int8 and table.pairs.int8
    a, b = _adapter(16, dtype, seed=10)
    a4, b4 = _adapter(4, dtype, seed=11)
    a4[1] = b4[1] = None
    layer.set_lora(2, a, b)
    layer.set_lora(0, a4, b4)
    assert [table.pairs.ranks(i)[2] for i in range(2)] == [16, 16]
    x = torch.randn(6, D_IN, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    got, want = _delta(layer, [2, -1, 0, 2, 1, 0], x, {2: _dequantized((a, b)),
                                                        0: _dequantized((a4, b4))})
    if dtype == torch.float32:
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-4)
    else:  # each output rounded once to bfloat16
        assert torch.allclose(got, want, rtol=8e-3, atol=8e-3 * float(want.abs().max()))
    assert torch.count_nonzero(got[[1, 4]]) == 0
    layer.reset_lora(2)
    assert table.pairs.ranks(0)[2] == 0


def test_the_adapter_dtype_setting_is_checked(monkeypatch):
    monkeypatch.setenv("LORAHOOK_VLLM_ADAPTER_DTYPE", "int4")
    with pytest.raises(ValueError, match="LORAHOOK_VLLM_ADAPTER_DTYPE must be 'auto' or 'int8'"):
        _layer(2, 8)
    monkeypatch.setenv("LORAHOOK_VLLM_ADAPTER_DTYPE", "auto")
    assert not _layer(2, 8)._lorahook_slots.int8
