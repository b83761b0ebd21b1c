"""The real command line, run in subprocesses: ``python -m lorahook`` (and the ``lorahook`` script)."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from lorahook import LoraAdapter, LoraLayer

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = os.path.join(HERE, "data", "configs")
QWEN_08B = os.path.join(CONFIGS, "qwen3_5_0_8b.json")
BERT = os.path.join(CONFIGS, "bert_base_uncased.json")


def _env():
    # PYTHONPATH already names the lorahook these tests import (tests/conftest.py)
    env = dict(os.environ)
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    return env


def _script():
    found = shutil.which("lorahook", path=os.path.dirname(sys.executable))
    return [found] if found else None


def run(*args, cwd=None, command=None, timeout=300):
    cmd = (command or [sys.executable, "-m", "lorahook"]) + [str(a) for a in args]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd or HERE, env=_env(),
                          timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr


def assert_one_line_error(err):
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("lorahook ")
    return lines[0]


def _layer(rng, rank, d_in, d_out):
    return LoraLayer(rng.standard_normal((rank, d_in)).astype(np.float32) * 0.01,
                     rng.standard_normal((d_out, rank)).astype(np.float32) * 0.01, scale=2.0)


def _save(adapter, path, **kwargs):
    adapter.save_peft(str(path), architecture="qwen3_5", **kwargs)
    return str(path)


@pytest.fixture(scope="module")
def fitting(tmp_path_factory):
    """An adapter that fits Qwen3.5-0.8B (layers 0-2 linear attention, 3 full attention)."""
    rng = np.random.default_rng(0)
    adapter = LoraAdapter({
        (0, "in_proj_qkv"): _layer(rng, 4, 1024, 6144),
        (0, "in_proj_b"): _layer(rng, 4, 1024, 16),
        (3, "q_proj"): _layer(rng, 4, 1024, 4096),
        (3, "v_proj"): _layer(rng, 4, 1024, 512),
        (5, "down_proj"): _layer(rng, 2, 3584, 1024),
    }, name="fits-0.8b")
    return _save(adapter, tmp_path_factory.mktemp("a") / "fitting",
                 metadata={"name": "fits-0.8b", "base_model": "Qwen/Qwen3.5-0.8B"})


@pytest.fixture(scope="module")
def misfit(tmp_path_factory):
    """q_proj without the output gate: d_out 2048 where Qwen3.5-0.8B has 4096."""
    rng = np.random.default_rng(1)
    adapter = LoraAdapter({(3, "q_proj"): _layer(rng, 4, 1024, 2048),
                           (3, "k_proj"): _layer(rng, 4, 1024, 512)})
    return _save(adapter, tmp_path_factory.mktemp("b") / "misfit")


# --------------------------------------------------------------------------- help, usage


@pytest.mark.parametrize("args", [["--help"], ["info", "--help"], ["validate", "--help"],
                                  ["demo", "--help"]])
def test_help(args):
    code, out, err = run(*args)
    assert code == 0, err
    assert "usage: lorahook" in out


def test_help_lists_commands():
    code, out, err = run("--help")
    assert code == 0, err
    for command in ("info", "validate", "bench", "demo"):
        assert command in out


def test_bench_help():
    code, out, err = run("bench", "--help")
    assert code == 0, err
    assert "usage" in out.lower()


@pytest.mark.parametrize("args", [[], ["frobnicate"], ["validate", "x"], ["info"],
                                  ["demo", "--rows", "many"]])
def test_usage_errors_exit_2(args):
    code, _, err = run(*args)
    assert code == 2
    assert "Traceback" not in err
    assert "usage:" in err


def test_demo_adapter_needs_model():
    code, _, err = run("demo", "--adapter", "somewhere")
    assert code == 2
    assert "--model" in assert_one_line_error(err)


# --------------------------------------------------------------------------- info


def test_info(fitting):
    code, out, err = run("info", fitting)
    assert code == 0, err
    assert "PEFT directory" in out
    assert "5 projections on 3 layers (0, 3, 5)" in out
    for module in ("in_proj_qkv", "in_proj_b", "q_proj", "v_proj", "down_proj"):
        assert module in out
    n_params = 4 * (1024 + 6144) + 4 * (1024 + 16) + 4 * (1024 + 4096) + 4 * (1024 + 512) \
        + 2 * (3584 + 1024)
    assert f"{n_params:,}" in out
    assert "F32" in out
    assert "Qwen/Qwen3.5-0.8B" in out
    assert "1024 -> 4096" in out


def test_info_safetensors_file(fitting):
    path = os.path.join(fitting, "adapter_model.safetensors")
    code, out, err = run("info", path)
    assert code == 0, err
    assert "safetensors file" in out
    assert "q_proj" in out


def test_info_missing_file(tmp_path):
    code, out, err = run("info", tmp_path / "nope")
    assert code == 2
    line = assert_one_line_error(err)
    assert "nope" in line and "no such file" in line.lower()
    assert out == ""


def test_info_not_an_adapter_directory(tmp_path):
    code, _, err = run("info", tmp_path)
    assert code == 2
    assert "adapter_config.json" in assert_one_line_error(err)


def test_info_garbage_file(tmp_path):
    bad = tmp_path / "adapter.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    code, _, err = run("info", bad)
    assert code == 2
    line = assert_one_line_error(err)
    assert "adapter.safetensors" in line and "not valid JSON" in line


def test_info_broken_config(tmp_path, fitting):
    broken = tmp_path / "broken"
    shutil.copytree(fitting, broken)
    (broken / "adapter_config.json").write_text("{ not json")
    code, _, err = run("info", broken)
    assert code == 2
    line = assert_one_line_error(err)
    assert "adapter_config.json" in line and "not valid JSON" in line


# --------------------------------------------------------------------------- validate


def test_validate_fits(fitting):
    code, out, err = run("validate", fitting, "--model", QWEN_08B)
    assert code == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fits")
    assert "Qwen3.5" in lines[0]


def test_validate_misfit(misfit):
    code, out, err = run("validate", misfit, "--model", QWEN_08B)
    assert code == 1
    line = assert_one_line_error(err)
    assert "does not fit" in line
    assert "q_proj" in line and "2048" in line and "4096" in line
    assert "fits" not in out


def test_validate_wrong_model_family(fitting):
    code, _, err = run("validate", fitting, "--model", BERT)
    assert code == 1
    assert "does not fit" in assert_one_line_error(err)


def test_validate_missing_model(fitting, tmp_path):
    code, _, err = run("validate", fitting, "--model", tmp_path / "config.json")
    assert code == 2
    assert "config.json" in assert_one_line_error(err)


def test_validate_missing_adapter(tmp_path):
    code, _, err = run("validate", tmp_path / "missing", "--model", QWEN_08B)
    assert code == 2
    assert "missing" in assert_one_line_error(err)


def test_validate_invalid_model_config(fitting, tmp_path):
    cfg = json.load(open(QWEN_08B))
    del cfg["text_config"]["hidden_size"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    code, _, err = run("validate", fitting, "--model", path)
    assert code == 2
    assert "hidden_size" in assert_one_line_error(err)


@pytest.mark.parametrize("content", [
    pytest.param(b'{"model_type": "qwen3_5", "name": "caf\xe9"}', id="latin-1"),
    pytest.param(b"\xff\xfe{}", id="utf-16-bom"),
    pytest.param(b'{"model_type": "llama", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                 id="nested-100000-deep"),
])
def test_validate_model_configs_that_are_not_json_text_exit_2_on_one_line(fitting, tmp_path,
                                                                          content):
    path = tmp_path / "config.json"
    path.write_bytes(content)
    code, out, err = run("validate", fitting, "--model", path)
    assert code == 2, out + err
    line = assert_one_line_error(err)
    assert str(path) in line and ("UTF-8" in line or "nested" in line)


# --------------------------------------------------------------------------- demo


def test_demo_prints_no_path_it_deletes():
    code, out, err = run("demo", "--time", "0.1")
    assert code == 0, out + err
    assert "lorahook-demo-" not in out and "temporary directory (removed afterwards)" in out


def test_demo():
    code, out, err = run("demo", "--time", "0.3")
    assert code == 0, out + err
    assert "Traceback" not in err
    assert "check     passed" in out
    for word in ("support", "legal", "sql", "from_peft", "rows/s", "numpy"):
        assert word in out
    assert "bit-identical" in out


def test_demo_own_files(fitting, tmp_path):
    code, out, err = run("demo", "--adapter", fitting, "--model", QWEN_08B, "--rows", "16",
                         "--time", "0")
    assert code == 0, out + err
    assert "check     passed" in out
    assert "fitting" in out


def test_demo_own_files_misfit(misfit):
    code, out, err = run("demo", "--adapter", misfit, "--model", QWEN_08B, "--time", "0")
    assert code == 1
    line = assert_one_line_error(err)
    assert "does not fit" in line and "q_proj" in line and "2048" in line and "4096" in line


@pytest.mark.skipif(_script() is None, reason="no lorahook script next to sys.executable")
def test_console_script(fitting):
    code, out, err = run("validate", fitting, "--model", QWEN_08B, command=_script())
    assert code == 0, err
    assert out.startswith("fits")
    code, out, err = run("--help", command=_script())
    assert code == 0 and "demo" in out


def test_serve_checks_for_ray_serve_without_importing_ray(tmp_path):
    # Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER when it is imported; the server sets it
    # after this check, so the check must leave ray unimported (a fresh process: pytest's
    # own may have imported ray already)
    code = ("import sys; from lorahook.cli import _missing_serve_modules; "
            "m = _missing_serve_modules(); print(m, 'ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "False", out.stdout


def test_version_is_the_packages_and_its_metadatas():
    import importlib.metadata
    import re

    import lorahook
    code, out, err = run("--version")
    assert code == 0, err
    assert out.strip() == f"lorahook {lorahook.__version__}"
    assert re.fullmatch(r"\d+\.\d+\.\d+", lorahook.__version__)
    # one source: the installed distribution's metadata reads the same version
    assert importlib.metadata.version("lorahook") == lorahook.__version__
    # and the changelog names it, when it is next to the tests
    changelog = os.path.join(HERE, "..", "CHANGELOG.md")
    if os.path.exists(changelog):
        with open(changelog, encoding="utf-8") as f:
            assert f"\n## {lorahook.__version__}\n" in f.read()
