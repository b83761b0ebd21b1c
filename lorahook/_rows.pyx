# cython: language_level=3
"""The interface between hooks and the compiled core: ``apply_lora_rows``.

The core knows kernels and buffers, never adapters, file formats or names.
Its public entry point is :func:`apply_lora_rows` (re-exported by
:mod:`lorahook`); the modules behind it, each named after what it computes, are:

* ``_checks``: the call checks;
* ``_sources``: what a hook offers the kernels (an adapter's kernel table, a
  bound batch's unit groups);
* ``_kernels``: adapter layers as typed views, and plans of them over a batch;
* ``_segments``: the GIL-free kernels, whose batched paths run the one
  routine of ``gemm_rows.pxd`` (gathered rows times ``A`` then ``B^T``) on
  the row-major BLAS helpers of ``blas.pxd``;
* ``_halfconv``: float16 and bfloat16 conversions (with ``halfconv.h``, the
  one rounding of each);
* ``_slot_rows`` and ``_slot_pairs``: LoRA over the stacked slots serving
  engines keep, through ``gemm_rows.pxd`` or the pairs kernel of ``pairs.h``;
* beside the core, ``_load`` (reading tensors from files for the loaders).
"""
cimport cython
cimport numpy as cnp
from cpython.type cimport PyType_IsSubtype

from lorahook._core.checks cimport ROWS_BF16, ROWS_F16, ROWS_F32, as_int, as_width, check_call
from lorahook._core.checks cimport check_layout, check_type, row_count
from lorahook._core.sources cimport _ASK_HOOK, _KERNELS, _PER_ROW, KernelSource

import numpy as np

from lorahook._core.checks import check_rows

cnp.import_array()

cdef extern from "build.h":
    int LORAHOOK_DEBUG_BUILD

#: True when the extension was built with bounds checking (LORAHOOK_CYTHON_DEBUG=1).
DEBUG_BUILD = bool(LORAHOOK_DEBUG_BUILD)
# Set by lorahook.hook at import: the abstract base every hook derives from
# or is registered with.
cdef object _hook_base = None


def set_hook_base(cls):
    global _hook_base
    _hook_base = cls

cdef inline tuple _checked_key(object layer_idx, object module):
    """``(layer_idx, module)`` as the key of a table: an int >= 0 or ``None``, and a str."""
    if type(layer_idx) is int and layer_idx >= 0 and type(module) is str:  # the common case
        return (layer_idx, module)
    if layer_idx is not None and type(layer_idx) is not int:
        layer_idx = as_int(layer_idx, "layer_idx (an int, or None for a model-level module)")
    if layer_idx is not None and layer_idx < 0:
        raise ValueError(f"layer_idx must be >= 0 (or None for a model-level module), "
                         f"got {layer_idx}")
    if type(module) is not str:
        if not isinstance(module, str):
            raise TypeError(f"module must be a str, got {type(module).__name__}")
        module = str(module)  # a str subclass (numpy.str_) as the str it holds
    return (layer_idx, module)

cdef object _private_ids(object ids, Py_ssize_t n):
    """A private int64 copy of a 1-D int32 / int64 ``ids`` array of ``n`` values."""
    if not cnp.PyArray_Check(ids):
        raise TypeError(f"ids must be a 1-D numpy.ndarray of int32 or int64, got "
                        f"{type(ids).__name__}")
    cdef cnp.ndarray a = <cnp.ndarray>ids
    cdef int t = cnp.PyArray_TYPE(a)
    if (t != cnp.NPY_INT32 and t != cnp.NPY_INT64) or not cnp.PyArray_ISNOTSWAPPED(a):
        raise TypeError(f"ids must have dtype int32 or int64 in native byte order, got "
                        f"{a.dtype.str} ({a.dtype})")
    if cnp.PyArray_NDIM(a) != 1:
        raise ValueError(f"ids must be 1-D, got {cnp.PyArray_NDIM(a)}-D with shape "
                         f"{(<object>a).shape}")
    if cnp.PyArray_DIM(a, 0) != n:
        raise ValueError(f"ids must hold one id per output row: expected {n}, got "
                         f"{cnp.PyArray_DIM(a, 0)}")
    return np.array(a, dtype=np.int64, order="C", copy=True)


