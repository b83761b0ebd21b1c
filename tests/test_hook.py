"""The hook contract: call checks, the inactive shortcut, the per-row Python path."""
import numpy as np
import pytest

import lorahook
from lorahook import LoraHook, NoopLoraHook, apply_lora_rows


class RowSensitiveHook(LoraHook):
    def __init__(self):
        self.calls = 0
        self.seen = []

    def apply(self, layer_idx, module, x, output):
        assert x.shape == (2,) and output.shape == (3,)
        self.calls += 1
        self.seen.append((x, output))
        output[:] = x[0]


class InactiveHook(LoraHook):
    def __init__(self):
        self.calls = 0

    def apply(self, layer_idx, module, x, output):
        self.calls += 1

    def is_active(self, layer_idx, module):
        return False


def test_applies_to_each_flattened_row():
    hook = RowSensitiveHook()
    x = np.array([1, 10, 2, 20, 3, 30], dtype=np.float32)
    out = np.zeros(9, dtype=np.float32)
    apply_lora_rows(hook, 0, "projection", x, out, 2, 3)
    assert hook.calls == 3
    assert out.tolist() == [1, 1, 1, 2, 2, 2, 3, 3, 3]


def test_python_hook_gets_readonly_input_and_aliasing_output_views():
    hook = RowSensitiveHook()
    x = np.array([[1, 10], [2, 20]], dtype=np.float32)
    out = np.zeros((2, 3), dtype=np.float32)
    apply_lora_rows(hook, 5, "q_proj", x, out, 2, 3)
    assert len(hook.seen) == 2
    for i, (xr, yr) in enumerate(hook.seen):
        assert isinstance(xr, np.ndarray) and xr.dtype == np.float32 and xr.ndim == 1
        assert not xr.flags.writeable and xr.tolist() == x[i].tolist()
        assert yr.flags.writeable and np.shares_memory(yr, out[i])
    assert x.flags.writeable  # the caller's array is left as it was


def test_inactive_hook_is_never_called_and_output_untouched():
    hook = InactiveHook()
    x = np.array([1, 10, 2, 20, 3, 30], dtype=np.float32)
    out = np.full(9, 7.0, dtype=np.float32)
    apply_lora_rows(hook, 0, "projection", x, out, 2, 3)
    assert hook.calls == 0
    assert out.tolist() == [7.0] * 9


def test_noop_hook_is_inactive_everywhere():
    hook = NoopLoraHook()
    assert not hook.is_active(0, "query")
    assert not hook.is_active(41, "ffn_output")
    out = np.ones(4, dtype=np.float32)
    apply_lora_rows(hook, 0, "query", np.ones(4, dtype=np.float32), out, 2, 2)
    assert out.tolist() == [1.0] * 4


def test_defaults_trust_the_caller():
    hook = RowSensitiveHook()
    assert hook.is_active(0, "x") is True
    assert hook.validate_against(object()) is None
    assert hook.validate_against_bert(6, 384, 1536) is None


def test_checks_run_even_for_inactive_hooks():
    hook = InactiveHook()
    with pytest.raises(ValueError, match="row counts must match"):
        apply_lora_rows(hook, 0, "q", np.zeros(4, np.float32), np.zeros(9, np.float32), 2, 3)
    with pytest.raises(TypeError, match="float32"):
        apply_lora_rows(NoopLoraHook(), 0, "q", np.zeros(4), np.zeros(6, np.float32), 2, 3)


def _call(hook=None, x=None, y=None, wi=2, wo=3, layer=0, module="q"):
    hook = NoopLoraHook() if hook is None else hook
    x = np.zeros(4, np.float32) if x is None else x
    y = np.zeros(6, np.float32) if y is None else y
    return apply_lora_rows(hook, layer, module, x, y, wi, wo)


