"""AdapterSet and bound batches: grouping, scales, snapshots, errors, hot swap under load."""
import gc
import math
import os
import threading
import time

import numpy as np
import pytest

from lorahook import (BertConfig, LoraAdapter, LoraHook, LoraLayer, LoraValidationError, apply_lora_rows)
from lorahook._core import segments as _segments
from lorahook import AdapterSet, BoundBatch

D_IN, D_OUT = 24, 40


@pytest.fixture(params=["row_loop", "batched"])
def kernel_path(request):
    """Run a test once with the sgemv row loop and once with the sgemm path."""
    old = _segments.set_gemm_crossover(10**9 if request.param == "row_loop" else 1)
    try:
        yield request.param
    finally:
        _segments.set_gemm_crossover(old)


def make_layer(rng, rank, d_in=D_IN, d_out=D_OUT, scale=1.0, bias=False):
    a = rng.standard_normal((rank, d_in)).astype(np.float32)
    b = rng.standard_normal((d_out, rank)).astype(np.float32)
    bv = rng.standard_normal(d_out).astype(np.float32) if bias else None
    return LoraLayer(a, b, scale=scale, bias=bv)


def ref_delta(layer, x, factor):
    """float64 reference for one row: factor * scale * (B @ (A @ x) + bias)."""
    a = layer.a.astype(np.float64)
    b = layer.b.astype(np.float64)
    d = b @ (a @ x.astype(np.float64))
    if layer.bias is not None:
        d = d + layer.bias.astype(np.float64)
    return factor * layer.scale * d


def reference(adapters, key, row_names, factors, x, out0):
    """Per-row float64 reference output of a bound batch for one projection."""
    ref = out0.astype(np.float64).copy()
    for i, name in enumerate(row_names):
        if name is None:
            continue
        layer = adapters[name].layers.get(key)
        if layer is None or layer.rank == 0:
            continue
        ref[i] += ref_delta(layer, x[i], factors[i])
    return ref


def assert_close(got, ref):
    tol = 1e-5 * np.max(np.abs(ref)) if np.any(ref) else 1e-6
    err = np.max(np.abs(got.astype(np.float64) - ref))
    assert err <= tol, f"max error {err} > {tol}"


@pytest.fixture
def served():
    """Three adapters of different ranks, scales and covered modules."""
    rng = np.random.default_rng(7)
    adapters = {
        "alpha": LoraAdapter({(0, "q"): make_layer(rng, 4, scale=2.0),
                              (0, "v"): make_layer(rng, 8, scale=0.5),
                              (1, "q"): make_layer(rng, 2, bias=True)}, name="alpha"),
        "beta": LoraAdapter({(0, "q"): make_layer(rng, 16, scale=0.25),
                             (1, "q"): make_layer(rng, 0)}, name="beta"),
        "gamma": LoraAdapter({(0, "v"): make_layer(rng, 3, scale=-1.5),
                              (2, "o"): make_layer(rng, 5, scale=3.0)}, name="gamma"),
    }
    aset = AdapterSet()
    for name, ad in adapters.items():
        aset.add(name, ad)
    return aset, adapters


KEYS = [(0, "q"), (0, "v"), (1, "q"), (2, "o"), (3, "q")]


def random_batch(rng, n):
    x = rng.standard_normal((n, D_IN)).astype(np.float32)
    out = rng.standard_normal((n, D_OUT)).astype(np.float32)
    return x, out


def check_bound(aset, adapters, row_names, scales, factors, rng, flat=False):
    n = len(row_names)
    hook = aset.bind(row_names, scales)
    assert isinstance(hook, LoraHook) and isinstance(hook, BoundBatch)
    assert hook.n_rows == n
    for key in KEYS:
        x, out0 = random_batch(rng, n)
        out = out0.copy()
        if flat:
            apply_lora_rows(hook, key[0], key[1], x.ravel(), out.reshape(-1), D_IN, D_OUT)
        else:
            apply_lora_rows(hook, key[0], key[1], x, out, D_IN, D_OUT)
        ref = reference(adapters, key, row_names, factors, x, out0)
        assert_close(out, ref)
        for i, name in enumerate(row_names):
            layer = adapters[name].layers.get(key) if name is not None else None
            if layer is None or layer.rank == 0 or factors[i] * layer.scale == 0:
                assert out[i].tobytes() == out0[i].tobytes(), (key, i)
        expect_active = any(
            name is not None and key in adapters[name].layers
            and adapters[name].layers[key].rank > 0 and factors[i] != 0
            for i, name in enumerate(row_names))
        assert hook.is_active(*key) == expect_active


