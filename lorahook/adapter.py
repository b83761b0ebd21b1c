"""Native adapters: :class:`LoraAdapter` (its parts are in :mod:`lorahook.layer`, :func:`~lorahook.blend` in :mod:`lorahook.blend`).

An adapter is immutable data validated once at construction, so that
applying it never re-checks its insides: :func:`lorahook.apply_lora_rows`
only checks that the covering layer's ``(d_in, d_out)`` equals the call's
row widths, then runs the compiled kernel with the GIL released.
"""
from collections.abc import Mapping
from typing import NamedTuple
from types import MappingProxyType

import numpy as np

from ._core.checks import check_rows
from ._core.plans import apply_layer
from ._core.sources import DISPATCH_ASK_HOOK, DISPATCH_KERNELS, DISPATCH_PER_ROW, KernelTable
from .threads import look_ahead
from ._values import is_int, key_order
from .errors import LoraFormatError, LoraValidationError
from .files import read_peft, read_safetensors_adapter, write_peft
from .hook import LoraHook
from .models import EMBEDDING_MODULES, BertConfig, ModelGeometry
from ._values import finite_scale, weight_dtype
from .layer import LoraLayer, SavedModule, arrays_of, checked_layer, kernel_of
# what layers pickled by lorahook 0.1.0 name to rebuild themselves: a name pickles keep,
# the one private name this module takes from another
from .layer import _layer_from_pickle  # noqa: F401
from .merge import merge_layers, refuse_variants

__all__ = ["LoraLayer", "LoraAdapter", "SavedModule", "key_order"]


def _check_layer_key(key):
    if type(key) is tuple and len(key) == 2 and (type(key[0]) is int and key[0] >= 0
                                                 or key[0] is None) \
            and type(key[1]) is str and key[1]:  # the common case
        return key
    if not (isinstance(key, tuple) and len(key) == 2):
        raise TypeError(f"adapter keys must be (layer_idx, module) tuples, got {key!r}")
    layer_idx, module = key
    if layer_idx is None:  # a model-level module
        if not isinstance(module, str) or not module:
            raise TypeError(f"module in key {key!r} must be a non-empty str")
        return (None, str(module))
    if not is_int(layer_idx):
        raise TypeError(f"layer_idx in key {key!r} must be an int, got {type(layer_idx).__name__}")
    if layer_idx < 0:
        raise ValueError(f"layer_idx in key {key!r} must be >= 0")
    if not isinstance(module, str) or not module:
        raise TypeError(f"module in key {key!r} must be a non-empty str")
    return (int(layer_idx), module)


def _str_mapping(value, name):
    if value is None:
        return {}
    out = {}
    for k, v in dict(value).items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"{name} must map str to str, got {k!r}: {v!r}")
        out[k] = v
    return out


