"""lorahook's asv suite: see docs/guide/benchmarks.md."""
import os


def measured_here(module):
    """Whether this environment measures the suite module ``module`` (its ``__name__``).

    ``LORAHOOK_ASV_ONLY`` (set by an environment of ``asv.conf.json``) names the
    suite modules an environment measures, comma-separated; unset, it measures
    them all.  So a benchmark is measured in one environment rather than in each.
    """
    only = os.environ.get("LORAHOOK_ASV_ONLY")
    return not only or module.rsplit(".", 1)[-1] in {m.strip() for m in only.split(",")}


def module_setup(module):
    """A module-level ``setup`` that skips the module's benchmarks where they are not measured.

    asv runs a module's ``setup`` before each of its benchmarks (and before a
    ``setup_cache``, where skipping is a failure: a module with one gates its
    class's ``setup_cache`` and ``setup`` with :func:`measured_here` instead).
    """
    def setup(*params):
        if not measured_here(module):
            raise NotImplementedError  # measured in another environment

    return setup


def preimport(*modules):
    """Import ``modules`` now, those that are installed (the others are skipped silently).

    A suite module calls this at import for the peers its benchmarks use
    (torch, transformers, PEFT, vLLM): asv imports the suite once in its
    forkserver and forks a process for each benchmark and parameter set,
    which then finds them imported instead of importing them again, seconds
    each time.  A benchmark still raises ``NotImplementedError`` in ``setup``
    when one is missing.
    """
    import importlib
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def first_module(*names):
    """The first of ``names`` this version of lorahook has, imported.

    The suite runs against older commits too, where a module lived elsewhere
    (``lorahook.cli.bench`` was ``lorahook.bench``, ``lorahook._core.halfconv``
    was ``lorahook._halfconv``).  ``NotImplementedError`` (asv: skipped) when
    none is there.
    """
    import importlib
    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise NotImplementedError(f"none of {', '.join(names)} in this version")
