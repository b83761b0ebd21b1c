"""lorahook's own modules import each other one way only: the import graph has no cycle.

Every ``import`` / ``from ... import`` of a lorahook module counts, at the top of a file or
inside a function. Edges go to the module named; ``from pkg import name`` goes to
``pkg.name`` when that is a module. The implicit import of a parent package when a
submodule is imported is not an edge (``lorahook.models.base`` does not depend on
``lorahook.models/__init__``, it only lives in it).
"""
import ast
from pathlib import Path

import lorahook

ROOT = Path(lorahook.__file__).resolve().parent


def module_names():
    """``{dotted name: path}`` of every Python module in the lorahook package (and _rows)."""
    names = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    names["lorahook._rows"] = ROOT / "_rows.pyx"
    return names


def imports_of(name, path, known):
    """The lorahook modules ``name`` imports anywhere in its source."""
    if path.suffix != ".py":
        return set()
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