def test_mixed_batch_default_scales(served, kernel_path):
    aset, adapters = served
    rng = np.random.default_rng(1)
    names = [None, "alpha", "beta", "alpha", "gamma", None, "beta", "beta",
             "alpha", "gamma", "alpha", None, "alpha", "beta", "alpha", "alpha",
             "alpha", "alpha", "alpha", "alpha"]
    check_bound(aset, adapters, names, None, [1.0] * len(names), rng)
    check_bound(aset, adapters, names, None, [1.0] * len(names), rng, flat=True)


def test_mixed_batch_per_row_scales_with_zeros(served, kernel_path):
    aset, adapters = served
    rng = np.random.default_rng(2)
    names = ["alpha", "beta", None, "alpha", "gamma", "alpha", "beta", "gamma",
             "alpha", "alpha", "beta", "alpha", "gamma", None]
    factors = [0.5, 2.0, 3.0, 0.0, -1.0, 1.5, 0.0, 0.25, 1.0, 7.0, 1.0, -2.0, 0.0, 0.0]
    check_bound(aset, adapters, names, factors, factors, rng)
    check_bound(aset, adapters, names, np.asarray(factors, dtype=np.float32), factors, rng)


def test_mixed_batch_uniform_scale(served, kernel_path):
    aset, adapters = served
    rng = np.random.default_rng(3)
    names = ["gamma", "alpha", None, "beta", "alpha", "alpha", "gamma"]
    check_bound(aset, adapters, names, 0.75, [0.75] * 7, rng)
    check_bound(aset, adapters, names, np.float32(-2.0), [-2.0] * 7, rng)
    hook = aset.bind(names, 0.0)
    for key in KEYS:
        assert not hook.is_active(*key)


def test_mixed_batch_mapping_scales(served, kernel_path):
    aset, adapters = served
    rng = np.random.default_rng(4)
    names = ["alpha", "beta", "gamma", None, "alpha", "gamma", "beta", "alpha", "alpha"]
    mapping = {"alpha": 1.5, "gamma": 0.0}
    factors = [mapping.get(n, 1.0) if n else 1.0 for n in names]
    check_bound(aset, adapters, names, mapping, factors, rng)
    # the mapping may name installed adapters that no row uses
    check_bound(aset, adapters, ["beta", "beta"], {"alpha": 3.0}, [1.0, 1.0], rng)
    hook = aset.bind(names, mapping)
    assert set(hook.adapters) == {"alpha", "beta"}  # gamma is switched off


def test_large_groups_random_layouts(kernel_path):
    # many rows per adapter, scattered and contiguous, beyond one scratch chunk
    rng = np.random.default_rng(5)
    d_in, d_out = 64, 96
    adapters = {f"a{i}": LoraAdapter({(0, "p"): make_layer(rng, r, d_in, d_out, scale=0.5 + i)})
                for i, r in enumerate([1, 4, 16, 33])}
    aset = AdapterSet()
    for name, ad in adapters.items():
        aset.add(name, ad)
    choices = [None] + sorted(adapters)
    for trial in range(6):
        n = int(rng.integers(1, 300))
        names = [choices[int(k)] for k in rng.integers(0, len(choices), n)]
        if trial == 0:
            names = sorted(names, key=lambda v: (v is None, v or ""))  # contiguous runs
        factors = rng.uniform(-2, 2, n)
        factors[rng.random(n) < 0.1] = 0.0
        hook = aset.bind(names, factors.tolist())
        x = rng.standard_normal((n, d_in)).astype(np.float32)
        out0 = rng.standard_normal((n, d_out)).astype(np.float32)
        out = out0.copy()
        apply_lora_rows(hook, 0, "p", x, out, d_in, d_out)
        ref = reference(adapters, (0, "p"), names, factors, x, out0)
        assert_close(out, ref)
        for i, name in enumerate(names):
            if name is None or factors[i] == 0:
                assert out[i].tobytes() == out0[i].tobytes()


