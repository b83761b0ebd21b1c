"""Imports a test module needs: a skip when missing, a failure when CI requires them."""
import os

import pytest


def need(module, required_by="LORAHOOK_REQUIRE_RAY"):
    """Import ``module``, or skip the calling test module (fail when ``required_by`` is "1")."""
    try:
        found = __import__(module, fromlist=["_"])
        if getattr(found, "__file__", None) is None:
            # a folder of tests named after the module (tests/vllm/) read as a namespace package
            raise ImportError(f"only a namespace package named {module!r} was found")
        return found
    except ImportError as exc:
        if os.environ.get(required_by) == "1":
            raise
        pytest.skip(f"{module} is not installed ({exc})", allow_module_level=True)
