"""lorahook.threads, and lorahook as a guest in the host process: nothing process-wide at import, one opt-in setting.

The process-wide checks run in fresh interpreters, so that nothing another
test did (a configure call, an earlier warning) can hide a side effect.
"""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

threadpoolctl = pytest.importorskip("threadpoolctl")

from lorahook import LoraAdapter, LoraLayer, apply_lora_rows, threads

HERE = os.path.dirname(os.path.abspath(__file__))


def _child(code):
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=HERE,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc


def _scipy_blas_path():
    path = threads.info()["blas"]
    if path is None:
        pytest.skip("threadpoolctl cannot identify SciPy's BLAS here")
    return os.path.realpath(path["filepath"])


def _threads_of(path):
    for entry in threadpoolctl.threadpool_info():
        if os.path.realpath(entry["filepath"]) == path:
            return entry["num_threads"]
    raise AssertionError(f"{path} not among threadpoolctl's libraries")


@pytest.fixture
def restore_blas():
    """Give back SciPy's BLAS thread count and lorahook's settings after a test."""
    path = _scipy_blas_path()
    before = _threads_of(path)
    saved = dict(threads._settings)
    yield path
    threadpoolctl.threadpool_limits(before, user_api=None)  # every library: then fix numpy's below
    threads._settings.clear()
    threads._settings.update(saved)
    for lc in threadpoolctl.ThreadpoolController().lib_controllers:
        if os.path.realpath(lc.filepath) == path:
            lc.set_num_threads(before)


_SIDE_EFFECTS = """
    import json, os, warnings
    import numpy, scipy.linalg
    import threadpoolctl

    def tasks():
        return sorted(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else None

    def pools():
        return sorted((e["filepath"], e["num_threads"]) for e in threadpoolctl.threadpool_info())

    before = (pools(), tasks())
    import lorahook
    after_import = (pools(), tasks())
    rng = numpy.random.default_rng(0)
    layer = lorahook.LoraLayer(rng.standard_normal((16, 64)), rng.standard_normal((96, 16)))
    adapter = lorahook.LoraAdapter({(0, "q_proj"): layer})
    x = rng.standard_normal((300, 64)).astype(numpy.float32)
    y = numpy.zeros((300, 96), numpy.float32)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        lorahook.apply_lora_rows(adapter, 0, "q_proj", x, y, 64, 96)
    after_call = (pools(), tasks())
    info = lorahook.threads.info()
    print(json.dumps({"before": before, "after_import": after_import,
                      "after_call": after_call, "info_is_dict": isinstance(info, dict),
                      "registered_bfloat16": "bfloat16" in numpy.sctypeDict}))
"""


def test_import_and_a_default_call_change_nothing_process_wide():
    out = json.loads(_child(_SIDE_EFFECTS).stdout)
    assert out["after_import"][0] == out["before"][0]   # threadpoolctl: same libraries, same threads
    assert out["after_call"][0] == out["before"][0]
    if out["before"][1] is not None:
        assert out["after_import"][1] == out["before"][1]  # no OS thread started
        assert out["after_call"][1] == out["before"][1]
    assert out["info_is_dict"]
    assert not out["registered_bfloat16"]  # lorahook registers no dtype with numpy


def test_info_describes_the_blas_lorahook_calls():
    info = threads.info()
    assert set(info) >= {"blas", "numpy_blas", "numpy_shares_blas", "configured",
                         "blas_threads", "gemm_crossover", "threads_started"}
    assert info["threads_started"] == 0
    if info["blas"] is None:
        pytest.skip("threadpoolctl cannot identify SciPy's BLAS here")
    path = os.path.realpath(info["blas"]["filepath"])
    known = {os.path.realpath(e["filepath"]): e for e in threadpoolctl.threadpool_info()}
    assert path in known and known[path]["user_api"] == "blas"
    assert info["blas"]["num_threads"] == known[path]["num_threads"]
    # the library the core found through the dynamic loader defines sgemm itself
    import ctypes
    lib = ctypes.CDLL(path)
    assert any(hasattr(lib, name) for name in ("scipy_sgemm_", "sgemm_", "sgemm"))
    if info["numpy_blas"] is not None:
        shared = os.path.realpath(info["numpy_blas"]["filepath"]) == path
        assert info["numpy_shares_blas"] == shared


