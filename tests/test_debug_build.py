"""The extension reports how it was built, so CI can prove its second pass ran the checked build."""
import os

import pytest

import lorahook
from lorahook import _rows


def test_debug_build_flag_is_a_bool():
    assert isinstance(lorahook.DEBUG_BUILD, bool)
    assert lorahook.DEBUG_BUILD is _rows.DEBUG_BUILD


def test_expected_build_kind():
    expect = os.environ.get("LORAHOOK_EXPECT_DEBUG_BUILD", "")
    if expect in ("", "0"):
        pytest.skip("LORAHOOK_EXPECT_DEBUG_BUILD is not set: no build kind to check")
    assert lorahook.DEBUG_BUILD is True, (
        "LORAHOOK_EXPECT_DEBUG_BUILD is set but the imported extension "
        f"({_rows.__file__}) was not built with LORAHOOK_CYTHON_DEBUG=1")
