"""lorahook.threads: which BLAS it controls, and that both thread settings take effect."""
import os
import subprocess
import sys

import numpy as np
import pytest

threadpoolctl = pytest.importorskip("threadpoolctl")

from lorahook import LoraAdapter, LoraLayer, apply_lora_rows, threads

HERE = os.path.dirname(os.path.abspath(__file__))


def _scipy_blas_entries():
    import scipy.linalg.cython_blas  # noqa: F401
    ours = os.path.realpath(threads.blas_controller().lib_controllers[0].filepath)
    return [e for e in threadpoolctl.threadpool_info()
            if os.path.realpath(e["filepath"]) == ours]


@pytest.fixture
def restore_threads():
    old = threads.get_num_threads(), threads.get_blas_threads()
    yield
    threads.set_num_threads(old[0])
    threads.set_blas_threads(old[1])


def _env_without(*names):
    return {k: v for k, v in os.environ.items() if k not in names}


def _child(code, **env):
    base = _env_without("LORAHOOK_NUM_THREADS", "LORAHOOK_BLAS_THREADS")
    return subprocess.run([sys.executable, "-c", code], cwd=HERE, env=dict(base, **env),
                          capture_output=True, text=True, timeout=120)


def test_controls_exactly_one_blas_library():
    ctl = threads.blas_controller()
    assert len(ctl.lib_controllers) == 1
    assert ctl.lib_controllers[0].user_api == "blas"
    assert len(_scipy_blas_entries()) == 1


def test_identifies_the_library_cython_blas_links():
    path = threads._cython_blas_library_path()
    if path is None:
        pytest.skip("the dynamic loader cannot map sgemm to a file here")
    import ctypes
    # a BLAS threadpoolctl knows, that defines sgemm itself, and not numpy's
    blas = {os.path.realpath(e["filepath"]): e for e in threadpoolctl.threadpool_info()
            if e["user_api"] == "blas"}
    assert path in blas
    lib = ctypes.CDLL(path)
    assert any(hasattr(lib, name) for name in ("scipy_sgemm_", "sgemm_", "sgemm"))
    numpy_libs = os.path.join(os.path.dirname(os.path.dirname(np.__file__)), "numpy.libs")
    assert not path.startswith(os.path.realpath(numpy_libs) + os.sep)
    assert os.path.realpath(threads.blas_controller().lib_controllers[0].filepath) == path


def test_defaults_on_import():
    code = ("import lorahook.threads as t;"
            "c = t.blas_controller().lib_controllers[0];"
            "print(c.num_threads, t.get_blas_threads(), t.get_num_threads(), t.default_num_threads())")
    out = _child(code)
    assert out.returncode == 0, out.stderr
    blas, blas_again, ours, default = map(int, out.stdout.split())
    assert blas == blas_again == threads.DEFAULT_BLAS_THREADS
    assert ours == default
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert default == max(1, min(cpus, threads.MAX_DEFAULT_THREADS))


def test_num_threads_environment():
    code = "import lorahook.threads as t; print(t.get_num_threads())"
    out = _child(code, LORAHOOK_NUM_THREADS="3")
    assert out.returncode == 0 and out.stdout.strip() == "3", out.stderr
    for bad in ("zero", "0", "65", "keep"):
        res = _child(code, LORAHOOK_NUM_THREADS=bad)
        assert res.returncode != 0 and "LORAHOOK_NUM_THREADS" in res.stderr, bad
    # the old spelling for "leave SciPy's BLAS alone" points at the new one
    assert "LORAHOOK_BLAS_THREADS=keep" in _child(code, LORAHOOK_NUM_THREADS="keep").stderr


def test_blas_threads_environment_and_keep():
    code = "import lorahook.threads as t; print(t.get_blas_threads())"
    out = _child(code, LORAHOOK_BLAS_THREADS="2")
    assert out.returncode == 0 and out.stdout.strip() == "2", out.stderr
    bad = _child(code, LORAHOOK_BLAS_THREADS="-3")
    assert bad.returncode != 0 and "LORAHOOK_BLAS_THREADS" in bad.stderr
    # keep: whatever SciPy's BLAS had before lorahook was imported
    code = ("import scipy.linalg.cython_blas, threadpoolctl;"
            "threadpoolctl.threadpool_limits(1, user_api='blas');"
            "import lorahook.threads as t; print(t.get_blas_threads())")
    keep = _child(code, LORAHOOK_BLAS_THREADS="keep")
    assert keep.returncode == 0 and keep.stdout.strip() == "1", keep.stderr


