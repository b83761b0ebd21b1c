"""Imports a test module needs: a skip when missing, a failure when CI requires them."""
import os

import pytest


def need(module, required_by="LORAHOOK_REQUIRE_RAY"):
    """Import ``module``, or skip the calling test module (fail when ``required_by`` is "1")."""
    try:
        return __import__(module, fromlist=["_"])
    except ImportError as exc:
        if os.environ.get(required_by) == "1":
            raise
        pytest.skip(f"{module} is not installed ({exc})", allow_module_level=True)
