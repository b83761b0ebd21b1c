"""lorahook's own modules import each other one way only: the import graph has no cycle.

Every ``import`` / ``from ... import`` of a lorahook module counts, at the top of a file or
inside a function. Edges go to the module named; ``from pkg import name`` goes to
``pkg.name`` when that is a module. The implicit import of a parent package when a
submodule is imported is not an edge (``lorahook.models.base`` does not depend on
``lorahook.models/__init__``, it only lives in it).
"""
import ast
import re
import tomllib
from pathlib import Path

import pytest

import lorahook

ROOT = Path(lorahook.__file__).resolve().parent
CHECKOUT = Path(__file__).resolve().parents[1]
PYPROJECT = CHECKOUT / "pyproject.toml"


def module_names():
    """``{dotted name: path}`` of every Python and Cython module in the lorahook package."""
    names = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    for path in ROOT.rglob("*.pyx"):
        names[".".join(path.relative_to(ROOT.parent).with_suffix("").parts)] = path
    return names


def imports_of(name, path, known):
    """The lorahook modules ``name`` imports anywhere in its source."""
    if path.suffix == ".pyx":
        return _cython_imports_of(name, path, known)
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = []
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                targets.append(sub if sub in known else source)
        else:
            continue
        for target in targets:
            # "import lorahook.models.base" names that module; keep the longest known prefix
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


_CYTHON_IMPORT = re.compile(
    r"^\s*(?:from\s+([\w.]+)\s+(c?)import\s+([\w, ]+)|c?import\s+([\w.]+))")


def _cython_imports_of(name, path, known):
    """The lorahook modules a ``.pyx`` file imports or cimports (its top-level lines)."""
    out = set()
    for line in path.read_text(encoding="utf-8").splitlines():
        m = _CYTHON_IMPORT.match(line)
        if not m:
            continue
        if m.group(4):
            targets = [m.group(4)]
        else:  # "from lorahook._core cimport blas as _blas" cimports a .pxd of its own, not the package
            targets = [f"{m.group(1)}.{n.strip()}" for n in m.group(3).split(",")]
            if not (m.group(2) and m.group(1) == "lorahook"):
                targets.append(m.group(1))
        for target in targets:
            if target in known and target != name:
                out.add(target)
                break
    return out


def find_cycle(graph):
    """One cycle as a list of names, or ``None``."""
    state = {}
    stack = []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def graph():
    known = module_names()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def test_the_graph_is_read():
    g = graph()
    # a few edges that must be there, so that an empty graph cannot pass
    assert "lorahook.files" in g["lorahook.adapter"]
    assert "lorahook.models" in g["lorahook.files.reader"]
    assert "lorahook.models.base" in g["lorahook.models.decoders"]
    assert "lorahook.hook" in g["lorahook.adapter"]


def test_no_import_cycle():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_file_and_model_code_never_import_the_adapter():
    g = graph()
    for name, targets in g.items():
        if name.startswith(("lorahook.files", "lorahook.models")):
            assert "lorahook.adapter" not in targets, name
            assert "lorahook" not in targets, name


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_compiled_core_is_layered():
    g = graph()
    core = {"lorahook._core.checks", "lorahook._core.halfconv", "lorahook._core.segments", "lorahook._core.plans",
            "lorahook._core.sources", "lorahook._rows", "lorahook._core.slot_rows", "lorahook._core.slot_pairs"}
    # edges that must be there, so that an unread .pyx cannot pass: hooks reach kernel
    # sources, sources reach layer kernels, layer kernels the segment kernels
    assert {"lorahook._core.checks", "lorahook._core.sources"} <= g["lorahook._rows"]
    assert "lorahook._core.plans" in g["lorahook._core.sources"]
    assert {"lorahook._core.checks", "lorahook._core.segments"} <= g["lorahook._core.plans"]
    assert {"lorahook._core.checks", "lorahook._core.halfconv"} <= g["lorahook._core.segments"]
    assert "lorahook._core.slot_rows" in g["lorahook._core.slot_pairs"]
    assert "lorahook._core.halfconv" in g["lorahook.files._load"]
    for name in core:
        # the core knows kernels and buffers: not files, not test entry points
        assert not g[name] & {"lorahook.files._load", "lorahook._testing"}, name
        assert all(t.startswith("lorahook._") for t in g[name]), (name, g[name])
    for name, targets in g.items():
        if name != "lorahook._testing":
            assert "lorahook._testing" not in targets, name


