"""lorahook._core.checks: the buffer checks every call into the kernels passes, on their own."""
import numpy as np
import pytest

from lorahook._core.checks import check_rows


def rows(n, width, dtype=np.float32):
    return np.zeros((n, width), dtype)


@pytest.mark.parametrize("x, y, widths, n", [
    (rows(3, 4), rows(3, 5), (None, None), 3),
    (rows(3, 4).ravel(), rows(3, 5).ravel(), (4, 5), 3),   # flattened rows take their widths
    (rows(0, 4), rows(0, 5), (4, 5), 0),
    (rows(2, 4, np.float16), rows(2, 5, np.float16), (4, 5), 2),
])
def test_good_buffers_give_their_row_count(x, y, widths, n):
    assert check_rows(x, y, *widths) == n


@pytest.mark.parametrize("x, y, widths, exc, match", [
    (rows(3, 4), rows(2, 5), (None, None), ValueError, "row counts must match"),
    (rows(3, 4).ravel(), rows(3, 5).ravel(), (None, None), TypeError, "width"),
    (rows(3, 4), rows(3, 5), (3, None), ValueError, "input_row_width"),
    (rows(3, 4), rows(3, 5, np.float64), (None, None), TypeError, "float"),
    (rows(3, 8)[:, ::2], rows(3, 5), (None, None), ValueError, "contiguous"),
    ([[0.0] * 4] * 3, rows(3, 5), (None, None), TypeError, "ndarray"),
])
def test_bad_buffers_are_refused_naming_what_is_wrong(x, y, widths, exc, match):
    with pytest.raises(exc, match=match):
        check_rows(x, y, *widths)


def test_a_read_only_or_overlapping_output_is_refused():
    x, y = rows(2, 4), rows(2, 4)
    y.flags.writeable = False
    with pytest.raises(ValueError, match="writ"):
        check_rows(x, y, None, None)
    both = np.zeros(12, np.float32)  # two flattened buffers over one memory
    with pytest.raises(ValueError, match="overlap|share"):
        check_rows(both[:8], both[4:], 4, 4)
