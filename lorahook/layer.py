"""One adapter layer: :class:`LoraLayer`, ``scale * B @ (A @ x)`` (+ bias) for one projection.

A layer is immutable data validated once at construction: its factors are
kept read-only, ``B`` transposed, in float32, a 16-bit dtype or int8 with
scales, with the
variants PEFT writes (embedding LoRA, DoRA with its base terms).  The
compiled kernel a layer runs is built here, once.
"""
import numpy as np

from ._core.plans import EMBEDDING, LORA, SAVED_EMBEDDING, SAVED_LINEAR, LayerKernel
from ._values import (FLOAT32, INT8, WEIGHT_DTYPES, adoptable, as_float32, check_bias_shape,
                      check_factor_shapes, check_int8_scales, dequantized, dora_terms,
                      finite_scale, owned_float32, owned_vector, quantized, rounded, weight_dtype)

__all__ = ["LoraLayer", "SavedModule"]


class LoraLayer:
    """One projection's LoRA update: ``delta(x) = scale * (B @ (A @ x) + bias)``.

    ``a`` is ``(rank, d_in)``, ``b`` is ``(d_out, rank)`` (the PEFT layout of
    ``lora_A.weight`` / ``lora_B.weight``), ``bias`` an optional ``(d_out,)``
    vector (PEFT's ``lora_bias``, scaled like the product).  Each array is
    copied once into a float32 array the layer owns, marked read-only,
    whatever its dtype: a layer in float16, bfloat16 or int8 is made from one
    with :meth:`astype` (as the file reader does for a ``dtype=``), and keeps
    its factors in that dtype (:attr:`dtype`).  ``B``
    is kept in one layout only, ``B^T`` row-major, which is what the kernels
    read: :attr:`b` is a read-only ``(d_out, rank)`` view of it (F-contiguous),
    so the layer holds each value once (:attr:`nbytes`).  Rank 0 (without
    bias) is allowed and applies nothing.

    ``embedding=True`` makes it PEFT's embedding LoRA (``lora_embedding_A``
    ``(rank, num_embeddings)`` as ``a``, ``lora_embedding_B``
    ``(embedding_dim, rank)`` as ``b``), applied with
    :func:`lorahook.apply_lora_embedding`: row ``i`` gets ``scale * B @
    A[:, i]``; it has no bias and no DoRA.

    ``magnitude`` (a ``(d_out,)`` vector, PEFT's ``lora_magnitude_vector``)
    makes it a DoRA layer: with base weight ``W`` and base bias ``b``, each
    output row ``y`` (the base output, bias included) becomes ``y + (g - 1) *
    (y - b) + g * scale * B @ (A @ x)`` where ``g = magnitude / ||W + scale
    * B @ A||`` (per output row).  A DoRA layer needs its base weight once:
    :meth:`with_base` returns the layer that applies; applying one without
    it raises ``ValueError`` before anything is written.

    Parameters
    ----------
    a : array_like, shape (rank, d_in)
        The down projection (``lora_A.weight``); any real dtype, copied to
        float32 (:meth:`astype` keeps a layer in 16 bits or int8).
    b : array_like, shape (d_out, rank)
        The up projection (``lora_B.weight``), copied to float32 like ``a``.
    scale : float, default 1.0
        The factor on the product (PEFT's ``lora_alpha / r``); finite and
        representable in float32.
    bias : array_like, shape (d_out,), optional
        PEFT's ``lora_bias``, scaled like the product.
    magnitude : array_like, shape (d_out,), optional
        PEFT's ``lora_magnitude_vector``: a DoRA layer.
    embedding : bool, default False
        PEFT's embedding LoRA (no bias, no DoRA).

    Raises
    ------
    TypeError
        For arrays that are not numeric or a scale that is not a real number.
    ValueError
        For shapes that do not agree (naming both), non-finite values, or a
        variant that does not combine (an embedding with a bias or DoRA).

    Examples
    --------
    >>> import numpy as np, lorahook
    >>> layer = lorahook.LoraLayer(np.ones((2, 3)), np.ones((4, 2)), scale=0.5)
    >>> (layer.rank, layer.d_in, layer.d_out)
    (2, 3, 4)
    >>> lorahook.LoraLayer(np.ones((2, 3)), np.ones((4, 5)))
    Traceback (most recent call last):
    ...
    ValueError: ranks disagree: a has shape (2, 3) (rank 2), b has shape (4, 5) (rank 5)
    """

    __slots__ = ("_a", "_bt", "_scale", "_bias", "_kernel", "_embedding", "_magnitude", "_dora",
                 "_qs")

    def __init__(self, a, b, scale=1.0, bias=None, *, magnitude=None, embedding=False):
        a = owned_float32(a, "a", 2)
        b = owned_float32(b, "b", 2, transpose=True)  # stored as B^T
        scale = finite_scale(scale, "scale")
        check_factor_shapes(a, b)
        if bias is not None:
            bias = owned_float32(bias, "bias", 1)
            check_bias_shape(a, b, bias)
        embedding = bool(embedding)
        if magnitude is not None:
            magnitude = owned_float32(magnitude, "magnitude", 1)
        check_variant(a, b, bias, embedding, magnitude)
        self._init(a, b, scale, bias, embedding, magnitude, None)

    def _init(self, a, bt, scale, bias, embedding=False, magnitude=None, dora=None, qs=None):
        object.__setattr__(self, "_a", a)
        object.__setattr__(self, "_qs", qs)
        object.__setattr__(self, "_bt", bt)
        object.__setattr__(self, "_scale", scale)
        object.__setattr__(self, "_bias", bias)
        object.__setattr__(self, "_embedding", embedding)
        object.__setattr__(self, "_magnitude", magnitude)
        object.__setattr__(self, "_dora", dora)
        kind = EMBEDDING if embedding else LORA
        if dora is not None:  # float32 factors, g folded into B, y = g*y + c first
            g, c, gbt, a32 = dora
            kernel = LayerKernel(a32, gbt, scale, None, pre_mul=g, pre_add=c)
        elif a.dtype == np.float32:
            kernel = LayerKernel(a, bt, scale, bias, kind=kind,
                                          needs_base=magnitude is not None)
        elif a.dtype == INT8:  # read in place, with a float32 scale per row of A and per output
            kernel = LayerKernel(a, bt, scale, bias, weights="int8", scales=qs, kind=kind,
                                 needs_base=magnitude is not None)
        else:  # 16-bit weights: the core takes their bit patterns
            kernel = LayerKernel(a.view(np.uint16), bt.view(np.uint16), scale,
                                       None if bias is None else bias.view(np.uint16),
                                       weights=a.dtype.name, kind=kind,
                                       needs_base=magnitude is not None)
        object.__setattr__(self, "_kernel", kernel)

    @classmethod
    def _adopt(cls, a, bt, scale, bias=None, embedding=False, magnitude=None, dora=None,
               qs=None):
        """A layer that keeps ``a``, ``bt`` (``B^T``, ``(rank, d_out)``) and ``bias`` as they are.

        For arrays already checked finite that this layer may keep: a file reader's
        fresh float32 arrays, or unpickled ones (float32, 16-bit or int8 weights, all
        of one dtype; int8 ones with their scales ``qs``, checked finite and >= 0;
        a magnitude, an int8 layer's bias and DoRA's base terms in float32).  They
        must be native, C-contiguous and read-only.  Shapes, ranks, the scale and the
        variant are checked as :class:`LoraLayer` checks them; nothing is copied.
        """
        dtype = a.dtype if isinstance(a, np.ndarray) and a.dtype.name in WEIGHT_DTYPES \
            and a.dtype.isnative else FLOAT32
        adoptable(a, "a", 2, dtype)
        adoptable(bt, "b^T", 2, dtype)
        scale = finite_scale(scale, "scale")
        check_factor_shapes(a, bt)
        if (dtype == INT8) != (qs is not None):
            raise ValueError("int8 factors, and only they, come with scales")
        if qs is not None:
            check_int8_scales(a, bt, qs)
        if bias is not None:
            adoptable(bias, "bias", 1, FLOAT32 if dtype == INT8 else dtype)
            check_bias_shape(a, bt, bias)
        if magnitude is not None:
            adoptable(magnitude, "magnitude", 1)
        for name, arr, nd in zip(("g", "(1 - g) b", "g B^T", "a"), dora or (), (1, 1, 2, 2)):
            adoptable(arr, name, nd)
        check_variant(a, bt, bias, bool(embedding), magnitude, dora)
        return cls._trusted(a, bt, scale, bias, bool(embedding), magnitude, dora, qs)

    @classmethod
    def _trusted(cls, a, bt, scale, bias, embedding=False, magnitude=None, dora=None, qs=None):
        # For arrays checked as a layer checks them (those of a layer, or what a file reader
        # returned: lorahook.files.LayerData): no copy, and no check but the kernel's.
        self = cls.__new__(cls)
        self._init(a, bt, float(scale), bias, embedding, magnitude, dora, qs)
        return self

    def __setattr__(self, name, value):
        raise AttributeError("LoraLayer is immutable")

    def __reduce__(self):
        variant = None
        if self._embedding or self._magnitude is not None:
            variant = (self._embedding, self._magnitude, self._dora)
        args = (self._a, self._bt, self._scale, self._bias, variant)
        return (_layer_from_pickle, args if self._qs is None else args + (self._qs,))

    def _like(self, a, bt, scale, bias, dora, qs=None):
        """A layer of this one's variant (embedding, magnitude) with other arrays."""
        return LoraLayer._trusted(a, bt, scale, bias, self._embedding, self._magnitude, dora, qs)

    # --- variants ------------------------------------------------------------

    is_embedding = property(lambda self: self._embedding,
                            doc="Whether this is an embedding LoRA (``apply_lora_embedding``).")
    magnitude = property(lambda self: self._magnitude,
                         doc="DoRA's ``(d_out,)`` magnitude vector (float32), or ``None``.")
    is_dora = property(lambda self: self._magnitude is not None, doc="Whether this is a DoRA layer.")
    has_base = property(lambda self: self._dora is not None,
                        doc="Whether this DoRA layer has its base weight's terms (:meth:`with_base`).")

    def with_base(self, weight, bias=None):
        """This DoRA layer with the terms of its base ``weight`` ``(d_out, d_in)`` and ``bias``.

        The norm is computed once, in float64, from ``weight`` (a float array;
        dequantize a quantized one first) and this layer's factors and scale;
        the layer then keeps ``g`` and ``(1 - g) * bias`` (``d_out`` values
        each) and float32 copies of its factors with ``g`` folded into ``B``.
        ``ValueError`` for a layer that is not DoRA, wrong shapes, non-finite
        values or a zero row.
        """
        if self._magnitude is None:
            raise ValueError("with_base applies to DoRA layers (with a magnitude vector) only")
        a32, bt32, _ = float_factors(self)
        dora = dora_terms(a32, bt32, self._scale, self._magnitude, weight, bias, "")
        return self._like(self._a, self._bt, self._scale, self._bias, dora, self._qs)

    a = property(lambda self: self._a,
                 doc="``(rank, d_in)`` in :attr:`dtype` (float32 unless converted), read-only; "
                     "int8 values go with :attr:`a_scale`.")
    b = property(lambda self: self._bt.T,
                 doc="``(d_out, rank)`` in :attr:`dtype`, a read-only view of the kept ``B^T``; "
                     "int8 values go with :attr:`b_scale`.")
    a_scale = property(lambda self: None if self._qs is None else self._qs[0],
                       doc="An int8 layer's ``(rank,)`` float32 scales, one per row of ``a`` "
                           "(``A = a_scale[:, None] * a``), else ``None``.")
    b_scale = property(lambda self: None if self._qs is None else self._qs[1],
                       doc="An int8 layer's ``(d_out,)`` float32 scales, one per output "
                           "(``B = b_scale[:, None] * b``), else ``None``.")
    scale = property(lambda self: self._scale, doc="The layer's scale (float).")
    bias = property(lambda self: self._bias, doc="``(d_out,)`` float32 or ``None``.")
    rank = property(lambda self: self._a.shape[0])
    d_in = property(lambda self: self._a.shape[1])
    d_out = property(lambda self: self._bt.shape[1])

    @property
    def num_parameters(self):
        return self._a.size + self._bt.size + (0 if self._bias is None else self._bias.size)

    def _arrays(self):
        arrays = [self._a, self._bt, *(self._qs or ())]
        for extra in (self._bias, self._magnitude):
            if extra is not None:
                arrays.append(extra)
        if self._dora is not None:  # g, c, g*B^T, and A when its float32 copy is its own
            arrays.extend(arr for arr in self._dora if arr is not self._a)
        return tuple(arrays)

    @property
    def nbytes(self):
        """Bytes of the arrays the layer keeps (``a``, ``B^T``, ``bias``, int8 scales, DoRA's terms)."""
        return sum(arr.nbytes for arr in self._arrays())

    def with_scale(self, scale):
        """The same arrays with another scale (no copy).

        A DoRA layer with its base terms keeps them only for the same scale
        (its norm depends on the scale): another scale is a ``ValueError``;
        scale it before :meth:`with_base`.
        """
        scale = finite_scale(scale, "scale")
        if self._dora is not None and scale != self._scale:
            raise ValueError("a DoRA layer's base terms depend on its scale: scale the layer "
                             "before with_base, not after")
        return self._like(self._a, self._bt, scale, self._bias, self._dora, self._qs)

    @property
    def dtype(self):
        """The dtype ``a`` and ``b`` are kept in: float32, float16, bfloat16 or int8."""
        return self._a.dtype

    def astype(self, dtype):
        """This layer with ``a`` and ``b`` kept in ``dtype`` (float32, float16, bfloat16 or int8).

        16-bit values are rounded once, to nearest even (the bias, if any,
        too).  int8 keeps ``a`` with a float32 scale per row and ``b`` with one
        per output (symmetric, to nearest; :attr:`a_scale`, :attr:`b_scale`),
        quantized from the layer's float32 values, and its bias in float32.  An
        int8 layer converted to another dtype starts from its dequantized
        values (``scale * q`` rounded once to float32).  ``self`` when already
        in ``dtype``.  The kernels widen 16-bit arrays to float32 on each call,
        and read int8 ones in place.
        """
        dt = weight_dtype(dtype)
        if dt == self._a.dtype:
            return self
        arrays = list(float_factors(self))  # float32 (widened or dequantized), read-only
        qs = None
        if dt == INT8:
            (qa, sa), (qbt, sb) = quantized(arrays[0], 1), quantized(arrays[1], 0)
            arrays, qs = [qa, qbt, arrays[2]], (sa, sb)
        elif dt != np.float32:
            arrays = [None if arr is None else rounded(arr, dt) for arr in arrays]
        dora = self._dora
        if dora is not None:  # the base terms stay; the kernel's factors are the converted ones
            g, c = dora[0], dora[1]
            layer = self._like(arrays[0], arrays[1], self._scale, arrays[2], None, qs)
            a32, bt32, _ = float_factors(layer)  # a32 is arrays[0] itself for float32
            gbt = np.ascontiguousarray(bt32 * g[None, :], dtype=np.float32)
            gbt.flags.writeable = False
            dora = (g, c, gbt, a32)
        return self._like(arrays[0], arrays[1], self._scale, arrays[2], dora, qs)

    def delta_weight(self):
        """``scale * B @ A`` as a float32 ``(d_out, d_in)`` array (computed in float32)."""
        a32, bt32, _ = float_factors(self)
        out = bt32.T @ a32
        out *= np.float32(self._scale)
        return out

    def __repr__(self):
        extra = ", bias" if self._bias is not None else ""
        if self._embedding:
            extra += ", embedding"
        if self._magnitude is not None:
            extra += ", DoRA" + ("" if self._dora is not None else " without base")
        return (f"LoraLayer(rank={self.rank}, d_in={self.d_in}, d_out={self.d_out}, "
                f"scale={self._scale:g}{extra})")