def test_grouped_matches_single_adapter_per_row(served):
    # every row equals the float64 reference and that adapter applied alone (scaled) to that row
    aset, adapters = served
    rng = np.random.default_rng(6)
    names = ["alpha", "gamma", "alpha", None, "alpha"]
    factors = [1.0, 2.0, -1.0, 5.0, 0.5]
    x, out0 = random_batch(rng, 5)
    out = out0.copy()
    apply_lora_rows(aset.bind(names, factors), 0, "v", x, out, D_IN, D_OUT)
    assert_close(out, reference(adapters, (0, "v"), names, factors, x, out0))
    for i, (name, f) in enumerate(zip(names, factors)):
        single = out0[i].copy()
        if name is not None:
            apply_lora_rows(adapters[name].scaled(f), 0, "v", x[i], single, D_IN, D_OUT)
        assert_close(out[i], single.astype(np.float64))


def test_none_rows_and_empty_batches():
    rng = np.random.default_rng(8)
    aset = AdapterSet()
    aset.add("a", LoraAdapter({(0, "q"): make_layer(rng, 4)}))
    hook = aset.bind([None, None, None])
    assert not hook.is_active(0, "q")
    x, out0 = random_batch(rng, 3)
    out = out0.copy()
    apply_lora_rows(hook, 0, "q", x, out, D_IN, D_OUT)
    assert out.tobytes() == out0.tobytes()
    empty = aset.bind([])
    assert empty.n_rows == 0 and not empty.is_active(0, "q")
    apply_lora_rows(empty, 0, "q", np.zeros((0, D_IN), np.float32),
                    np.zeros((0, D_OUT), np.float32), D_IN, D_OUT)


def test_zero_scale_layer_and_underflow_are_never_written():
    rng = np.random.default_rng(9)
    aset = AdapterSet()
    aset.add("off", LoraAdapter({(0, "q"): make_layer(rng, 4, scale=0.0)}))
    aset.add("tiny", LoraAdapter({(0, "q"): make_layer(rng, 4, scale=1e-30)}))
    hook = aset.bind(["off", "tiny", "tiny"], [1.0, 1e-30, 1.0])
    x, out0 = random_batch(rng, 3)
    out0[:] = -0.0  # a write of +0.0 would flip the sign bit
    out = out0.copy()
    apply_lora_rows(hook, 0, "q", x, out, D_IN, D_OUT)
    assert out[:2].tobytes() == out0[:2].tobytes()
    assert not aset.bind(["off"]).is_active(0, "q")


def test_bias_layers_scale_per_row(kernel_path):
    rng = np.random.default_rng(10)
    ad = LoraAdapter({(0, "q"): make_layer(rng, 3, scale=0.7, bias=True)})
    aset = AdapterSet()
    aset.add("b", ad)
    names = ["b", None, "b", "b", "b", "b", "b", "b", "b", "b"]
    factors = [1.0, 0.0, -1.0, 2.0, 0.0, 3.0, 1.0, 1.0, 0.5, 4.0]
    x, out0 = random_batch(rng, 10)
    out = out0.copy()
    apply_lora_rows(aset.bind(names, factors), 0, "q", x, out, D_IN, D_OUT)
    assert_close(out, reference({"b": ad}, (0, "q"), names, factors, x, out0))
    assert out[4].tobytes() == out0[4].tobytes()


# --- the set -----------------------------------------------------------------

def test_add_replace_remove_names(served):
    aset, adapters = served
    assert aset.names() == ["alpha", "beta", "gamma"]
    assert len(aset) == 3 and "beta" in aset and "delta" not in aset
    assert aset.get("beta") is adapters["beta"]
    with pytest.raises(ValueError, match="'alpha' is already installed"):
        aset.add("alpha", adapters["beta"])
    aset.replace("alpha", adapters["gamma"])
    assert aset.get("alpha") is adapters["gamma"]
    with pytest.raises(KeyError, match="'delta'"):
        aset.replace("delta", adapters["gamma"])
    aset.remove("beta")
    assert aset.names() == ["alpha", "gamma"]
    with pytest.raises(KeyError, match="'beta'"):
        aset.remove("beta")
    with pytest.raises(KeyError, match="'beta'"):
        aset.get("beta")