def apply_lora_embedding(hook, layer_idx, module, ids, output, output_row_width=None):
    """Add ``hook``'s embedding LoRA delta to every row of ``output`` in place.

    The row of token id ``i`` gets ``scale * B @ A[:, i]`` added (PEFT's
    ``lora_embedding_A`` ``(r, num_embeddings)`` and ``lora_embedding_B``
    ``(embedding_dim, r)``), or, for an adapter that saved the embedding
    whole (``modules_to_save``), becomes that module's row ``i``.

    Parameters
    ----------
    hook : LoraAdapter or a bound AdapterSet batch or sequence selection
        What to apply (rows may mix adapters); runs in the compiled core with
        the GIL released.
    layer_idx : int
        The layer of the embedding (``0`` for a model's input embedding).
    module : str
        The embedding's name (``"embed_tokens"``, ...).
    ids : ndarray
        One token id per row of ``output``: 1-D, int32 or int64.
    output : ndarray
        The embedded rows: C-contiguous, float32, float16 or bfloat16, 1-D
        with ``output_row_width`` or 2-D ``(rows, embedding_dim)``; updated
        in place.
    output_row_width : int, optional
        The embedding dimension; needed for a 1-D ``output``.

    Raises
    ------
    TypeError
        For a hook that is not an adapter or a bound batch, and for the
        arrays' types and dtypes.
    ValueError
        For shapes, row counts, a bound hook's row count, a covering layer
        that is not an embedding of the output's width, or an id outside
        ``[0, num_embeddings)``.  Nothing is written when a check fails.
    """
    return _apply_ids(hook, layer_idx, module, ids, output, output_row_width, -1)


def apply_lora_embedding_bits(hook, layer_idx, module, ids, output, output_row_width,
                               bfloat16):
    """``apply_lora_embedding`` for a uint16 ``output`` of float16 (or bfloat16) bits."""
    return _apply_ids(hook, layer_idx, module, ids, output, output_row_width,
                      ROWS_BF16 if bfloat16 else ROWS_F16)


cdef object _apply_ids(hook, layer_idx, module, ids, output, output_row_width, int bits):
    if not isinstance(hook, KernelSource) or (<KernelSource>hook)._dispatch == _PER_ROW:
        raise TypeError(
            f"apply_lora_embedding takes a lorahook.LoraAdapter or a bound AdapterSet hook "
            f"(the compiled core), got {type(hook).__name__}")
    cdef KernelSource src = <KernelSource>hook
    cdef int kind = check_type(output, "output", bits)
    cdef cnp.ndarray y = <cnp.ndarray>output
    check_layout(y, "output", True)
    if output_row_width is None:
        if cnp.PyArray_NDIM(y) != 2:
            raise TypeError(f"output_row_width is required for a 1-D output (it is taken from "
                            f"shape[1] of a 2-D array only), got shape {(<object>y).shape}")
        output_row_width = cnp.PyArray_DIM(y, 1)
    cdef Py_ssize_t d_out = as_width(output_row_width, "output_row_width")
    cdef Py_ssize_t n = row_count(y, d_out, "output", "output_row_width")
    private = _private_ids(ids, n)
    cdef Py_ssize_t per_unit = src._rows_per_unit(n)
    cdef tuple key = _checked_key(layer_idx, module)
    if src._dispatch == _ASK_HOOK and not hook.is_active(*key):
        return
    src._run_ids(key, <cnp.ndarray>private, y, n, per_unit, d_out, kind)


cdef int _apply_each_row(object hook, object layer_idx, object module, cnp.ndarray x,
                         cnp.ndarray y, Py_ssize_t d_in, Py_ssize_t d_out,
                         Py_ssize_t n) except -1:
    """The generic path: one ``apply`` per row, on views of the caller's arrays."""
    rows_in = (<object>x).reshape(n, d_in).view()
    rows_in.flags.writeable = False
    rows_out = (<object>y).reshape(n, d_out)
    apply = hook.apply
    cdef Py_ssize_t i
    for i in range(n):
        apply(layer_idx, module, rows_in[i], rows_out[i])
    return 0