# What the rest of the package reads of an adapter's part, a layer or a saved module
# (adapter, adapter store), offered here rather than read from its private state.

def kernel_of(part):
    """The part's compiled kernel (a ``lorahook._core.plans.LayerKernel``)."""
    return part._kernel


def arrays_of(part):
    """Every array the part keeps: a layer's factors, bias, int8 scales and DoRA's terms; a
    saved module's weight and bias."""
    return part._arrays()


def float_factors(layer):
    """``(a, b^T, bias)`` of ``layer`` as float32 values (``bias`` may be ``None``).

    The kept arrays themselves for a float32 layer; 16-bit ones widened
    (exact); int8 ones dequantized (``scale * q`` rounded once to float32).
    Every array is read-only.
    """
    if layer._qs is not None:
        out = (dequantized(layer._a, layer._qs[0], 1), dequantized(layer._bt, layer._qs[1], 0),
               layer._bias)
    else:
        out = tuple(None if arr is None else as_float32(arr)
                    for arr in (layer._a, layer._bt, layer._bias))
    for arr in out:
        if arr is not None and arr.flags.writeable:
            arr.flags.writeable = False
    return out


def checked_layer(a, bt, scale, bias, embedding=False, magnitude=None):
    """A layer of arrays a reader has already made owned and read-only.

    ``a`` and ``bt`` (``B`` transposed) are adopted as they are after the
    variant check (:func:`check_variant`); what the constructor would copy
    and convert is not repeated.
    """
    check_variant(a, bt, bias, embedding, magnitude)
    return LoraLayer._trusted(a, bt, scale, bias, bool(embedding), magnitude)