@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(hook=object()), TypeError, ["hook", "LoraHook", "object"]),
    (dict(x=[0.0] * 4), TypeError, ["input", "ndarray", "list"]),
    (dict(y=np.zeros(6, np.float64)), TypeError, ["output", "float32", "float64"]),
    (dict(x=np.zeros(4, ">f4")), TypeError, ["input", "native byte order"]),
    (dict(x=np.zeros((1, 2, 2), np.float32)), ValueError, ["input", "3-D"]),
    (dict(x=np.zeros((4, 2), np.float32)[::2]), ValueError, ["input", "C-contiguous"]),
    (dict(wi=2.0), TypeError, ["input_row_width", "int", "float"]),
    (dict(wo=True), TypeError, ["output_row_width", "int", "bool"]),
    (dict(wi=0), ValueError, ["input_row_width", "> 0", "0"]),
    (dict(wo=-3), ValueError, ["output_row_width", "-3"]),
    (dict(wi=3), ValueError, ["input", "whole rows", "3"]),
    (dict(x=np.zeros((2, 3), np.float32)), ValueError, ["shape[1]", "input_row_width", "2"]),
    (dict(y=np.zeros(9, np.float32)), ValueError, ["row counts", "2 rows", "3 rows"]),
    (dict(layer="0"), TypeError, ["layer_idx", "int"]),
    (dict(module=3), TypeError, ["module", "str"]),
])
def test_bad_calls_name_the_problem(kwargs, exc, words):
    with pytest.raises(exc) as info:
        _call(**kwargs)
    for w in words:
        assert w in str(info.value)


def test_output_view_of_a_writable_array_is_accepted():
    base = np.zeros(6, np.float32)
    apply_lora_rows(RowSensitiveHook(), 0, "q", np.array([1, 10, 2, 20], np.float32),
                    base.view(), 2, 3)
    assert base.tolist() == [1, 1, 1, 2, 2, 2]


def test_readonly_output_refused_before_writing():
    y = np.zeros(6, np.float32)
    y.flags.writeable = False
    with pytest.raises(ValueError, match="output must be writable"):
        _call(hook=RowSensitiveHook(), y=y)


def test_readonly_input_is_fine_and_numpy_int_widths_accepted():
    x = np.array([1, 10, 2, 20], np.float32)
    x.flags.writeable = False
    y = np.zeros(6, np.float32)
    apply_lora_rows(RowSensitiveHook(), 0, "q", x, y, np.int64(2), np.int32(3))
    assert y.tolist() == [1, 1, 1, 2, 2, 2]


def test_overlapping_buffers_refused():
    buf = np.zeros(12, np.float32)
    with pytest.raises(ValueError, match="overlap"):
        apply_lora_rows(RowSensitiveHook(), 0, "q", buf[:4], buf[2:8], 2, 3)


def test_check_order_type_before_shape():
    # dtype is checked before ndim / widths, as the contract orders them
    with pytest.raises(TypeError, match="float32"):
        _call(x=np.zeros((1, 1, 1), np.float64), wi=0)
    with pytest.raises(ValueError, match="C-contiguous"):
        _call(x=np.zeros((4, 2), np.float32)[::2], wi=0)


def test_zero_rows_is_a_no_op():
    hook = RowSensitiveHook()
    apply_lora_rows(hook, 0, "q", np.zeros(0, np.float32), np.zeros((0, 3), np.float32), 2, 3)
    assert hook.calls == 0


def test_public_names():
    for name in ["LoraHook", "NoopLoraHook", "apply_lora_rows", "LoraLayer", "LoraAdapter",
                 "LoraValidationError", "LoraFormatError", "Qwen35Config", "BertConfig"]:
        assert hasattr(lorahook, name)
    assert issubclass(lorahook.LoraValidationError, ValueError)
    assert issubclass(lorahook.LoraFormatError, ValueError)


def test_hooks_carry_no_instance_dict():
    # every class of the contract declares its slots: no per-hook __dict__
    for hook in (NoopLoraHook(),):
        with pytest.raises(AttributeError):
            hook.__dict__
    assert LoraHook.__dict__["__slots__"] == ()