def test_set_num_threads_round_trip(restore_threads):
    old = threads.get_num_threads()
    assert threads.set_num_threads(3) == old
    assert threads.get_num_threads() == 3
    assert threads.set_num_threads(1) == 3
    assert threads.get_num_threads() == 1


def test_set_num_threads_does_not_touch_any_blas(restore_threads):
    before = {e["filepath"]: e["num_threads"] for e in threadpoolctl.threadpool_info()}
    threads.set_num_threads(3)
    threads.set_num_threads(1)
    assert {e["filepath"]: e["num_threads"] for e in threadpoolctl.threadpool_info()} == before


def test_set_num_threads_rejects_too_many(restore_threads):
    with pytest.raises(ValueError, match="at most 64"):
        threads.set_num_threads(65)


def test_set_blas_threads_takes_effect_per_threadpoolctl(restore_threads):
    old = threads.get_blas_threads()
    assert threads.set_blas_threads(2) == old
    assert [e["num_threads"] for e in _scipy_blas_entries()] == [2]
    assert threads.get_blas_threads() == 2
    assert threads.set_blas_threads(1) == 2
    assert [e["num_threads"] for e in _scipy_blas_entries()] == [1]


def test_numpy_blas_is_left_alone(restore_threads):
    ours = os.path.realpath(threads.blas_controller().lib_controllers[0].filepath)
    others = lambda: {e["filepath"]: e["num_threads"] for e in threadpoolctl.threadpool_info()
                      if os.path.realpath(e["filepath"]) != ours}
    before = others()
    threads.set_blas_threads(2)
    threads.set_blas_threads(1)
    assert others() == before


def test_threadpoolctl_limits_still_work(restore_threads):
    threads.set_blas_threads(2)
    with threadpoolctl.threadpool_limits(limits=1, user_api="blas"):
        assert threads.get_blas_threads() == 1
    assert threads.get_blas_threads() == 2
    with threads.blas_controller().limit(limits=1):
        assert threads.get_blas_threads() == 1
    assert threads.get_blas_threads() == 2


def test_core_sees_the_blas_thread_count(restore_threads):
    from lorahook import _rows
    if _rows._blas_threads() == 0:
        pytest.skip("SciPy's BLAS here exports no OpenBLAS thread getter")
    threads.set_blas_threads(2)
    assert _rows._blas_threads() == 2
    with threadpoolctl.threadpool_limits(limits=1, user_api="blas"):
        assert _rows._blas_threads() == 1
    threads.set_blas_threads(1)
    assert _rows._blas_threads() == 1


@pytest.mark.parametrize("setter", ["set_num_threads", "set_blas_threads"])
@pytest.mark.parametrize("bad", [0, -1])
def test_setters_reject_non_positive(setter, bad):
    with pytest.raises(ValueError, match="n must be >= 1"):
        getattr(threads, setter)(bad)


@pytest.mark.parametrize("setter", ["set_num_threads", "set_blas_threads"])
@pytest.mark.parametrize("bad", [1.5, "2", None, True])
def test_setters_reject_non_int(setter, bad):
    with pytest.raises(TypeError, match="n must be an int"):
        getattr(threads, setter)(bad)


def test_blas_info_marks_lorahooks_library():
    info = threads.blas_info()
    assert sum(bool(e["lorahook"]) for e in info) == 1


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("rows", [1, 64])
def test_results_match_reference_at_each_blas_thread_count(restore_threads, n, rows):
    rng = np.random.default_rng(n + rows)
    a = rng.standard_normal((16, 256)).astype(np.float32)
    b = rng.standard_normal((384, 16)).astype(np.float32)
    hook = LoraAdapter({(0, "q_proj"): LoraLayer(a, b, 0.5)})
    x = rng.standard_normal((rows, 256)).astype(np.float32)
    y = rng.standard_normal((rows, 384)).astype(np.float32)
    ref = y.astype(np.float64) + 0.5 * (x.astype(np.float64) @ a.T.astype(np.float64)) @ b.T.astype(np.float64)
    threads.set_blas_threads(n)
    apply_lora_rows(hook, 0, "q_proj", x, y, 256, 384)
    assert np.max(np.abs(y - ref)) <= 1e-5 * np.max(np.abs(ref))