def check_variant(a, bt, bias, embedding, magnitude, dora=None):
    """The checks of a layer's variant: embedding LoRA, DoRA and DoRA's base terms."""
    d_out = bt.shape[1]
    if embedding and bias is not None:
        raise ValueError("an embedding LoRA layer has no bias (PEFT's Embedding has no lora_bias)")
    if embedding and magnitude is not None:
        raise ValueError("DoRA on an embedding layer is not supported")
    if magnitude is not None and bias is not None:
        raise ValueError("a DoRA layer with a lora_bias is not supported")
    if magnitude is not None and magnitude.shape != (d_out,):
        raise ValueError(f"magnitude must have shape ({d_out},) (one per output), got "
                         f"{magnitude.shape}")
    if dora is not None and (magnitude is None or [x.shape for x in dora]
                             != [(d_out,), (d_out,), bt.shape, a.shape]):
        raise ValueError("DoRA's base terms do not match the layer's factors")


def _layer_from_pickle(a, bt, scale, bias, variant=None, qs=None):
    """An unpickled layer: its arrays kept as they arrive (protocol-5 buffers too), read-only."""
    variant = variant or (False, None, None)
    for arr in (a, bt, bias, variant[1]) + tuple(variant[2] or ()) + tuple(qs or ()):
        if isinstance(arr, np.ndarray) and arr.flags.writeable:
            arr.flags.writeable = False
    return LoraLayer._adopt(a, bt, scale, bias, *variant, qs=qs)


# ----------------------------------------------------------------------------
# saved modules: what an adapter saves whole (PEFT's modules_to_save)
# ----------------------------------------------------------------------------
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