def test_no_source_file_of_the_package_is_over_six_hundred_lines():
    """Python modules, compiled modules and their headers alike."""
    sources = [p for p in ROOT.rglob("*") if p.suffix in (".py", ".pyx", ".pxd", ".h")]
    assert len(sources) > 20
    long = {p.name: n for p in sources
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > 600}
    assert not long, long


def test_the_test_only_compiled_module_is_not_part_of_the_package():
    assert not list(ROOT.glob("_testing*")), "tests/support/_testing.pyx is built by the tests"


def test_every_subpackage_is_listed_for_the_wheel():
    """pyproject.toml lists packages by hand: a subpackage left out would be missing from the wheel."""
    # the checkout's pyproject.toml (beside tests/), against the package imported (installed or not)
    tool = tomllib.loads(PYPROJECT.read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    packages = {".".join(p.parent.relative_to(ROOT.parent).parts) for p in ROOT.rglob("__init__.py")}
    data_only = {p for p in tool["package-data"] if p not in packages}  # folders of data files
    assert packages == listed - data_only


def test_an_uncompiled_source_tree_says_what_to_run(tmp_path):
    # the package's Python and Cython sources alone, as a checkout has them before any build
    import shutil
    import subprocess
    import sys

    shutil.copytree(ROOT, tmp_path / "lorahook",
                    ignore=shutil.ignore_patterns("*.so", "*.pyd", "*.c", "__pycache__"))
    # -S: no site-packages, so no installed or editable lorahook can answer the import
    run = subprocess.run([sys.executable, "-S", "-c", "import lorahook"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: lorahook's compiled core (lorahook._rows) is not built")
    assert str(tmp_path) in last and "pip install" in last and "build_ext --inplace" in last
    assert "ModuleNotFoundError" in run.stderr  # the cause is kept, chained


def test_the_pythons_claimed_are_the_pythons_ci_tests():
    """requires-python, the classifiers, the wheels cibuildwheel builds and the Pythons .ci/run makes
    venvs from name one list of CPython versions."""
    project = tomllib.loads(PYPROJECT.read_text())
    floor = re.fullmatch(r">=3\.(\d+)", project["project"]["requires-python"])
    assert floor, project["project"]["requires-python"]
    minors = sorted(int(m) for m in re.findall(r"Programming Language :: Python :: 3\.(\d+)$",
                                                "\n".join(project["project"]["classifiers"]), re.M))
    assert minors and minors[0] == int(floor.group(1))
    assert minors == list(range(minors[0], minors[-1] + 1)), "no gap in the versions claimed"
    wheels = sorted(int(m) for m in re.findall(r"cp3(\d+)-\*", project["tool"]["cibuildwheel"]["build"]))
    assert wheels == minors
    ci = (CHECKOUT / ".ci" / "run").read_text()
    made = sorted({int(m) for m in re.findall(r"^PY3(\d+)=", ci, re.M)})
    assert made == minors, f".ci/run makes venvs from 3.{made}, the classifiers claim 3.{minors}"
    # the floors of NumPy and SciPy are the versions the oldest Python's pass pins
    deps = dict(re.fullmatch(r"([a-z_]+)>=(\S+)", d).groups() for d in project["project"]["dependencies"])
    for name in ("numpy", "scipy"):
        assert f"'{name}=={deps[name]}.0'" in ci or f"'{name}=={deps[name]}'" in ci, name


def test_the_compiled_core_writes_its_c_in_headers():
    # C lives in the .h files beside the Cython that declares it, never in a Cython string
    for path in sorted(ROOT.rglob("*.pyx")) + sorted(ROOT.rglob("*.pxd")):
        text = path.read_text(encoding="utf-8")
        assert not re.search(r'cdef extern from \*:\s*"""', text), path


def test_every_compiled_module_reads_the_one_instruction_set_target():
    # each module whose kernels convert or dispatch attaches to halfconv's target at import
    for name in ("segments", "slot_rows", "slot_pairs"):
        assert "lh_isa_attach(isa_cell())" in (ROOT / "_core" / f"{name}.pyx").read_text()
    assert "lh_isa_attach(isa_cell())" in (ROOT / "files" / "_load.pyx").read_text()
    for header in ROOT.rglob("*.h"):
        text = header.read_text(encoding="utf-8")
        if header.name != "isa.h":
            assert "__builtin_cpu_supports" not in text, f"{header.name} detects the CPU itself"
