"""lorahook.layer: LoraLayer's checks and arrays, and what the package reads of a layer."""
import numpy as np
import pytest

from lorahook import LoraLayer
from lorahook._core.plans import EMBEDDING, LORA, LayerKernel, apply_layer
from lorahook.layer import arrays_of, checked_layer, kernel_of


def test_layer_validation():
    with pytest.raises(ValueError, match="2-D"):
        LoraLayer(np.zeros(3), np.zeros((3, 1)))
    with pytest.raises(ValueError, match="ranks disagree"):
        LoraLayer(np.zeros((2, 3)), np.zeros((4, 3)))
    with pytest.raises(ValueError, match="finite"):
        LoraLayer(np.full((1, 2), np.nan), np.zeros((2, 1)))
    with pytest.raises(ValueError, match="finite"):
        LoraLayer(np.full((1, 2), 1e300), np.zeros((2, 1)))  # overflows float32
    with pytest.raises(ValueError, match="finite"):
        LoraLayer(np.zeros((1, 2)), np.zeros((2, 1)), scale=float("inf"))
    with pytest.raises(TypeError):
        LoraLayer(np.zeros((1, 2)), np.zeros((2, 1)), scale="2")
    with pytest.raises(ValueError, match="bias"):
        LoraLayer(np.zeros((1, 2)), np.zeros((3, 1)), bias=np.zeros(2))
    with pytest.raises(ValueError, match="rank-0"):
        LoraLayer(np.zeros((0, 2)), np.zeros((3, 0)), bias=np.zeros(3))
    with pytest.raises(TypeError, match="real numbers"):
        LoraLayer(np.zeros((1, 2), complex), np.zeros((2, 1)))


def test_layer_owns_readonly_float32_copies():
    a = np.ones((2, 3))
    layer = LoraLayer(a, np.ones((4, 2)), 0.5)
    a[:] = 5
    assert layer.a.dtype == np.float32 and layer.a.flags.c_contiguous
    assert not layer.a.flags.writeable and not layer.b.flags.writeable
    assert (layer.a == 1).all()
    assert (layer.rank, layer.d_in, layer.d_out, layer.scale) == (2, 3, 4, 0.5)
    with pytest.raises(AttributeError):
        layer.scale = 2.0


def test_kernel_of_is_the_layer_compiled_as_it_is():
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((3, 7)), rng.standard_normal((5, 3))
    layer = LoraLayer(a, b, 0.25)
    kernel = kernel_of(layer)
    assert isinstance(kernel, LayerKernel) and kernel is kernel_of(layer)
    assert (kernel.rank, kernel.d_in, kernel.d_out, kernel.kind) == (3, 7, 5, LORA)
    assert kernel.scale == np.float32(0.25)
    # the kernel computes the layer's delta, against float64
    x = rng.standard_normal((4, 7)).astype(np.float32)
    y = np.zeros((4, 5), np.float32)
    apply_layer(kernel, x, y, 4)
    ref = 0.25 * x.astype(np.float64) @ a.T @ b.T
    assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max()
    emb = LoraLayer(rng.standard_normal((2, 9)), rng.standard_normal((4, 2)), embedding=True)
    assert kernel_of(emb).kind == EMBEDDING


def test_arrays_of_names_every_array_the_layer_keeps():
    layer = LoraLayer(np.ones((2, 3)), np.ones((4, 2)), 1.0, np.ones(4))
    arrays = list(arrays_of(layer))
    assert sum(arr.nbytes for arr in arrays) == 4 * (6 + 8 + 4)
    assert any(np.shares_memory(arr, layer.a) for arr in arrays)
    assert any(np.shares_memory(arr, layer.b) for arr in arrays)
    assert any(np.shares_memory(arr, layer.bias) for arr in arrays)


def test_checked_layer_adopts_a_reader_arrays_and_still_refuses_variants():
    a = np.ones((2, 3), np.float32)
    bt = np.full((2, 4), 0.5, np.float32)
    for arr in (a, bt):
        arr.flags.writeable = False
    layer = checked_layer(a, bt, 2.0, None)
    assert np.shares_memory(layer.a, a) and np.shares_memory(layer.b, bt)  # no copy
    assert np.array_equal(layer.delta_weight(), 2.0 * bt.T.astype(np.float64) @ a)
    with pytest.raises(ValueError, match="embedding"):
        checked_layer(a, bt, 2.0, np.ones(4, np.float32), embedding=True)  # no bias on embeddings