class LoraAdapter(KernelTable, LoraHook):
    """An immutable set of LoRA layers keyed by ``(layer_idx, module)``.

    A :class:`~lorahook.LoraHook` that runs in the compiled core: it is a
    kernel table of the core (``lorahook.KernelTable``), so for a
    projection it covers, :func:`~lorahook.apply_lora_rows` adds
    ``scale * B @ (A @ x)`` (+ ``scale * bias``) to every row with the GIL
    released; for any other projection it is inactive.  Safe to share between
    threads, and picklable (arrays stay read-only after unpickling, with any
    protocol).

    Subclasses may override :meth:`is_active` (asked first, then the kernels
    run) or :meth:`apply` (then every row goes through ``apply``, the generic
    path).

    ``module_paths`` optionally records each key's module path in the base
    model (``model.layers.3.self_attn.q_proj``), so that
    :meth:`save_peft` writes an adapter back where it came from.

    Keys are ``(layer_idx, module)`` with ``layer_idx`` an int ``>= 0`` or
    ``None`` for a model-level module (``lm_head``, ``embed_tokens``,
    ``word_embeddings``, a classification head ``score`` / ``classifier``).
    ``saved_modules`` maps keys to :class:`SavedModule` (PEFT's
    ``modules_to_save``): whole modules that replace the base output for
    this adapter's rows; a key is a LoRA layer or a saved module, not both.
    Layers may be DoRA (``magnitude``; see :meth:`with_base`) or embedding
    LoRA (:func:`lorahook.apply_lora_embedding`).

    Parameters
    ----------
    layers : mapping of (int or None, str) to LoraLayer
        The adapter's layers, by ``(layer_idx, module)``.
    name : str, optional
        A name for messages and ``repr``.
    metadata : mapping of str to str, optional
        Free-form metadata (what a safetensors header carries).
    module_paths : mapping of key to str, optional
        Each key's module path in the base model, for :meth:`save_peft`.
    saved_modules : mapping of key to SavedModule, optional
        Whole modules the adapter replaces (PEFT's ``modules_to_save``).

    Raises
    ------
    TypeError
        For a key or value of the wrong type, naming the key.
    ValueError
        For a malformed or duplicate key, or a key that is both a layer and a
        saved module.

    See Also
    --------
    from_peft : load a PEFT adapter directory.
    AdapterSet : many adapters in one batch.

    Examples
    --------
    >>> import numpy as np, lorahook
    >>> layer = lorahook.LoraLayer(np.ones((2, 8)), np.ones((8, 2)))
    >>> adapter = lorahook.LoraAdapter({(0, "q_proj"): layer, (1, "q_proj"): layer},
    ...                                name="support")
    >>> adapter.num_adapted_layers
    2
    >>> model = lorahook.LlamaConfig(hidden_size=8, num_hidden_layers=2,
    ...                              num_attention_heads=2, intermediate_size=16)
    >>> adapter.validate_against(model)
    >>> adapter.validate_against(lorahook.LlamaConfig(hidden_size=16, num_hidden_layers=2,
    ...                                               num_attention_heads=2, intermediate_size=32))
    Traceback (most recent call last):
    ...
    lorahook.errors.LoraValidationError: adapter layer 0 module 'q_proj' has (d_in, d_out) = (8, 8), but the model's projection is (d_in, d_out) = (16, 16)
    """

    __slots__ = ("_layers", "_name", "_metadata", "_module_paths", "_view", "_saved",
                 "_saved_view")

    # How apply_lora_rows runs this class (lorahook._rows): the kernels alone,
    # the class's own is_active first, or its own apply once per row.
    _core_dispatch = DISPATCH_KERNELS

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.apply is not LoraAdapter.apply:
            cls._core_dispatch = DISPATCH_PER_ROW
        elif cls.is_active is not LoraAdapter.is_active:
            cls._core_dispatch = DISPATCH_ASK_HOOK
        else:
            cls._core_dispatch = DISPATCH_KERNELS

    def __init__(self, layers, name=None, metadata=None, *, module_paths=None,
                 saved_modules=None):
        checked = {}
        for key, layer in dict(layers).items():
            key = _check_layer_key(key)
            if not isinstance(layer, LoraLayer):
                raise TypeError(f"layer for key {key!r} must be a LoraLayer, got {type(layer).__name__}")
            if key in checked:
                raise ValueError(f"duplicate key {key!r}")
            checked[key] = layer
        saved = {}
        for key, module in dict(saved_modules or {}).items():
            key = _check_layer_key(key)
            if not isinstance(module, SavedModule):
                raise TypeError(f"saved module for key {key!r} must be a SavedModule, got "
                                f"{type(module).__name__}")
            if key in checked or key in saved:
                raise ValueError(f"key {key!r} is both a LoRA layer and a saved module"
                                 if key in checked else f"duplicate key {key!r}")
            saved[key] = module
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name must be a str or None, got {type(name).__name__}")
        paths = {}
        for key, path in dict(module_paths or {}).items():
            key = _check_layer_key(key)
            if key not in checked and key not in saved:
                raise ValueError(f"module_paths names key {key!r} that the adapter does not hold")
            if not isinstance(path, str):
                raise TypeError(f"module path for {key!r} must be a str, got {type(path).__name__}")
            paths[key] = path
        look_ahead()  # the one-time BLAS look, at start-up (lorahook.threads)
        # the core's kernel table first (the keys is_active is true for, rank > 0):
        # it refuses a second fill, before this adapter's state is touched
        table = {key: kernel_of(layer) for key, layer in checked.items() if layer.rank > 0}
        table.update((key, kernel_of(module)) for key, module in saved.items())
        self._set_table(table, type(self)._core_dispatch)
        object.__setattr__(self, "_layers", checked)
        object.__setattr__(self, "_view", MappingProxyType(checked))
        object.__setattr__(self, "_saved", saved)
        object.__setattr__(self, "_saved_view", MappingProxyType(saved))
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_metadata", _str_mapping(metadata, "metadata"))
        object.__setattr__(self, "_module_paths", MappingProxyType(paths))

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __reduce__(self):
        return (_rebuild_adapter, (type(self), dict(self._layers), self._name,
                                   dict(self._metadata), dict(self._module_paths),
                                   dict(self._saved)))

    # --- the hook contract -------------------------------------------------
    # is_active comes from the core: true exactly for the keys held with rank > 0.

    def apply(self, layer_idx, module, x, output):
        """Add the delta for one row: ``x`` has ``d_in`` values, ``output`` ``d_out``."""
        layer = self._layers.get((layer_idx, module)) or self._saved.get((layer_idx, module))
        if layer is None or (layer.rank == 0 and not isinstance(layer, SavedModule)):
            return
        if layer.is_embedding:
            raise ValueError(f"layer ({layer_idx}, {module!r}) is an embedding: use "
                             f"lorahook.apply_lora_embedding")
        if getattr(layer, "is_dora", False) and not layer.has_base:
            raise ValueError(f"adapter layer ({layer_idx}, {module!r}) is a DoRA layer without "
                             f"its base weight: give it with adapter.with_base(weights)")
        n = check_rows(x, output, layer.d_in, layer.d_out)
        if n != 1:
            raise ValueError(
                f"apply takes one row: x must have {layer.d_in} values and output "
                f"{layer.d_out} for layer ({layer_idx}, {module!r}), got {n} rows "
                f"(use apply_lora_rows for batches)")
        apply_layer(kernel_of(layer), x, output, 1)

    # --- read-only properties ---------------------------------------------

    layers = property(lambda self: self._view, doc="Read-only mapping (layer_idx, module) -> LoraLayer.")
    name = property(lambda self: self._name)
    metadata = property(lambda self: dict(self._metadata), doc="A copy of the str -> str metadata.")
    module_paths = property(lambda self: self._module_paths,
                            doc="Read-only mapping key -> module path in the base model (may be empty).")

    saved_modules = property(lambda self: self._saved_view,
                             doc="Read-only mapping key -> SavedModule (PEFT's modules_to_save).")

    def has_adapter(self, layer_idx, module):
        """Whether the adapter holds a layer or a saved module for ``(layer_idx, module)``."""
        return (layer_idx, module) in self._layers or (layer_idx, module) in self._saved

    @property
    def has_dora(self):
        """Whether some layer is a DoRA layer."""
        return any(layer.is_dora for layer in self._layers.values())

    @property
    def needs_base(self):
        """The sorted keys of DoRA layers that have no base weight yet (:meth:`with_base`)."""
        return sorted((k for k, l in self._layers.items() if l.is_dora and not l.has_base),
                      key=key_order)

    @property
    def _row_exact(self):
        """True when a bind may only give this adapter's rows scale 0 or 1 (DoRA, saved modules)."""
        return bool(self._saved) or self.has_dora

    def with_base(self, weights):
        """This adapter with every DoRA layer given its base weight (:meth:`LoraLayer.with_base`).

        ``weights`` is a mapping ``(layer_idx, module) -> W`` or ``-> (W, b)``
        (``W`` the base weight ``(d_out, d_in)``, ``b`` its bias or ``None``),
        or a callable of ``(layer_idx, module)`` returning the same.  Only DoRA
        layers ask for theirs (already-based ones are recomputed); a key with
        no weight (missing, or ``None`` from the callable) is a ``KeyError``
        naming it, a wrong shape a ``ValueError``.  Nothing changes on
        failure; ``self`` when the adapter has no DoRA layer.
        """
        lookup = base_lookup(weights)
        dora = sorted((k for k, l in self._layers.items() if l.is_dora), key=key_order)
        if not dora:
            return self
        layers = dict(self._layers)
        for key in dora:
            found = lookup(key)
            if found is None:
                raise KeyError(f"no base weight for DoRA layer {key!r}")
            weight, bias = found if isinstance(found, tuple) else (found, None)
            try:
                layers[key] = layers[key].with_base(weight, bias)
            except (ValueError, TypeError) as exc:
                raise type(exc)(f"DoRA layer {key!r}: {exc}") from None
        return self._derived(layers)

    @property
    def num_adapted_layers(self):
        """The number of ``(layer_idx, module)`` keys."""
        return len(self._layers)

    @property
    def num_parameters(self):
        return sum(part.num_parameters for part in self._parts().values())

    def _parts(self):
        """Every key's layer or saved module."""
        return {**self._layers, **self._saved}

    def _all_arrays(self):
        """Every array the adapter keeps (layers, DoRA terms, saved modules)."""
        for layer in self._layers.values():
            yield from arrays_of(layer)
        for module in self._saved.values():
            yield from arrays_of(module)

    @property
    def nbytes(self):
        """Bytes of every array the adapter keeps, each array counted once (an ``int``):
        LoRA factors, biases, DoRA's magnitude and base terms, saved modules."""
        seen = {id(arr): arr.nbytes for arr in self._all_arrays()}
        return int(sum(seen.values()))

    def keys(self):
        """The keys of the layers in order: layers ascending, model-level (``None``) last."""
        return sorted(self._layers, key=key_order)

    def validate_modules(self, known):
        """The sorted keys (layers and saved modules) whose module is not in ``known``."""
        known = set(known)
        return [key for key in sorted(self._parts(), key=key_order) if key[1] not in known]

    @property
    def dtype(self):
        """The dtype of the adapter's ``a`` and ``b`` arrays (float32 for an empty adapter)."""
        dtypes = {layer.dtype for layer in self._layers.values()}
        if len(dtypes) > 1:
            raise TypeError(f"the adapter's layers have several dtypes: {sorted(map(str, dtypes))}")
        return dtypes.pop() if dtypes else np.dtype(np.float32)

    def astype(self, dtype):
        """The same adapter with ``a`` and ``b`` kept in ``dtype``: float32, float16, bfloat16 or int8.

        16-bit: each value is rounded once, to nearest even (biases too);
        :attr:`nbytes` halves.  ``bfloat16`` is ``ml_dtypes.bfloat16`` (import
        ml_dtypes; lorahook never imports it).  Calls compute in float32 from
        the rounded values, widened per call.

        int8: each layer keeps ``a`` with a float32 scale per row and ``b``
        with one per output (symmetric, round to nearest:
        :meth:`LoraLayer.astype`); biases stay float32; :attr:`nbytes` is about
        a quarter of float32's.  Calls read the int8 values in place and
        accumulate in float32.

        :meth:`delta_weight`, :func:`blend` and :meth:`merge_into` work in
        float32; :meth:`save_peft` writes ``dtype`` (an int8 adapter writes its
        dequantized float32 values, which PEFT loads).  ``self`` when every
        layer is already in ``dtype``.
        """
        dt = weight_dtype(dtype)
        layers = {k: layer.astype(dt) for k, layer in self._layers.items()}
        if all(layers[k] is layer for k, layer in self._layers.items()):
            return self  # every layer already in dtype (adapters are immutable)
        return self._derived(layers)

    def scaled(self, factor):
        """The same arrays with every scale multiplied by ``factor``.

        An adapter with DoRA layers that have their base terms, or with saved
        modules, is not linear in its scale: ``ValueError`` for a factor other
        than 1 (scale a DoRA adapter before :meth:`with_base`).
        """
        factor = finite_scale(factor, "factor")
        if factor != 1.0 and self._saved:
            raise ValueError("an adapter with saved modules (modules_to_save) replaces their "
                             "output: it cannot be scaled")
        layers = {k: l.with_scale(l.scale * factor) for k, l in self._layers.items()}
        return self._derived(layers)

    def _derived(self, layers, name=None):
        return LoraAdapter(layers, name=self._name if name is None else name,
                           metadata=self._metadata, saved_modules=self._saved,
                           module_paths={k: p for k, p in self._module_paths.items()
                                         if k in layers or k in self._saved})

    # --- geometry -----------------------------------------------------------

    def validate_against(self, config):
        """Check every key against a model's projection table.

        Parameters
        ----------
        config : ModelGeometry
            The model: ``Qwen35Config``, ``BertConfig``, ``LlamaConfig``,
            ``Phi3Config``, ... what :func:`~lorahook.load_model_config` or
            ``lorahook.torch.geometry_of`` returns.

        Returns
        -------
        None
            When every layer fits.

        Raises
        ------
        TypeError
            When ``config`` is not a :class:`~lorahook.ModelGeometry`.
        LoraValidationError
            At the first misfit, keys in sorted order, naming the layer, the
            module, the adapter's ``(d_in, d_out)`` and the model's.  Ranks
            above ``min(d_in, d_out)`` are valid.
        """
        if not isinstance(config, ModelGeometry):
            raise TypeError(
                f"config must be a lorahook.ModelGeometry (Qwen35Config, BertConfig, LlamaConfig, "
                f"... or lorahook.load_model_config(path)), got {type(config).__name__}")
        parts = self._parts()
        for (layer_idx, module) in sorted(parts, key=key_order):
            layer = parts[(layer_idx, module)]
            ours = (layer.d_in, layer.d_out)
            if layer_idx is not None and (layer.is_embedding or isinstance(layer, SavedModule)):
                what = "an embedding" if layer.is_embedding else "a saved module"
                raise LoraValidationError(
                    f"adapter layer {layer_idx} module {module!r} is {what}: only model-level "
                    f"modules (layer_idx None) can be")
            if layer_idx is None and layer.is_embedding != (module in EMBEDDING_MODULES):
                raise LoraValidationError(
                    f"adapter module {module!r} (layer_idx None) is "
                    f"{'an embedding' if layer.is_embedding else 'a linear'} layer, but the "
                    f"model's {module!r} is {'an embedding' if module in EMBEDDING_MODULES else 'a linear'}")
            try:
                theirs = tuple(config.projection_shape(layer_idx, module))
            except LoraValidationError as exc:
                raise LoraValidationError(
                    f"adapter layer {layer_idx} module {module!r} with (d_in, d_out) = {ours} "
                    f"does not fit the model: {exc}") from None
            if ours != theirs:
                raise LoraValidationError(
                    f"adapter layer {layer_idx} module {module!r} has (d_in, d_out) = {ours}, "
                    f"but the model's projection is (d_in, d_out) = {theirs}")
        return None

    def validate_against_bert(self, num_hidden_layers, hidden_size, intermediate_size):
        """:meth:`validate_against` for a BERT encoder of these dimensions."""
        return self.validate_against(BertConfig(num_hidden_layers, hidden_size, intermediate_size))

    # --- files --------------------------------------------------------------

    @classmethod
    def _from_data(cls, data):
        """The adapter for what a file reader returned (``lorahook.files.AdapterData``)."""
        layers, saved = {}, {}
        for key, item in data.layers.items():
            try:
                # Checked by the reader as a layer checks its arrays (lorahook.files.LayerData):
                # kept as they are; the kernel checks the shapes once more.
                layers[key] = checked_layer(item.a, item.b.T, item.scale, item.bias,
                                                   item.embedding, item.magnitude)
            except (ValueError, TypeError, OverflowError) as exc:
                raise LoraFormatError(f"{data.source}: module {item.path!r}: {exc}") from None
        for key, item in data.saved.items():
            try:
                saved[key] = SavedModule(item.weight, item.bias, embedding=item.embedding)
            except (ValueError, TypeError, OverflowError) as exc:
                raise LoraFormatError(f"{data.source}: saved module {item.path!r}: {exc}") from None
        return cls(layers, name=data.name, metadata=data.metadata, module_paths=data.module_paths,
                   saved_modules=saved)

    @classmethod
    def from_peft(cls, path, dtype=None):
        """Load a PEFT adapter directory (``adapter_config.json`` + safetensors).

        Parameters
        ----------
        path : str or os.PathLike
            The directory ``save_pretrained`` wrote.
        dtype : {None, "float32", "float16", "bfloat16", "int8"}, optional
            The arrays' dtype (``None``: float32), as :meth:`astype`.

        Returns
        -------
        LoraAdapter
            The adapter, with the module path of each key; module paths of
            every family lorahook knows are placed (``lorahook.models``).

        Raises
        ------
        LoraFormatError
            For a file that is not a PEFT adapter lorahook reads (a missing
            or malformed config or tensor, a size the file does not hold, an
            unknown module path), naming the file and what was wrong.  No
            array is allocated from a size the file claims before the file is
            checked to hold it.
        """
        dt = None if dtype is None else weight_dtype(dtype)
        adapter = cls._from_data(read_peft(path))
        return adapter if dt is None else adapter.astype(dt)

    @classmethod
    def from_safetensors(cls, path, alpha=None):
        """Load a bare PEFT-layout safetensors file (``alpha``: argument, header, else rank)."""
        return cls._from_data(read_safetensors_adapter(path, alpha=alpha))

    def save_peft(self, path, architecture=None, metadata=None):
        """Write a PEFT adapter directory that ``peft.PeftModel.from_pretrained`` loads.

        Parameters
        ----------
        path : str or os.PathLike
            The directory to write (created if missing).
        architecture : str, optional
            The base model's layout (``"llama"``, ``"phi3"``, ``"qwen3_5"``,
            ``"bert"``, ...); without it the module paths the adapter was
            loaded with are written.
        metadata : mapping of str to str, optional
            Written into the safetensors header.

        Returns
        -------
        str
            The directory's path.
        """
        return write_peft(self, path, architecture=architecture, metadata=metadata)

    # --- merging --------------------------------------------------------------

    def delta_weight(self, layer_idx, module):
        """``scale * B @ A`` for one key, a float32 ``(d_out, d_in)`` array."""
        try:
            layer = self._layers[(layer_idx, module)]
        except KeyError:
            raise KeyError(f"the adapter holds no layer for ({layer_idx}, {module!r})") from None
        return layer.delta_weight()

    def merge_into(self, weights, biases=None):
        """Add every key's delta into ``weights[key]`` (float32 ``(d_out, d_in)``) in place.

        All or nothing: every key, type, shape and writability is checked, and
        targets that share memory (the same array under two keys, or views of
        one another) are refused, before the first weight is touched.  The
        arrays are updated in place and never assigned through the mappings,
        so a mapping that refuses assignment works and sees its own arrays
        change.
        """
        refuse_variants(self._parts(), "merge_into / unmerge_from")
        merge_layers(self._layers, weights, biases, +1)

    def unmerge_from(self, weights, biases=None):
        """Subtract what :meth:`merge_into` added."""
        refuse_variants(self._parts(), "merge_into / unmerge_from")
        merge_layers(self._layers, weights, biases, -1)

    def __repr__(self):
        name = f"{self._name!r}, " if self._name else ""
        return f"LoraAdapter({name}{len(self._layers)} layers, {self.num_parameters} parameters)"


