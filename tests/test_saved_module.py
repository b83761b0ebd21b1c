"""lorahook.saved_module: modules an adapter saves whole, and what the package reads of them."""
import pickle

import numpy as np
import pytest

from lorahook import SavedModule
from lorahook._core.plans import SAVED_EMBEDDING, SAVED_LINEAR, LayerKernel, apply_layer
from lorahook.layer import arrays_of, kernel_of


def test_a_saved_linear_replaces_the_rows_with_its_own_output():
    rng = np.random.default_rng(5)
    w, b = rng.standard_normal((6, 4)), rng.standard_normal(6)
    module = SavedModule(w, b)
    assert (module.d_in, module.d_out, module.rank, module.is_embedding) == (4, 6, 0, False)
    assert np.array_equal(module.weight, w.astype(np.float32)) and not module.weight.flags.writeable
    kernel = kernel_of(module)
    assert isinstance(kernel, LayerKernel) and kernel.kind == SAVED_LINEAR
    x = rng.standard_normal((3, 4)).astype(np.float32)
    y = np.full((3, 6), 1e3, np.float32)  # the base output, replaced
    apply_layer(kernel, x, y, 3)
    ref = x.astype(np.float64) @ w.astype(np.float32).T.astype(np.float64) + b.astype(np.float32)
    assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max()


def test_a_saved_embedding_has_its_kind_and_no_bias():
    module = SavedModule(np.arange(12.0).reshape(4, 3), embedding=True)
    assert kernel_of(module).kind == SAVED_EMBEDDING
    assert (module.d_in, module.d_out) == (4, 3)
    with pytest.raises(ValueError, match="no bias"):
        SavedModule(np.ones((4, 3)), np.ones(3), embedding=True)


@pytest.mark.parametrize("weight, bias, match", [
    (np.ones((0, 3)), None, "both dimensions"),
    (np.ones((2, 3)), np.ones(3), "bias"),
    (np.full((2, 3), np.nan), None, "finite"),
])
def test_bad_arrays_are_refused(weight, bias, match):
    with pytest.raises(ValueError, match=match):
        SavedModule(weight, bias)


def test_arrays_of_counts_what_it_keeps_and_pickles_round_trip():
    module = SavedModule(np.ones((5, 2)), np.zeros(5))
    assert sum(arr.nbytes for arr in arrays_of(module)) == module.nbytes == 4 * (10 + 5)
    back = pickle.loads(pickle.dumps(module))
    assert np.array_equal(back.weight, module.weight) and np.array_equal(back.bias, module.bias)
    with pytest.raises(AttributeError):
        module.bias = None
