"""lorahook.threads: which BLAS it controls, and that settings take effect."""
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
    old = threads.get_num_threads()
    yield
    threads.set_num_threads(old)


def test_controls_exactly_one_blas_library():
    ctl = threads.blas_controller()
    assert len(ctl.lib_controllers) == 1
    assert ctl.lib_controllers[0].user_api == "blas"
    assert len(_scipy_blas_entries()) == 1


def test_identifies_the_library_cython_blas_links():
    path = threads._cython_blas_library_path()
    if path is None:
        pytest.skip("the dynamic loader cannot map sgemm to a file here")
    assert os.path.realpath(threads.blas_controller().lib_controllers[0].filepath) == path


def test_default_is_one_thread_on_import():
    code = ("import lorahook.threads as t, threadpoolctl, os;"
            "c = t.blas_controller().lib_controllers[0];"
            "print(c.num_threads, t.get_num_threads())")
    env = {k: v for k, v in os.environ.items() if k != "LORAHOOK_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", code], cwd=HERE, env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == [str(threads.DEFAULT_NUM_THREADS)] * 2


def test_environment_override_and_keep():
    code = "import lorahook.threads as t; print(t.get_num_threads())"
    base = {k: v for k, v in os.environ.items() if k != "LORAHOOK_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", code], cwd=HERE, env=dict(base, LORAHOOK_NUM_THREADS="2"),
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == "2"
    bad = subprocess.run([sys.executable, "-c", code], cwd=HERE, env=dict(base, LORAHOOK_NUM_THREADS="zero"),
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "LORAHOOK_NUM_THREADS" in bad.stderr
    keep = subprocess.run([sys.executable, "-c", code], cwd=HERE, env=dict(base, LORAHOOK_NUM_THREADS="keep"),
                          capture_output=True, text=True, check=True).stdout.strip()
    assert int(keep) >= 1


def test_set_num_threads_takes_effect_per_threadpoolctl(restore_threads):
    old = threads.get_num_threads()
    assert threads.set_num_threads(2) == old
    assert [e["num_threads"] for e in _scipy_blas_entries()] == [2]
    assert threads.get_num_threads() == 2
    assert threads.set_num_threads(1) == 2
    assert [e["num_threads"] for e in _scipy_blas_entries()] == [1]


def test_numpy_blas_is_left_alone(restore_threads):
    ours = os.path.realpath(threads.blas_controller().lib_controllers[0].filepath)
    others = lambda: {e["filepath"]: e["num_threads"] for e in threadpoolctl.threadpool_info()
                      if os.path.realpath(e["filepath"]) != ours}
    before = others()
    threads.set_num_threads(2)
    threads.set_num_threads(1)
    assert others() == before


def test_threadpoolctl_limits_still_work(restore_threads):
    threads.set_num_threads(2)
    with threadpoolctl.threadpool_limits(limits=1, user_api="blas"):
        assert threads.get_num_threads() == 1
    assert threads.get_num_threads() == 2
    with threads.blas_controller().limit(limits=1):
        assert threads.get_num_threads() == 1
    assert threads.get_num_threads() == 2


@pytest.mark.parametrize("bad", [0, -1])
def test_set_num_threads_rejects_non_positive(bad):
    with pytest.raises(ValueError, match="n must be >= 1"):
        threads.set_num_threads(bad)


@pytest.mark.parametrize("bad", [1.5, "2", None, True])
def test_set_num_threads_rejects_non_int(bad):
    with pytest.raises(TypeError, match="n must be an int"):
        threads.set_num_threads(bad)


def test_blas_info_marks_lorahooks_library():
    info = threads.blas_info()
    assert sum(bool(e["lorahook"]) for e in info) == 1


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("rows", [1, 64])
def test_results_do_not_depend_on_thread_count(restore_threads, n, rows):
    rng = np.random.default_rng(n + rows)
    a = rng.standard_normal((16, 256)).astype(np.float32)
    b = rng.standard_normal((384, 16)).astype(np.float32)
    hook = LoraAdapter({(0, "q_proj"): LoraLayer(a, b, 0.5)})
    x = rng.standard_normal((rows, 256)).astype(np.float32)
    y = rng.standard_normal((rows, 384)).astype(np.float32)
    ref = y.astype(np.float64) + 0.5 * (x.astype(np.float64) @ a.T.astype(np.float64)) @ b.T.astype(np.float64)
    threads.set_num_threads(n)
    apply_lora_rows(hook, 0, "q_proj", x, y, 256, 384)
    assert np.max(np.abs(y - ref)) <= 1e-5 * np.max(np.abs(ref))