def _rebuild_adapter(cls, layers, name, metadata, module_paths, saved_modules=None):
    obj = cls.__new__(cls)
    LoraAdapter.__init__(obj, layers, name=name, metadata=metadata, module_paths=module_paths,
                         saved_modules=saved_modules)
    return obj


def base_lookup(weights):
    """``key -> W | (W, b) | None`` from a mapping or a callable of ``(layer_idx, module)``."""
    if callable(weights) and not isinstance(weights, Mapping):
        return lambda key: weights(*key)
    if not isinstance(weights, Mapping):
        raise TypeError(f"base weights must be a mapping (layer_idx, module) -> W or (W, b), or a "
                        f"callable of (layer_idx, module), got {type(weights).__name__}")
    return lambda key: weights.get(key)


# What the rest of the package reads of an adapter (the adapter store, the
# resolver), offered here rather than read from its private state.

class StoreEntry(NamedTuple):
    """An adapter as an adapter store keeps it, with what binding needs, computed once."""

    adapter: "LoraAdapter"
    #: ``id -> nbytes`` of every array the adapter keeps, for the store's byte count
    arrays: dict
    #: the distinct scales of the kernels that apply something (float32 values, as the
    #: core keys them): a batch's per-row scales are multiplied by each once, at bind time
    layer_scales: tuple
    #: DoRA layers and saved modules are not linear in the scale: rows take 0 or 1
    exact: bool


def store_entry(adapter):
    """The :class:`StoreEntry` of ``adapter``."""
    scales = {kernel_of(layer).scale for layer in adapter._layers.values() if layer.rank > 0}
    scales.update(kernel_of(module).scale for module in adapter._saved.values())
    return StoreEntry(adapter, {id(arr): arr.nbytes for arr in adapter._all_arrays()},
                      tuple(sorted(scales)), adapter._row_exact)


def kernel_dispatch(adapter):
    """How the core runs ``adapter``'s kernels: a ``DISPATCH_*`` value of ``lorahook._core.sources``."""
    return type(adapter)._core_dispatch
