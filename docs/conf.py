"""Sphinx configuration: the user guide (Markdown) and the reference, built from the docstrings."""
import argparse
import os

import lorahook

project = "lorahook"
author = "lorahook developers"
copyright = "lorahook developers"
release = lorahook.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "numpydoc",
    "myst_parser",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_generated"]

# The optional modules' heavy dependencies are not needed to document them: their
# imports are stood in for, so the reference builds from the docs extra alone.
autodoc_mock_imports = ["vllm", "ray", "starlette", "fastapi"]
if os.environ.get("LORAHOOK_DOCS_MOCK_TORCH", "1") != "0":
    autodoc_mock_imports += ["torch", "transformers", "peft"]
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": True}
autodoc_member_order = "bysource"
autosummary_generate = False
numpydoc_show_class_members = False
numpydoc_validation_checks = set()
myst_heading_anchors = 3
suppress_warnings = ["myst.header"]

html_theme = "alabaster"
html_title = f"lorahook {release}"
html_static_path = []


def _write_cli_help(app):
    """The command line's own help, as the reference's text (never out of date)."""
    from lorahook import cli
    out = os.path.join(app.srcdir, "_generated")
    os.makedirs(out, exist_ok=True)
    parser = cli.build_parser()
    os.environ["COLUMNS"] = "88"
    with open(os.path.join(out, "lorahook.txt"), "w") as f:
        f.write(parser.format_help())
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in commands.choices.items():
        if name == "bench":  # its options are the benchmark script's (lorahook bench --help)
            continue
        with open(os.path.join(out, f"lorahook-{name}.txt"), "w") as f:
            f.write(sub.format_help())


def setup(app):
    app.connect("builder-inited", _write_cli_help)