def test_set_type_checks():
    rng = np.random.default_rng(11)
    ad = LoraAdapter({(0, "q"): make_layer(rng, 2)})
    aset = AdapterSet()
    with pytest.raises(TypeError, match="must be a lorahook.LoraAdapter, got dict"):
        aset.add("x", {(0, "q"): make_layer(rng, 2)})
    with pytest.raises(TypeError, match="adapter name must be a str, got int"):
        aset.add(3, ad)
    with pytest.raises(ValueError, match="non-empty"):
        aset.add("", ad)
    with pytest.raises(TypeError, match="model must be a lorahook.ModelGeometry .* or None, got dict"):
        AdapterSet(model={"hidden_size": 8})
    assert aset.names() == []


def test_validation_against_model_and_atomic_replace():
    rng = np.random.default_rng(12)
    cfg = BertConfig(2, 16, 32)
    good = LoraAdapter({(0, "query"): make_layer(rng, 4, 16, 16),
                        (1, "ffn_intermediate"): make_layer(rng, 2, 16, 32)})
    good2 = LoraAdapter({(1, "ffn_output"): make_layer(rng, 4, 32, 16)})
    bad = LoraAdapter({(0, "query"): make_layer(rng, 4, 16, 32)})
    aset = AdapterSet(cfg)
    assert aset.model is cfg
    aset.add("g", good)
    with pytest.raises(LoraValidationError, match="query"):
        aset.add("b", bad)
    assert aset.names() == ["g"]
    with pytest.raises(LoraValidationError):
        aset.replace("g", bad)
    assert aset.get("g") is good  # the old adapter stays installed
    aset.replace("g", good2)
    assert aset.get("g") is good2
    aset.bind(["g"]).validate_against(cfg)


# --- bind errors ---------------------------------------------------------------

def test_bind_unknown_names(served):
    aset, _ = served
    with pytest.raises(KeyError, match=r"\['delta', 'omega'\]"):
        aset.bind(["alpha", "omega", None, "delta", "omega"])
    with pytest.raises(KeyError, match=r"scales names adapters that are not installed: \['zeta'\]"):
        aset.bind(["alpha"], {"alpha": 1.0, "zeta": 2.0})


def test_bind_bad_scales(served):
    aset, _ = served
    with pytest.raises(ValueError, match="expected 3 .* got 2"):
        aset.bind(["alpha", None, "beta"], [1.0, 2.0])
    with pytest.raises(ValueError, match=r"scales\[1\] must be finite, got nan"):
        aset.bind(["alpha", None, "beta"], [1.0, float("nan"), 1.0])
    with pytest.raises(ValueError, match="scales must be finite, got inf"):
        aset.bind(["alpha"], math.inf)
    with pytest.raises(ValueError, match=r"scales\['beta'\] must be finite"):
        aset.bind(["alpha"], {"beta": -math.inf})
    with pytest.raises(ValueError, match="overflows float32"):
        aset.bind(["alpha"], 1e300)
    with pytest.raises(TypeError, match=r"scales\[0\] must be a real number, got str"):
        aset.bind(["alpha"], ["1.0"])
    with pytest.raises(TypeError, match="scales must be None, a real number"):
        aset.bind(["alpha"], "1.0")
    with pytest.raises(TypeError, match="must be a real number, got bool"):
        aset.bind(["alpha"], True)
    with pytest.raises(ValueError, match="1-D"):
        aset.bind(["alpha"], np.ones((1, 1)))


def test_bind_bad_row_adapters(served):
    aset, _ = served
    with pytest.raises(TypeError, match="row_adapters must be a sequence"):
        aset.bind("alpha")
    with pytest.raises(TypeError, match=r"row_adapters\[1\] must be an adapter name \(str\) or None, got int"):
        aset.bind(["alpha", 3])


