"""The asv suite as its users run it: results saved per commit, a slowdown flagged.

A scratch git repository stands in for two commits of lorahook: results are
recorded for each with ``asv run --python=same --set-commit-hash`` (this
environment's lorahook, no build), the second with
``LORAHOOK_BENCH_SLOWDOWN=4`` (``bench_ratios`` then does lorahook's call four
times: a known slowdown).  ``asv compare`` must flag the 512-row prefill of
``bench_ratios.Kernels.time_lorahook`` (long enough to time well on a busy
machine) as slower by about 4, and ``asv publish`` must build a site from the
saved results.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest

from required import need

need("asv", required_by="LORAHOOK_REQUIRE_ASV")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(ROOT, "benchmarks")
MACHINE = "lorahook-test-machine"


def _asv(args, cwd, env=None):
    # asv's benchmark runner takes every PYTHONPATH entry off its sys.path, and
    # the tests' PYTHONPATH names lorahook's import root (tests/conftest.py),
    # which in CI is site-packages itself: the runner imports what this
    # environment installed, as ``asv run --python=same`` does for a user
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-m", "asv", *args], cwd=cwd, text=True,
                          capture_output=True, env=dict(environ, **(env or {})), timeout=900)
    assert proc.returncode == 0, f"asv {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _git(args, cwd):
    return subprocess.run(["git", *args], cwd=cwd, check=True, text=True,
                          capture_output=True).stdout.strip()


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A config reading this checkout's suite, results for a scratch repository's two commits."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    tmp = tmp_path_factory.mktemp("asv")
    repo = tmp / "repo"
    repo.mkdir()
    _git(["init", "-q", "-b", "main"], repo)
    hashes = []
    for message in ("before", "slowed"):
        _git(["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty",
              "-m", message], repo)
        hashes.append(_git(["rev-parse", "HEAD"], repo))
    with open(os.path.join(BENCHMARKS, "asv.conf.json")) as f:
        text = "\n".join(line for line in f if not line.lstrip().startswith("//"))
    conf = json.loads(text)
    conf.update(repo=str(repo), benchmark_dir=os.path.join(BENCHMARKS, "benchmarks"),
                env_dir=str(tmp / "env"), results_dir=str(tmp / "results"),
                html_dir=str(tmp / "html"))
    conf.pop("include", None)
    (tmp / "asv.conf.json").write_text(json.dumps(conf))
    _asv(["machine", "--yes", "--machine", MACHINE], tmp)
    for commit, k in zip(hashes, ("1", "4")):
        _asv(["run", "--python=same", "--machine", MACHINE, "--set-commit-hash", commit,
              "-b", r"bench_ratios\.Kernels\.time_lorahook\('prefill_large", "-a",
              "repeat=(7, 15, 10.0)",
              "-a", "warmup_time=0.05"], tmp, env={"LORAHOOK_BENCH_SLOWDOWN": k})
    return tmp, hashes


def test_compare_flags_the_slowed_commit_with_its_factor(scratch):
    tmp, (before, slowed) = scratch
    out = _asv(["compare", "--machine", MACHINE, "--factor", "1.5", before, slowed], tmp)
    rows = _rows(out)  # "+" in the change column: slower
    assert len(rows) == 1, out  # prefill_large (the other scenarios did not run)
    change, _, _, ratio, _ = rows[0]
    assert change == "+", out
    assert 2.5 < float(ratio) < 6.5, out


def _rows(out):
    """asv compare's table: ``[change, before, after, ratio, benchmark]`` of the row measured."""
    return [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in out.splitlines() if "time_lorahook('prefill_large')" in line]


def test_compare_of_a_commit_with_itself_flags_nothing(scratch):
    tmp, (before, _) = scratch
    out = _asv(["compare", "--machine", MACHINE, "--factor", "1.5", before, before], tmp)
    rows = _rows(out)
    assert len(rows) == 1 and rows[0][0] == "", out


def test_publish_builds_a_site_with_both_commits(scratch):
    tmp, hashes = scratch
    _asv(["publish"], tmp)
    with open(tmp / "html" / "index.json") as f:
        index = json.load(f)
    assert set(hashes) <= set(index["revision_to_hash"].values())
    graphs = [os.path.join(d, f) for d, _, files in os.walk(tmp / "html" / "graphs")
              for f in files if "time_lorahook" in f]
    assert graphs