def test_configure_sets_scipys_blas_and_leaves_numpys_alone(restore_blas):
    info = threads.info()
    if info["numpy_shares_blas"]:
        pytest.skip("numpy and SciPy share one BLAS here: configure leaves it alone")
    numpy_path = info["numpy_blas"] and os.path.realpath(info["numpy_blas"]["filepath"])
    numpy_before = numpy_path and _threads_of(numpy_path)
    found = _threads_of(restore_blas)
    threads.configure(blas_threads=1)
    assert _threads_of(restore_blas) == 1
    assert threads.info()["configured"] and threads.info()["blas_threads"] == 1
    if numpy_path:
        assert _threads_of(numpy_path) == numpy_before
    assert threads.configure(blas_threads=None) == 1  # returns the previous setting
    assert _threads_of(restore_blas) == found          # None gives back what was found
    assert threads.info()["blas_threads"] is None


@pytest.mark.parametrize("bad, exc", [(0, ValueError), (-2, ValueError), (1.0, TypeError),
                                      (True, TypeError), ("1", TypeError)])
def test_configure_refuses_bad_counts(bad, exc, restore_blas):
    before = _threads_of(restore_blas)
    with pytest.raises(exc, match="blas_threads"):
        threads.configure(blas_threads=bad)
    assert _threads_of(restore_blas) == before


@pytest.mark.parametrize("blas_threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 31, 300])
def test_results_match_reference_at_each_blas_thread_count(restore_blas, blas_threads, rows):
    threads.configure(blas_threads=blas_threads)
    rng = np.random.default_rng(rows)
    layer = LoraLayer(rng.standard_normal((16, 256)), rng.standard_normal((384, 16)), 0.5)
    adapter = LoraAdapter({(0, "q_proj"): layer})
    x = rng.standard_normal((rows, 256)).astype(np.float32)
    y0 = rng.standard_normal((rows, 384)).astype(np.float32)
    y = y0.copy()
    apply_lora_rows(adapter, 0, "q_proj", x, y, 256, 384)
    ref = y0 + 0.5 * (x.astype(np.float64) @ layer.a.T.astype(np.float64)) @ layer.b.T.astype(np.float64)
    assert np.max(np.abs(y - ref)) <= 1e-5 * np.max(np.abs(ref))


_WARNING = """
    import warnings
    import numpy, scipy.linalg
    import lorahook
    CONFIGURE
    rng = numpy.random.default_rng(0)
    layer = lorahook.LoraLayer(rng.standard_normal((8, 32)), rng.standard_normal((32, 8)))
    adapter = lorahook.LoraAdapter({(0, "q_proj"): layer})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for rows in (1, 4, 64, 64, 200):
            x = numpy.ones((rows, 32), numpy.float32)
            lorahook.apply_lora_rows(adapter, 0, "q_proj", x, numpy.zeros((rows, 32), numpy.float32), 32, 32)
    info = lorahook.threads.info()
    both = (not info["numpy_shares_blas"] and info["blas"] and info["numpy_blas"]
            and info["blas"]["num_threads"] > 1 and info["numpy_blas"]["num_threads"] > 1)
    print(int(bool(both)), sum("configure(blas_threads=1)" in str(w.message) for w in seen))
"""


def test_two_threaded_blas_pools_warn_once_on_the_first_batched_call():
    both, warned = _child(_WARNING.replace("CONFIGURE", "")).stdout.split()
    if both == "0":
        # one shared pool, or one of them single-threaded: nothing to warn about
        assert warned == "0"
        pytest.skip("SciPy's and numpy's BLAS are not two threaded pools here")
    assert warned == "1"


@pytest.mark.parametrize("choice", ["1", "None"])
def test_an_explicit_configure_silences_the_warning(choice):
    code = _WARNING.replace("CONFIGURE", f"lorahook.threads.configure(blas_threads={choice})")
    _, warned = _child(code).stdout.split()
    assert warned == "0"


def test_the_blas_look_happens_at_start_up_not_in_the_first_request():
    # once an adapter set and an adapter exist, the first batched kernel only reads
    # thread counts: a look at the libraries then would end this child with exit 3
    _child("""
        import numpy, lorahook, lorahook.threads as threads
        aset = lorahook.AdapterSet()
        rng = numpy.random.default_rng(0)
        layer = lorahook.LoraLayer(rng.standard_normal((16, 64)), rng.standard_normal((96, 16)))
        aset.add("a", lorahook.LoraAdapter({(0, "q_proj"): layer}))
        assert threads._found is not None

        def looked_in_a_request():
            raise SystemExit(3)

        threads._libraries = looked_in_a_request
        hook = aset.bind(["a"] * 300)
        x = rng.standard_normal((300, 64)).astype(numpy.float32)
        y = numpy.zeros((300, 96), numpy.float32)
        lorahook.apply_lora_rows(hook, 0, "q_proj", x, y)
        assert numpy.abs(y).max() > 0
    """)
