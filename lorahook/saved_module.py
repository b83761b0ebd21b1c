"""Modules an adapter saves whole (PEFT's ``modules_to_save``)."""
import numpy as np

from ._kernels import SAVED_EMBEDDING, SAVED_LINEAR, LayerKernel
from ._arrays import adoptable, owned_float32, owned_vector

__all__ = ["SavedModule"]


class SavedModule:
    """A module an adapter saved whole (PEFT's ``modules_to_save``): linear or embedding.

    For the rows of its adapter it replaces the base module's output: a
    linear gives ``weight @ x + bias`` (``weight`` ``(d_out, d_in)``, ``bias``
    ``(d_out,)`` or ``None``), an embedding (``embedding=True``, ``weight``
    ``(num_embeddings, embedding_dim)``) gives ``weight[id]``.  Arrays are
    copied once into read-only float32 arrays (a linear keeps ``weight^T``,
    the layout its kernel reads; :attr:`weight` is a view).  ``d_in`` /
    ``d_out`` are ``(in_features, out_features)`` or ``(num_embeddings,
    embedding_dim)``, checked against a model like a projection's.
    """

    __slots__ = ("_wt", "_bias", "_embedding", "_kernel")

    def __init__(self, weight, bias=None, *, embedding=False):
        embedding = bool(embedding)
        wt = owned_float32(weight, "weight", 2, transpose=not embedding)
        if min(wt.shape) < 1:
            raise ValueError(f"weight must have both dimensions >= 1, got {np.shape(weight)}")
        if bias is not None:
            if embedding:
                raise ValueError("a saved embedding has no bias")
            bias = owned_vector(bias, "bias", wt.shape[1], "")
        self._init(wt, bias, embedding)

    def _init(self, wt, bias, embedding):
        object.__setattr__(self, "_wt", wt)
        object.__setattr__(self, "_bias", bias)
        object.__setattr__(self, "_embedding", embedding)
        kind = SAVED_EMBEDDING if embedding else SAVED_LINEAR
        object.__setattr__(self, "_kernel",
                           LayerKernel(None, wt, 1.0, kind=kind, pre_add=bias))

    def __setattr__(self, name, value):
        raise AttributeError("SavedModule is immutable")

    def __reduce__(self):
        return (_saved_from_pickle, (self._wt, self._bias, self._embedding))

    is_embedding = property(lambda self: self._embedding)
    weight = property(lambda self: self._wt if self._embedding else self._wt.T,
                      doc="``(d_out, d_in)`` (linear) or ``(num_embeddings, embedding_dim)``, read-only.")
    bias = property(lambda self: self._bias, doc="``(d_out,)`` float32 or ``None``.")
    d_in = property(lambda self: self._wt.shape[0])
    d_out = property(lambda self: self._wt.shape[1])
    dtype = property(lambda self: self._wt.dtype)
    rank = property(lambda self: 0, doc="0: a saved module has no LoRA factors.")

    @property
    def num_parameters(self):
        return self._wt.size + (0 if self._bias is None else self._bias.size)

    def _arrays(self):
        return (self._wt,) if self._bias is None else (self._wt, self._bias)

    @property
    def nbytes(self):
        return sum(arr.nbytes for arr in self._arrays())

    def __repr__(self):
        what = "embedding" if self._embedding else "linear"
        bias = ", bias" if self._bias is not None else ""
        return f"SavedModule({what}, d_in={self.d_in}, d_out={self.d_out}{bias})"


def kernel_of(module):
    """The saved module's compiled kernel (a ``lorahook.LayerKernel``)."""
    return module._kernel


def arrays_of(module):
    """Every array the saved module keeps."""
    return module._arrays()


def _saved_from_pickle(wt, bias, embedding):
    for arr in (wt, bias):
        if isinstance(arr, np.ndarray) and arr.flags.writeable:
            arr.flags.writeable = False
    adoptable(wt, "weight", 2)
    if bias is not None:
        adoptable(bias, "bias", 1)
        if bias.shape != (wt.shape[1],) or embedding:
            raise ValueError("a saved module's bias must have d_out values (linear modules only)")
    if min(wt.shape) < 1:
        raise ValueError("a saved module's weight must have both dimensions >= 1")
    out = SavedModule.__new__(SavedModule)
    out._init(wt, bias, bool(embedding))
    return out
