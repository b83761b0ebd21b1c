"""The direct kernel paths of apply_lora_rows keep the hook contract.

A plain LoraAdapter's kernel is looked up by the core itself, and a bound
batch reuses a compiled plan per projection; subclasses and error cases must
behave exactly as the contract says.  Results are checked against float64
numpy.
"""
import numpy as np
import pytest

from lorahook import AdapterSet, LoraAdapter, LoraLayer, apply_lora_rows
from lorahook._core import sources as _sources


def _layer(rng, d_in, d_out, rank=4, scale=0.5):
    return LoraLayer(rng.standard_normal((rank, d_in)).astype(np.float32),
                     rng.standard_normal((d_out, rank)).astype(np.float32), scale)


def _ref(layer, x, y, factor=1.0):
    return y.astype(np.float64) + factor * layer.scale * (
        (x.astype(np.float64) @ layer.a.T.astype(np.float64)) @ layer.b.T.astype(np.float64))


def _close(got, ref):
    assert np.max(np.abs(got - ref)) <= 1e-5 * max(np.max(np.abs(ref)), 1.0)


class OnlyLayerZero(LoraAdapter):
    """Turns every projection off except on layer 0, through is_active alone."""

    def is_active(self, layer_idx, module):
        return layer_idx == 0 and super().is_active(layer_idx, module)


@pytest.mark.parametrize("rows", [1, 40])
def test_a_subclass_is_active_is_honoured(rows):
    rng = np.random.default_rng(rows)
    l0, l1 = _layer(rng, 16, 24), _layer(rng, 16, 24)
    hook = OnlyLayerZero({(0, "q_proj"): l0, (1, "q_proj"): l1})
    assert OnlyLayerZero._core_dispatch == _sources.DISPATCH_ASK_HOOK
    assert LoraAdapter._core_dispatch == _sources.DISPATCH_KERNELS
    x = rng.standard_normal((rows, 16)).astype(np.float32)
    y0 = rng.standard_normal((rows, 24)).astype(np.float32)
    y = y0.copy()
    apply_lora_rows(hook, 1, "q_proj", x, y, 16, 24)
    assert np.array_equal(y, y0)  # inactive: never written
    apply_lora_rows(hook, 0, "q_proj", x, y, 16, 24)
    _close(y, _ref(l0, x, y0))


def test_is_active_and_the_core_agree_on_rank_zero_and_missing_keys():
    rng = np.random.default_rng(1)
    live = _layer(rng, 8, 8)
    empty = LoraLayer(np.zeros((0, 8), np.float32), np.zeros((8, 0), np.float32), 1.0)
    hook = LoraAdapter({(0, "q_proj"): live, (0, "k_proj"): empty})
    assert hook.is_active(0, "q_proj")
    assert not hook.is_active(0, "k_proj") and not hook.is_active(0, "v_proj")
    x = rng.standard_normal((3, 8)).astype(np.float32)
    for module in ("k_proj", "v_proj"):
        y = rng.standard_normal((3, 8)).astype(np.float32)
        before = y.copy()
        apply_lora_rows(hook, 0, module, x, y, 8, 8)
        assert np.array_equal(y, before)


def test_direct_path_width_mismatch_names_both():
    rng = np.random.default_rng(2)
    hook = LoraAdapter({(3, "o_proj"): _layer(rng, 16, 24)})
    x = np.zeros((2, 12), np.float32)
    y = np.zeros((2, 24), np.float32)
    with pytest.raises(ValueError, match=r"\(16, 24\).*\(12, 24\)"):
        apply_lora_rows(hook, 3, "o_proj", x, y, 12, 24)
    assert not y.any()


def test_bound_batch_plan_is_reused_and_still_checks_widths():
    rng = np.random.default_rng(3)
    la, lb = _layer(rng, 16, 24), _layer(rng, 16, 24, scale=1.5)
    s = AdapterSet()
    s.add("a", LoraAdapter({(0, "up_proj"): la}))
    s.add("b", LoraAdapter({(0, "up_proj"): lb}))
    names = ["a", None, "b", "a", "b", None]
    bound = s.bind(names, scales=[1.0, 1.0, 2.0, 0.5, 1.0, 1.0])
    factors = [1.0, 0, 2.0, 0.5, 1.0, 0]
    x = rng.standard_normal((6, 16)).astype(np.float32)
    for _ in range(3):  # the first call makes the plan, the others reuse it
        y0 = rng.standard_normal((6, 24)).astype(np.float32)
        y = y0.copy()
        apply_lora_rows(bound, 0, "up_proj", x, y, 16, 24)
        for i, (name, f) in enumerate(zip(names, factors)):
            if name is None:
                assert np.array_equal(y[i], y0[i])
            else:
                _close(y[i], _ref(la if name == "a" else lb, x[i], y0[i], f))
    wide = np.zeros((6, 32), np.float32)
    with pytest.raises(ValueError, match=r"adapter 'a' layer \(0, 'up_proj'\)"):
        apply_lora_rows(bound, 0, "up_proj", x, wide, 16, 32)
    assert not wide.any()


def test_a_registered_virtual_subclass_gets_one_apply_per_row():
    # the LoraHook docstring: anything isinstance(h, LoraHook) accepts is a hook; a
    # registered class takes the generic per-row path
    from lorahook import LoraHook

    class Lookalike:
        def __init__(self):
            self.rows = []

        def apply(self, layer_idx, module, x, output):
            assert not x.flags.writeable and output.flags.writeable
            self.rows.append(float(x[0]))
            output += 2 * x

        def is_active(self, layer_idx, module):
            return module == "q_proj"

    LoraHook.register(Lookalike)
    hook = Lookalike()
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    y = np.ones((3, 4), np.float32)
    apply_lora_rows(hook, 0, "k_proj", x, y, 4, 4)
    assert (y == 1).all() and hook.rows == []  # inactive: never called
    apply_lora_rows(hook, 0, "q_proj", x, y, 4, 4)
    assert hook.rows == [0.0, 4.0, 8.0]  # one apply per row, in row order
    np.testing.assert_array_equal(y, 1 + 2 * x)


def test_a_registered_class_without_is_active_counts_as_active():
    from lorahook import LoraHook

    class OnlyApply:
        def apply(self, layer_idx, module, x, output):
            output += 1

    LoraHook.register(OnlyApply)
    y = np.zeros((2, 4), np.float32)
    apply_lora_rows(OnlyApply(), 3, "v_proj", np.zeros((2, 4), np.float32), y, 4, 4)
    assert (y == 1).all()


@pytest.mark.parametrize("hook", [object(), "q_proj", None, 1.5])
def test_anything_else_is_a_type_error_with_nothing_written(hook):
    y = np.zeros((1, 4), np.float32)
    with pytest.raises(TypeError, match=f"hook must be a lorahook.LoraHook, got {type(hook).__name__}"):
        apply_lora_rows(hook, 0, "q_proj", np.zeros((1, 4), np.float32), y, 4, 4)
    assert not y.any()