def apply_lora_rows(hook, layer_idx, module, input, output, input_row_width=None,
                    output_row_width=None):
    """Add ``hook``'s LoRA delta to every row of ``output`` in place.

    The server computes ``output = input @ W.T`` for a batch of token rows,
    then calls this: every row gets ``scale * B @ (A @ x)`` of the adapter
    (or adapters) ``hook`` holds for projection ``(layer_idx, module)``.

    Parameters
    ----------
    hook : LoraHook, LoraAdapter or a bound AdapterSet batch
        What to apply.  A :class:`~lorahook.LoraAdapter` or a batch bound by
        :meth:`~lorahook.AdapterSet.bind` runs in the compiled core with the
        GIL released, on the calling thread; any other hook gets one
        :meth:`~lorahook.LoraHook.apply` call per row, in row order (float32
        rows only).
    layer_idx : int
        The layer the projection belongs to.
    module : str
        The projection's name (``"q_proj"``, ``"down_proj"``, ...).
    input : ndarray
        The rows given to the base projection: C-contiguous, flattened 1-D
        (``len == rows * input_row_width``) or 2-D ``(rows, d_in)``; float32,
        float16 or bfloat16 (an ``ml_dtypes.bfloat16`` array: lorahook
        recognises the dtype once the caller has imported ml_dtypes, and
        never imports it itself).
    output : ndarray
        The projection's result, the same layout and dtype as ``input``,
        writable, not overlapping ``input``; updated in place.
    input_row_width, output_row_width : int, optional
        ``d_in`` and ``d_out``.  Needed for 1-D buffers; for 2-D arrays they
        default to ``shape[1]``, and given ones are checked against it.

    Raises
    ------
    TypeError
        For the hook's type, the arrays' types and dtypes, non-integer
        widths, a 1-D buffer without its width, or half-precision rows for a
        generic Python hook.
    ValueError
        For ndim, contiguity, writability, widths, row counts, overlapping
        buffers, a bound hook's row count, or adapter layers whose
        ``(d_in, d_out)`` differ from the call's (checked for zero-row calls
        too).  Nothing is written when a check fails.

    Notes
    -----
    Every check runs before anything is written.  Then
    ``hook.is_active(layer_idx, module)`` is asked once (a registered
    virtual subclass without ``is_active`` counts as active); an inactive
    hook returns at once.  Half-precision rows are widened to float32, the
    delta is added to the widened output, and the sum is rounded once to
    the output dtype (to nearest even).  Results equal a float64 reference
    to float32 accuracy.

    Examples
    --------
    >>> import numpy as np, lorahook
    >>> rng = np.random.default_rng(0)
    >>> layer = lorahook.LoraLayer(rng.standard_normal((4, 16)), rng.standard_normal((8, 4)),
    ...                            scale=0.5)
    >>> adapter = lorahook.LoraAdapter({(0, "q_proj"): layer})
    >>> x = rng.standard_normal((3, 16)).astype(np.float32)
    >>> y = np.zeros((3, 8), np.float32)
    >>> lorahook.apply_lora_rows(adapter, 0, "q_proj", x, y)
    >>> bool(np.allclose(y, 0.5 * x @ layer.a.T @ layer.b.T, rtol=1e-5, atol=1e-5))
    True
    """
    return _apply(hook, layer_idx, module, input, output, input_row_width, output_row_width, -1)


def apply_lora_bits(hook, layer_idx, module, input, output, input_row_width,
                     output_row_width, bfloat16):
    """``apply_lora_rows`` for uint16 arrays holding float16 (or, with ``bfloat16``, bfloat16) bits.

    How lorahook.torch passes half-precision tensors without a copy (torch
    tensors view as uint16; numpy has no bfloat16 of its own).  Arrays of a
    float dtype are taken as they are.
    """
    return _apply(hook, layer_idx, module, input, output, input_row_width, output_row_width,
                  ROWS_BF16 if bfloat16 else ROWS_F16)


cdef object _apply(hook, layer_idx, module, input, output, input_row_width, output_row_width,
                   int bits):
    cdef type t = type(hook)
    cdef KernelSource src = None
    cdef int dispatch = _PER_ROW
    # Subtype tests on the MRO first (isinstance through ABCMeta costs ~0.4
    # us of a ~1 us inactive call); registered virtual subclasses last.
    if PyType_IsSubtype(t, KernelSource):
        src = <KernelSource>hook
        dispatch = src._dispatch
    elif _hook_base is None or not (PyType_IsSubtype(t, <type>_hook_base)
                                    or isinstance(hook, _hook_base)):
        raise TypeError(f"hook must be a lorahook.LoraHook, got {type(hook).__name__}")
    cdef Py_ssize_t widths[2]
    cdef int kind = ROWS_F32
    cdef Py_ssize_t n = check_call(input, output, input_row_width, output_row_width, widths,
                                   &kind, bits,
                                   type(hook).__name__ if dispatch == _PER_ROW else None)
    cdef Py_ssize_t per_unit = 0
    if src is not None:
        per_unit = src._rows_per_unit(n)
    cdef tuple key = _checked_key(layer_idx, module)
    if dispatch != _KERNELS:
        is_active = getattr(hook, "is_active", None)
        if is_active is not None and not is_active(*key):
            return
    if dispatch == _PER_ROW:
        if src is not None:
            src._check_widths(key, widths[0], widths[1])
        if n:
            _apply_each_row(hook, key[0], key[1], <cnp.ndarray>input, <cnp.ndarray>output,
                            widths[0], widths[1], n)
        return
    src._run(key, <cnp.ndarray>input, <cnp.ndarray>output, n, per_unit, widths[0], widths[1],
             kind)
