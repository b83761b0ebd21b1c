"""AdapterSet.bind_sequences (guide: A whole generation loop): one hook for the prefill and every decode step.

Every result is checked row by row against a float64 numpy reference of the
adapter its sequence selected; rows without an adapter, or at scale zero, must
be bit-identical.
"""
import numpy as np
import pytest
from threaded import run_in_threads

from lorahook import AdapterSet, BoundSequences, LoraAdapter, LoraLayer, apply_lora_rows

D_IN, D_OUT = 24, 40
KEY = (1, "q_proj")


def _adapter(rng, rank, scale, bias=False, keys=(KEY,)):
    return LoraAdapter({key: LoraLayer(rng.standard_normal((rank, D_IN)),
                                       rng.standard_normal((D_OUT, rank)), scale,
                                       rng.standard_normal(D_OUT) if bias else None)
                        for key in keys})


@pytest.fixture
def adapters():
    rng = np.random.default_rng(0)
    s = AdapterSet()
    s.add("a", _adapter(rng, 4, 2.0))
    s.add("b", _adapter(rng, 16, 0.5, bias=True))
    s.add("c", _adapter(rng, 1, -1.5, keys=(KEY, (2, "v_proj"))))
    return s


def _reference(s, seq_adapters, factors, x, y0):
    """float64: row r gets its sequence's adapter, r // (n // S)."""
    n, S = len(x), len(seq_adapters)
    out = y0.astype(np.float64)
    for r in range(n):
        name = seq_adapters[r // (n // S)]
        if name is None:
            continue
        layer = s.get(name).layers.get(KEY)
        if layer is None:
            continue
        d = layer.b.astype(np.float64) @ (layer.a.astype(np.float64) @ x[r].astype(np.float64))
        if layer.bias is not None:
            d = d + layer.bias
        out[r] += factors[r // (n // S)] * layer.scale * d
    return out


def _check(got, ref):
    assert np.max(np.abs(got - ref)) <= 1e-5 * np.max(np.abs(ref))


SELECTIONS = [
    (["a", "b", None, "c"], [1.0, 1.0, 1.0, 1.0]),
    (["b", "b", "a", None, "a", "c"], [0.5, 2.0, 1.0, 1.0, 0.0, -1.0]),
    (["a"], [3.0]),
]


@pytest.mark.parametrize("seq_adapters, factors", SELECTIONS)
@pytest.mark.parametrize("rows_per_seq", [1, 2, 7, 33, 64])
def test_each_row_gets_its_sequences_adapter(adapters, seq_adapters, factors, rows_per_seq):
    hook = adapters.bind_sequences(seq_adapters, scales=factors)
    rng = np.random.default_rng(rows_per_seq)
    n = len(seq_adapters) * rows_per_seq
    x = rng.standard_normal((n, D_IN)).astype(np.float32)
    y0 = rng.standard_normal((n, D_OUT)).astype(np.float32)
    y = y0.copy()
    apply_lora_rows(hook, *KEY, x, y, D_IN, D_OUT)
    _check(y, _reference(adapters, seq_adapters, factors, x, y0))
    # rows of sequences with no adapter or scale zero: bit-identical
    for i, (name, f) in enumerate(zip(seq_adapters, factors)):
        if name is None or f == 0.0:
            rows = slice(i * rows_per_seq, (i + 1) * rows_per_seq)
            assert y[rows].tobytes() == y0[rows].tobytes()


def test_one_hook_serves_a_prefill_and_decode_steps_in_any_order(adapters):
    names = ["c", None, "a", "b"]
    hook = adapters.bind_sequences(names)
    rng = np.random.default_rng(3)
    for rows_per_seq in [24, 1, 1, 5, 1, 24, 9, 3, 1, 2, 1]:  # more lengths than plans kept
        n = 4 * rows_per_seq
        x = rng.standard_normal((n, D_IN)).astype(np.float32)
        y0 = rng.standard_normal(n * D_OUT).astype(np.float32)  # flattened 1-D output
        y = y0.copy()
        apply_lora_rows(hook, *KEY, x.reshape(-1), y, D_IN, D_OUT)
        _check(y.reshape(n, D_OUT), _reference(adapters, names, [1.0] * 4, x,
                                               y0.reshape(n, D_OUT)))


@pytest.mark.parametrize("n", [1, 3, 5, 10])
def test_a_row_count_not_a_multiple_of_the_sequences_is_refused_before_anything(adapters, n):
    hook = adapters.bind_sequences(["a", "b", None, "c"])
    x = np.ones((n, D_IN), np.float32)
    y = np.zeros((n, D_OUT), np.float32)
    # also for a projection nothing covers: a call check comes before is_active
    for key in (KEY, (7, "nothing")):
        with pytest.raises(ValueError, match=rf"multiple of 4, got {n} rows"):
            apply_lora_rows(hook, *key, x, y, D_IN, D_OUT)
    assert not y.any()


def test_zero_rows_are_a_multiple(adapters):
    hook = adapters.bind_sequences(["a", None])
    apply_lora_rows(hook, *KEY, np.zeros((0, D_IN), np.float32), np.zeros((0, D_OUT), np.float32),
                    D_IN, D_OUT)


def test_a_replace_after_binding_changes_nothing_in_the_bound_hook(adapters):
    hook = adapters.bind_sequences(["a", "b"])
    before = {name: adapters.get(name) for name in ("a", "b")}
    rng = np.random.default_rng(5)
    adapters.replace("a", _adapter(rng, 3, 9.0))
    adapters.remove("b")
    x = rng.standard_normal((6, D_IN)).astype(np.float32)
    y = np.zeros((6, D_OUT), np.float32)
    apply_lora_rows(hook, *KEY, x, y, D_IN, D_OUT)
    snapshot = AdapterSet()
    for name, adapter in before.items():
        snapshot.add(name, adapter)
    _check(y, _reference(snapshot, ["a", "b"], [1.0, 1.0], x, np.zeros((6, D_OUT), np.float32)))


def test_is_active_and_introspection(adapters):
    hook = adapters.bind_sequences(["c", None, "a"], scales={"a": 0.0})
    assert isinstance(hook, BoundSequences)
    assert hook.n_sequences == 3 and hook.seq_adapters == ("c", None, "a")
    assert sorted(hook.adapters) == ["c"]  # "a" at scale zero applies nothing
    assert hook.is_active(*KEY) and hook.is_active(2, "v_proj")
    assert not hook.is_active(0, "q_proj")
    assert not adapters.bind_sequences([None, None]).is_active(*KEY)
    with pytest.raises(TypeError, match="apply_lora_rows"):
        hook.apply(*KEY, np.zeros(D_IN, np.float32), np.zeros(D_OUT, np.float32))


def test_bad_selections_raise_like_bind(adapters):
    with pytest.raises(KeyError, match="nope"):
        adapters.bind_sequences(["a", "nope"])
    with pytest.raises(TypeError, match=r"seq_adapters\[1\]"):
        adapters.bind_sequences(["a", 3])
    with pytest.raises(TypeError, match="seq_adapters must be a sequence"):
        adapters.bind_sequences("a")
    with pytest.raises(ValueError, match=r"one value per sequence: expected 2 \(len\(seq_adapters\)\)"):
        adapters.bind_sequences(["a", "b"], scales=[1.0])
    with pytest.raises(ValueError, match="finite"):
        adapters.bind_sequences(["a", "b"], scales=[1.0, float("nan")])


def test_width_mismatch_names_the_adapter(adapters):
    hook = adapters.bind_sequences(["a", "b"])
    with pytest.raises(ValueError, match=r"adapter 'a' layer \(1, 'q_proj'\)"):
        apply_lora_rows(hook, *KEY, np.ones((2, D_IN), np.float32),
                        np.zeros((2, D_OUT + 1), np.float32), D_IN, D_OUT + 1)


def test_threads_applying_one_hook_with_different_row_counts(adapters):
    names = ["a", "b", None, "c"]
    hook = adapters.bind_sequences(names)

    def worker(seed):
        rng = np.random.default_rng(seed)
        for _ in range(40):
            n = 4 * int(rng.integers(1, 40))
            x = rng.standard_normal((n, D_IN)).astype(np.float32)
            y = np.zeros((n, D_OUT), np.float32)
            apply_lora_rows(hook, *KEY, x, y, D_IN, D_OUT)
            _check(y, _reference(adapters, names, [1.0] * 4, x, np.zeros((n, D_OUT))))

    run_in_threads(worker, [(seed,) for seed in range(4)])