def test_lone_row_apply_raises_type_error(served):
    aset, _ = served
    hook = aset.bind(["alpha"])
    x = np.zeros(D_IN, np.float32)
    y = np.zeros(D_OUT, np.float32)
    with pytest.raises(TypeError, match="apply_lora_rows"):
        hook.apply(0, "q", x, y)
    with pytest.raises(TypeError, match="made by AdapterSet.bind"):
        BoundBatch()
    with pytest.raises(AttributeError):
        hook._bound_rows = 5


def test_row_count_mismatch_raises_before_writes(served):
    aset, _ = served
    hook = aset.bind(["alpha", "beta", None])
    rng = np.random.default_rng(13)
    for key in [(0, "q"), (7, "not_covered")]:  # also where no row's adapter applies
        x, out0 = random_batch(rng, 4)
        out = out0.copy()
        with pytest.raises(ValueError, match="bound for a batch of 3 rows, got 4 rows"):
            apply_lora_rows(hook, key[0], key[1], x, out, D_IN, D_OUT)
        assert out.tobytes() == out0.tobytes()


def test_width_mismatch_raises_before_any_write():
    rng = np.random.default_rng(14)
    adapters = {"ok": LoraAdapter({(0, "q"): make_layer(rng, 4, 24, 40)}),
                "wide": LoraAdapter({(0, "q"): make_layer(rng, 4, 24, 41)})}
    aset = AdapterSet()
    for name, ad in adapters.items():
        aset.add(name, ad)
    names = ["ok", "ok", "wide"]
    x, out0 = random_batch(rng, 3)
    out = out0.copy()
    with pytest.raises(ValueError, match=r"'wide' layer \(0, 'q'\) has \(d_in, d_out\) = "
                                         r"\(24, 41\) .* = \(24, 40\)"):
        apply_lora_rows(aset.bind(names), 0, "q", x, out, D_IN, D_OUT)
    assert out.tobytes() == out0.tobytes()
    # a row-scale of zero switches the misfit off for this batch
    apply_lora_rows(aset.bind(names, {"wide": 0.0}), 0, "q", x, out, D_IN, D_OUT)
    assert_close(out, reference(adapters, (0, "q"), ["ok", "ok", None], [1.0] * 3, x, out0))
    assert out[2].tobytes() == out0[2].tobytes()


# --- snapshots and hot swap ------------------------------------------------------

