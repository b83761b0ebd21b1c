"""lorahook._values: what an integer and a finite real are, and how a value is shown in a message."""
import fractions
import math

import numpy as np
import pytest

from lorahook._values import describe, finite_real, is_int, short


def test_is_int_takes_integers_and_refuses_bools_and_floats():
    assert all(is_int(v) for v in (0, -3, 1 << 80, np.int64(5), np.uint8(1)))
    assert not any(is_int(v) for v in (True, np.bool_(False), 1.0, "1", None, np.float32(2)))


def test_short_and_describe_are_bounded_and_never_raise():
    class Broken:
        def __repr__(self):
            raise RuntimeError("no")

    assert short(Broken()) == "a Broken that cannot be shown"
    assert short(1 << 5000) == "an integer of 5001 bits"
    assert len(short("x" * 10_000)) == 200
    assert describe(3) == "int (3)"
    assert describe("y" * 500).startswith("str ('yyy") and len(describe("y" * 500)) < 100


def test_finite_real_accepts_reals_and_names_what_it_refuses():
    assert finite_real(2, "s") == 2.0
    assert finite_real(np.float16(0.5), "s") == 0.5
    assert finite_real(np.array(1.5), "s") == 1.5
    assert finite_real(fractions.Fraction(1, 4), "s") == 0.25
    with pytest.raises(TypeError, match=r"scale must be a real number, got bool \(True\)"):
        finite_real(True, "scale")
    with pytest.raises(TypeError, match="got str"):
        finite_real("1", "scale")
    with pytest.raises(ValueError, match="scale must be finite, got nan"):
        finite_real(math.nan, "scale")
    with pytest.raises(ValueError, match="must be finite, got int"):
        finite_real(1 << 2000, "scale")
    assert finite_real(1e300, "scale") == 1e300
    with pytest.raises(ValueError, match=r"must fit in float32"):
        finite_real(1e300, "scale", float32=True)


def test_the_error_classes_can_be_chosen():
    class FileError(ValueError):
        pass

    with pytest.raises(FileError, match="where: alpha must be a real number"):
        finite_real([], "where: alpha", type_error=FileError, value_error=FileError)
