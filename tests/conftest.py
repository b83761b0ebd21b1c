"""Shared test settings: hypothesis profiles (LORAHOOK_HYPOTHESIS_PROFILE), and the helpers.

``tests/`` mirrors the package: ``tests/test_<module>.py`` for a module of
``lorahook``, ``tests/<subpackage>/test_<module>.py`` for one of a
subpackage, property and hostile tests beside them, ``tests/oracle/`` for the
comparisons with PyTorch, transformers and PEFT.  What several tests share
(models, files and servers they make, helpers) is in ``tests/support/``,
importable from every test module.
"""
import os
import sys

from hypothesis import HealthCheck, settings

_QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large]

settings.register_profile("ci", max_examples=200, deadline=None, suppress_health_check=_QUIET)
settings.register_profile("dev", max_examples=50, deadline=None, suppress_health_check=_QUIET)
settings.register_profile("thorough", max_examples=2000, deadline=None, suppress_health_check=_QUIET)
settings.load_profile(os.environ.get("LORAHOOK_HYPOTHESIS_PROFILE", "ci"))

SUPPORT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "support")
if SUPPORT not in sys.path:
    sys.path.insert(0, SUPPORT)

# Child processes started by tests must import the same lorahook as the tests
# (the installed package in CI, an in-place build during development), not
# whatever the current directory holds: they run from this directory with the
# parent's import root on PYTHONPATH.  The helpers go on it too: a Ray worker
# that unpickles a class of a test module imports that module, and with it the
# helpers it imports.
import lorahook as _lorahook

_IMPORT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(_lorahook.__file__)))
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (_IMPORT_ROOT, SUPPORT, os.environ.get("PYTHONPATH")) if p)