def test_bound_batch_is_a_snapshot(served):
    aset, adapters = served
    rng = np.random.default_rng(15)
    names = ["alpha", "beta", "alpha"]
    hook = aset.bind(names)
    other = LoraAdapter({(0, "q"): make_layer(rng, 4)})
    aset.replace("alpha", other)
    aset.remove("beta")
    x, out0 = random_batch(rng, 3)
    out = out0.copy()
    apply_lora_rows(hook, 0, "q", x, out, D_IN, D_OUT)
    assert_close(out, reference(adapters, (0, "q"), names, [1.0] * 3, x, out0))
    assert hook.adapters["alpha"] is adapters["alpha"]
    with pytest.raises(KeyError, match="'beta'"):
        aset.bind(names)
    out = out0.copy()
    apply_lora_rows(aset.bind(["alpha", None, "alpha"]), 0, "q", x, out, D_IN, D_OUT)
    assert_close(out, reference({"alpha": other}, (0, "q"), ["alpha", None, "alpha"],
                                [1.0] * 3, x, out0))


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")
def test_hot_swap_under_load_never_tears_a_batch():
    rng = np.random.default_rng(16)
    d_in, d_out, n = 32, 48, 24
    keys = [(0, "q"), (1, "q")]

    def version(seed, scale):
        r = np.random.default_rng(seed)
        return LoraAdapter({k: make_layer(r, 6, d_in, d_out, scale=scale) for k in keys})

    versions = [version(100, 1.0), version(200, -2.0)]
    steady = LoraAdapter({k: make_layer(rng, 3, d_in, d_out) for k in keys})
    aset = AdapterSet()
    aset.add("hot", versions[0])
    aset.add("steady", steady)
    names = [("hot", "steady", None)[i % 3] for i in range(n)]
    # rows of "hot" both contiguous and scattered, so both gather paths run
    names[0:4] = ["hot"] * 4
    factors = [1.0 + (i % 5) * 0.25 for i in range(n)]
    hot_rows = [i for i, v in enumerate(names) if v == "hot"]
    x = rng.standard_normal((n, d_in)).astype(np.float32)
    out0 = rng.standard_normal((n, d_out)).astype(np.float32)
    refs = {k: [reference({"hot": v, "steady": steady}, k, names, factors, x, out0)
                for v in versions] for k in keys}
    # the two versions must be far apart, compared with the tolerance
    for k in keys:
        gap = np.min(np.max(np.abs(refs[k][0][hot_rows] - refs[k][1][hot_rows]), axis=1))
        assert gap > 1e-2 * np.max(np.abs(refs[k][0]))

    errors = []
    stop = threading.Event()
    counts = [0] * 4
    seen = [set() for _ in counts]

    def classify(out, k):
        """The version each hot row came from; asserts steady/None rows are right."""
        which = []
        for i in hot_rows:
            d = [np.max(np.abs(out[i] - refs[k][v][i])) for v in (0, 1)]
            tol = 1e-5 * np.max(np.abs(refs[k][0]))
            v = int(np.argmin(d))
            if d[v] > tol:
                raise AssertionError(f"row {i} matches neither version: {d}")
            which.append(v)
        others = [i for i in range(n) if names[i] != "hot"]
        assert_close(out[others], refs[k][0][others])
        for i in others:
            if names[i] is None:
                assert out[i].tobytes() == out0[i].tobytes()
        return which

    def worker(t):
        try:
            while not stop.is_set():
                hook = aset.bind(names, factors)
                batch = set()
                for k in keys:
                    out = out0.copy()
                    apply_lora_rows(hook, k[0], k[1], x, out, d_in, d_out)
                    batch.update(classify(out, k))
                if len(batch) != 1:
                    raise AssertionError(f"batch mixes versions {batch}")
                seen[t].update(batch)
                counts[t] += 1
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
            stop.set()

    swaps = [0]

    def swapper():
        i = 0
        try:
            while not stop.is_set():
                i ^= 1
                aset.replace("hot", versions[i])
                swaps[0] += 1
                time.sleep(0)
        except BaseException as exc:
            errors.append(exc)
            stop.set()

    def run(seconds, target_iterations):
        threads = [threading.Thread(target=worker, args=(t,)) for t in range(len(counts))]
        threads.append(threading.Thread(target=swapper))
        start = time.monotonic()
        for th in threads:
            th.start()
        while (not stop.is_set() and time.monotonic() - start < seconds
               and sum(counts) < target_iterations):
            time.sleep(0.02)
        stop.set()
        for th in threads:
            th.join(30)
        stop.clear()
        assert not errors, errors[0]

    run(3.0, 1000)  # warm up caches and allocators
    gc.collect()
    rss0 = _rss_bytes()
    before = sum(counts)
    run(12.0, before + 4000)
    gc.collect()
    grown = _rss_bytes() - rss0
    done = sum(counts) - before
    assert done >= 1000, f"only {done} batches in the measured run"
    assert swaps[0] > 100
    assert set().union(*seen) == {0, 1}  # both versions were actually observed
    assert grown < 16 * 2**20, f"RSS grew by {grown / 2**20:.1f} MiB over {done} batches"


def test_bound_batches_and_bound_sequences_are_siblings():
    rng = np.random.default_rng(9)
    aset = AdapterSet()
    aset.add("a", LoraAdapter({(0, "q"): LoraLayer(rng.standard_normal((2, D_IN)),
                                                    rng.standard_normal((D_OUT, 2)))}))
    batch, seqs = aset.bind(["a", None]), aset.bind_sequences(["a", None])
    assert not isinstance(seqs, BoundBatch) and not hasattr(seqs, "row_adapters")
    assert not hasattr(batch, "seq_adapters") and not hasattr(batch, "n_sequences")
    assert batch.row_adapters == seqs.seq_adapters == ("a", None)
    for hook in (batch, seqs):
        with pytest.raises(AttributeError):
            hook.__dict__
