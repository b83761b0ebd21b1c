"""Attach a lorahook hook to a PyTorch model on the CPU (optional; needs ``torch``).

::

    import torch, lorahook
    from lorahook.torch import attach

    adapter = lorahook.LoraAdapter.from_peft("my-adapter")
    with torch.inference_mode(), attach(model, adapter):
        out = model(**inputs)

:func:`attach` registers a forward hook on every ``nn.Linear`` of the model
whose path maps to a lorahook ``(layer_idx, module)`` key:

* Qwen3.5: ``model[.language_model].layers.N.{self_attn,linear_attn,mlp}.X``
  -> ``(N, "X")`` (``Qwen3_5ForCausalLM`` and the multimodal model alike);
* Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 2, Gemma 3:
  ``model.layers.N.{self_attn,mlp}.X`` (Gemma 3 multimodal:
  ``model.language_model.layers.N...``);
* Phi-3: ``model.layers.N.self_attn.{qkv_proj,o_proj}``,
  ``model.layers.N.mlp.{gate_up_proj,down_proj}``;
* BERT: ``[bert.]encoder.layer.N.attention.self.{query,key,value}``,
  ``attention.output.dense`` -> ``attn_output``, ``intermediate.dense`` ->
  ``ffn_intermediate``, ``output.dense`` -> ``ffn_output``.

These are the same path rules ``LoraAdapter.from_peft`` reads (``lorahook.models``).
:func:`geometry_of` measures a model's mapped linears as a ``ModelGeometry``.

After the module computes ``y = W x + b``, the hook views the input and the
output as numpy arrays (``Tensor.numpy()``: the same memory, no copy) and
calls :func:`lorahook.apply_lora_rows`, which adds the LoRA delta to ``y`` in
place.  Every token is one row: an input of shape ``(batch, seq, d_in)`` is
``batch * seq`` rows in row-major order.

A bound batch from :meth:`lorahook.AdapterSet.bind` works too; it must be
bound for exactly ``batch * seq`` rows, one entry per token (repeat a
sequence's adapter name ``seq`` times -- :func:`token_rows` does that).

Per-sequence adapters through a whole ``generate``
--------------------------------------------------
``attach(model, adapter_set)`` with an :class:`lorahook.AdapterSet` hooks
every mapped linear and applies nothing until a selection is made::

    attached = attach(model, adapters)          # once, at start-up
    with torch.inference_mode(), attached.sequences(["support", None, "legal"]):
        out = model.generate(**batch)           # prefill and every decode step

Inside the block, a linear whose input is ``(B, L, d_in)`` applies the
selection with ``B`` a multiple of ``S = len(seq_adapters)``: batch entry
``b`` belongs to sequence ``b // (B // S)`` (the ``repeat_interleave``
layout, so beam search and ``num_return_sequences`` work as in PEFT's
``adapter_names``); a 2-D ``(N, d_in)`` input follows
:meth:`lorahook.AdapterSet.bind_sequences`.  The selection is bound once, at
block entry (a snapshot: a hot swap during ``generate`` does not tear it), and
checked against the model's hooked linears there (unknown names:
``KeyError``; a misfit: :class:`lorahook.LoraValidationError`).  Outside any
block the model is the base model, and a linear no selected adapter covers
costs one dictionary lookup.

The selection belongs to the current context (:mod:`contextvars`): two
threads generating on one model with different selections each get their
own.  A thread started inside a block does not inherit it; enter the same
selection object again in that thread, or run the thread's target in a copy
of the context::

    with attached.sequences(names) as selection:
        ctx = contextvars.copy_context()        # carries the selection
        Thread(target=ctx.run, args=(model.generate,), kwargs=batch).start()
        # or: Thread(target=lambda: selection.run(model.generate, **batch))

Blocks nest: the inner selection wins and the outer one is back on exit.

Precision: float32, bfloat16 and float16 models.  Half-precision tensors
reach the core as 16-bit patterns (``Tensor.view(torch.uint16)``: the same
memory, no copy, no ``model.float()``); the core widens each row to float32,
adds the delta computed in float32 and rounds the sum once to the model's
dtype (PEFT computes the LoRA branch in the model's dtype and rounds twice).

Quantized bases
---------------
The delta is computed from a linear's input and added to its output, so how
the base stores its weight does not matter, only the dtype of its output.
Besides a float ``nn.Linear``, these are hooked and measured, recognised by
their class (its module path and name) without importing their library:

* ``nn.Linear`` whose weight is a torchao tensor subclass (``quantize_`` with
  int8 weight-only, int8 dynamic activation + int8 weight, or int4
  weight-only; on the CPU the int4 one is torchao's
  ``PrototypeInt4WeightOnlyConfig``);
* bitsandbytes ``Linear8bitLt`` and ``Linear4bit`` (its CPU backend:
  ``from_pretrained(..., quantization_config=BitsAndBytesConfig(...),
  device_map="cpu")``);
* optimum-quanto ``QLinear`` (``quantize(model, weights=qint8 or qint4)``,
  then ``freeze``);
* ``torch.ao.nn.quantized.dynamic.Linear`` (``quantize_dynamic``).

``(d_in, d_out)`` are the module's ``in_features`` / ``out_features``; rows
take the dtype of the module's output (float32, bfloat16 or float16; any
other is a ``TypeError`` naming the module), and an input of another float
dtype is converted to it first.  A module an adapter names that is none of
these is a :class:`lorahook.LoraValidationError` naming its path and class.

Not supported (refused with a clear error rather than silently wrong):

* float64 (or other) weights of a float ``nn.Linear``, and outputs of any
  other dtype than float32, bfloat16 and float16;
* other linear classes (GPTQ, AWQ, HQQ, custom subclasses of ``nn.Linear``):
  refused by name when an adapter names them;
* models that already carry PEFT LoRA layers (apply one or the other);
* tensors on a device other than the CPU;
* autograd: the delta is written through numpy, which autograd does not see.
  Use the hooks for inference only (``torch.inference_mode()`` or
  ``torch.no_grad()``); the hook refuses to run when gradients are being
  recorded for the output.
"""
import contextvars
import threading

from .._rows import apply_lora_bits, apply_lora_embedding_bits
from ..hook import LoraHook, apply_lora_embedding, apply_lora_rows
from .._values import key_order
from ..models import MeasuredGeometry, place
from .modules import SUPPORTED_LINEARS, base_weights, hookable_modules, linear_kind, shape_of

__all__ = ["attach", "default_mapping", "geometry_of", "token_rows", "AttachedHooks", "Selection"]

# The selections in force in the current context, replaced as a whole (never
# mutated) on every block entry and reset with its token on exit: a pair
# ({attach key: bound hook}, entries), where entries are the open blocks,
# innermost last, each [selection, token of its entry].  One variable for the
# module: entering blocks adds nothing else to a context.
_SELECTIONS = contextvars.ContextVar("lorahook_torch_selections", default=None)

def _check_fits(adapter, what, shapes, unsupported):
    """Every layer and saved module of ``adapter`` has a hooked linear of its own shape.

    ``shapes``: layer key -> the hooked linear's ``(in_features, out_features)``.
    """
    from ..errors import LoraValidationError
    parts = {**adapter.layers, **adapter.saved_modules}
    for key in sorted(parts, key=key_order):
        layer = parts[key]
        if key not in shapes:
            _refuse_unhooked(what, key, unsupported)
        if (layer.d_in, layer.d_out) != shapes[key]:
            raise LoraValidationError(
                f"{what} layer {key[0]} module {key[1]!r} has (d_in, d_out) = "
                f"{(layer.d_in, layer.d_out)}, but the model's linear is "
                f"(in_features, out_features) = {shapes[key]}")


def _refuse_unhooked(who, key, unsupported):
    """The ``LoraValidationError`` for an adapter layer whose key no hooked linear has."""
    from ..errors import LoraValidationError
    if key in unsupported:
        path, cls = unsupported[key]
        raise LoraValidationError(
            f"{who} layer {key[0]} module {key[1]!r} names {path}, a {cls}, which lorahook does "
            f"not hook; supported: {SUPPORTED_LINEARS}")
    raise LoraValidationError(f"{who} layer {key[0]} module {key[1]!r} matches no hooked linear "
                              f"in the model")


def default_mapping(path):
    """``(layer_idx, module)`` for a module path of a model lorahook knows, else ``None``.

    The same path rules as ``LoraAdapter.from_peft`` (``lorahook.models``): the Qwen3.5,
    Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 2, Gemma 3, Phi-3 and BERT layouts, from the
    model's root (attach to the transformers model itself, or pass ``mapping=``).
    """
    return place(path)


def geometry_of(model, *, mapping=None):
    """A :class:`lorahook.ModelGeometry` read from a torch model's mapped linear layers.

    ``mapping`` is as in :func:`attach` (``None``: :func:`default_mapping`). Every mapped
    linear lorahook hooks (float or quantized, see the module docstring) gives
    ``(layer_idx, module) -> (in_features, out_features)``; for models lorahook has no
    config class for, pass a ``mapping``.
    ``ValueError`` when two linears map to the same key; ``LoraValidationError`` when
    nothing maps.
    """
    from torch import nn

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    found, _ = hookable_modules(model, _resolve_mapping(mapping))
    shapes = {path_key: shape_of(model.get_submodule(path)) for path, path_key in found.items()}
    return MeasuredGeometry(shapes, name=f"the linear layers of {type(model).__name__}")


def token_rows(per_sequence, seq_len):
    """Repeat each sequence's adapter name (or ``None``) ``seq_len`` times, for ``bind``."""
    return [name for name in per_sequence for _ in range(seq_len)]


class AttachedHooks:
    """What :func:`attach` returns: ``remove()`` detaches every hook (also on ``with`` exit).

    When attached with an :class:`lorahook.AdapterSet`, :meth:`sequences`
    makes the per-sequence selections.
    """

    def __init__(self, handles, modules, adapter_set=None, shapes=None, key=None,
                 unsupported=None):
        self._handles = handles
        self._unsupported = unsupported or {}
        #: ``{module path: (layer_idx, module)}`` of the hooked ``nn.Linear`` modules.
        self.modules = modules
        self._adapter_set = adapter_set
        self._shapes = shapes or {}
        self._key = key

    def sequences(self, seq_adapters, scales=None):
        """A :class:`Selection`: per sequence an adapter name of the set or ``None``.

        Use it as a context manager around the forwards or ``generate`` it
        applies to; ``scales`` is as in :meth:`lorahook.AdapterSet.bind`, per
        sequence.
        """
        if self._adapter_set is None:
            raise TypeError("sequences() needs a model attached with a lorahook.AdapterSet "
                            "(attach(model, adapter_set)); this one was attached with one hook")
        return Selection(self, seq_adapters, scales)

    def _bind(self, seq_adapters, scales):
        """Bind a selection and check every adapter it applies against the hooked linears."""
        hook = self._adapter_set.bind_sequences(seq_adapters, scales)
        for name in sorted(hook.adapters):
            _check_fits(hook.adapters[name], f"adapter {name!r}", self._shapes,
                        self._unsupported)
        return hook

    def remove(self):
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()

    def __len__(self):
        return len(self.modules)

    def __repr__(self):
        return f"AttachedHooks({len(self.modules)} linear modules)"


class Selection:
    """Per-sequence adapters for the forwards run inside ``with selection:``.

    Made by :meth:`AttachedHooks.sequences`.  The first entry binds the
    selection (:meth:`lorahook.AdapterSet.bind_sequences`) and checks it
    against the model; later entries -- nested, or in other threads and
    contexts -- reuse that snapshot.  Entering sets the selection for the
    current context only; exiting gives back the one in force before.
    :meth:`run` calls a function inside the selection (for a thread's target).
    """

    def __init__(self, attached, seq_adapters, scales=None):
        if isinstance(seq_adapters, (str, bytes)) or not hasattr(seq_adapters, "__len__"):
            raise TypeError(f"seq_adapters must be a sequence of adapter names or None, "
                            f"got {type(seq_adapters).__name__}")
        self._attached = attached
        self._names = tuple(seq_adapters)
        self._scales = scales
        self._hook = None
        self._lock = threading.Lock()

    @property
    def seq_adapters(self):
        """Per sequence, the adapter name or ``None``."""
        return self._names

    @property
    def hook(self):
        """The bound hook (bound on first use)."""
        if self._hook is None:
            with self._lock:
                if self._hook is None:
                    self._hook = self._attached._bind(self._names, self._scales)
        return self._hook

    def __enter__(self):
        hook = self.hook
        current = _SELECTIONS.get()
        chosen, entries = current if current is not None else ({}, ())
        chosen = {**chosen, self._attached._key: hook}
        entry = [self, None]
        entry[1] = _SELECTIONS.set((chosen, entries + (entry,)))
        return self

    def __exit__(self, *exc):
        current = _SELECTIONS.get()
        entries = current[1] if current is not None else ()
        if not any(e[0] is self for e in entries):
            raise RuntimeError("this selection was not entered in the current context")
        if entries[-1][0] is not self:
            raise RuntimeError("selections must be exited in the reverse order of entry: an inner "
                               "selection entered after this one is still in force")
        _SELECTIONS.reset(entries[-1][1])

    def run(self, fn, /, *args, **kwargs):
        """``fn(*args, **kwargs)`` inside this selection (e.g. a thread's target)."""
        with self:
            return fn(*args, **kwargs)

    def __repr__(self):
        return f"Selection({list(self._names)!r})"


def _as_numpy(t, what, path):
    """A numpy view of a CPU tensor: float32 / float16 as they are, bfloat16 as uint16 bits."""
    import torch
    if t.device.type != "cpu":
        raise TypeError(f"lorahook.torch: {path}: the {what} is on {t.device}, expected the CPU")
    if t.dtype == torch.bfloat16:
        return t.detach().view(torch.uint16).numpy()
    if t.dtype not in (torch.float32, torch.float16):
        raise TypeError(f"lorahook.torch: {path}: the {what} is {t.dtype}, expected torch.float32, "
                        f"torch.bfloat16 or torch.float16")
    return t.detach().numpy()


def _resolve_mapping(mapping):
    if mapping is None:
        return default_mapping
    if callable(mapping):
        return mapping
    table = dict(mapping)
    return table.get


def attach(model, hook, *, mapping=None):
    """Register forward hooks that apply ``hook`` to the model's ``nn.Linear`` outputs.

    Parameters
    ----------
    model : torch.nn.Module
        The base model, on the CPU (a transformers model, say).
    hook : LoraHook or AdapterSet
        A :class:`lorahook.LoraAdapter`, a batch bound with
        :meth:`lorahook.AdapterSet.bind`, or an :class:`lorahook.AdapterSet`:
        then every mapped linear is hooked, nothing is applied until a
        selection is made with ``attached.sequences(...)`` (see the module
        docstring), and adapters added to the set later can be selected too.
    mapping : None, callable or dict, optional
        Module path to ``(layer_idx, module)``: ``None`` for the paths of
        every family lorahook knows, a callable ``path -> (layer_idx,
        module) or None``, or a dict.

    Returns
    -------
    AttachedHooks
        Call ``.remove()`` (or use it as a context manager) to detach.

    Raises
    ------
    TypeError
        For a model or hook of the wrong type, or a mapped float ``nn.Linear``
        whose weights are not float32, bfloat16 or float16 on the CPU
        (quantized linears: see the module docstring).
    LoraValidationError
        For a ``LoraAdapter`` key that is not a hooked linear of the model
        with the linear's ``(in_features, out_features)``, naming the module
        (and its class, when lorahook does not hook that class).  Only the
        linears an adapter covers are hooked.
    """
    from torch import nn

    from ..adapter import LoraAdapter
    from ..adapter_set import AdapterSet

    adapter_set = hook if isinstance(hook, AdapterSet) else None
    if adapter_set is None and not isinstance(hook, LoraHook):
        raise TypeError(f"hook must be a lorahook.LoraHook or a lorahook.AdapterSet, "
                        f"got {type(hook).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    resolve = _resolve_mapping(mapping)

    found, unsupported = hookable_modules(model, resolve)
    if isinstance(hook, LoraAdapter):
        shapes = {k: shape_of(model.get_submodule(p)) for p, k in found.items()}
        _check_fits(hook, "adapter", shapes, unsupported)
        found = {p: k for p, k in found.items() if hook.is_active(*k)}
        if hook.needs_base:  # DoRA layers get the model's own weights
            hook = hook.with_base(base_weights(model, found))

    handles = []
    if adapter_set is not None:
        attach_key = object()  # names this attachment in the context's selections
        shapes = {}
        adapter_set.set_base_weights(base_weights(model, found))
        for path, key in found.items():
            mod = model.get_submodule(path)
            shapes[key] = shape_of(mod)
            handles.append(mod.register_forward_hook(_make_selection_hook(
                attach_key, path, key, *shapes[key])))
        return AttachedHooks(handles, dict(found), adapter_set, shapes, attach_key, unsupported)
    for path, key in found.items():
        mod = model.get_submodule(path)
        handles.append(mod.register_forward_hook(_make_hook(hook, path, key, *shape_of(mod))))
    return AttachedHooks(handles, dict(found))


def _run(hook, path, layer_idx, module, x, output, d_in, d_out):
    """Apply ``hook`` to one linear's input and output tensors; returns a replaced output or None."""
    import torch
    if output.requires_grad and torch.is_grad_enabled():
        raise RuntimeError(f"lorahook.torch: {path}: gradients are being recorded; lorahook's "
                           f"hooks are for inference (use torch.inference_mode())")
    if not x.is_contiguous():
        x = x.contiguous()
    replaced = None
    if not output.is_contiguous():
        output = replaced = output.contiguous()
    yout = _as_numpy(output, "output", path).reshape(-1)  # its dtype is the rows' dtype
    if not x.is_floating_point() and not x.is_complex():  # an embedding's token ids
        ids = x.detach().reshape(-1).to(torch.int64).numpy()
        if output.dtype == torch.bfloat16:
            apply_lora_embedding_bits(hook, layer_idx, module, ids, yout, d_out, True)
        else:
            apply_lora_embedding(hook, layer_idx, module, ids, yout, d_out)
        return replaced
    if x.dtype != output.dtype:
        if not x.is_floating_point():
            raise TypeError(f"lorahook.torch: {path}: the input is {x.dtype}, expected a float "
                            f"tensor")
        x = x.to(output.dtype)  # e.g. float32 activations around a bfloat16 compute
    xin = _as_numpy(x, "input", path).reshape(-1)
    if x.dtype == torch.bfloat16:
        apply_lora_bits(hook, layer_idx, module, xin, yout, d_in, d_out, True)
    else:
        apply_lora_rows(hook, layer_idx, module, xin, yout, d_in, d_out)
    return replaced


def _make_hook(hook, path, key, d_in, d_out):
    layer_idx, module = key

    def forward_hook(mod, inputs, output):
        return _run(hook, path, layer_idx, module, inputs[0], output, d_in, d_out)

    return forward_hook


def _make_selection_hook(attach_key, path, key, d_in, d_out):
    layer_idx, module = key

    def forward_hook(mod, inputs, output):
        current = _SELECTIONS.get()
        if current is None:
            return None
        hook = current[0].get(attach_key)
        if hook is None:
            return None
        x = inputs[0]
        s = hook.n_sequences
        if not x.is_floating_point() and x.dim() in (1, 2):  # an embedding's ids: (B, L) or (N,)
            if s == 0 or x.shape[0] % s:
                raise ValueError(
                    f"lorahook.torch: {path}: the selection has {s} sequences, but the ids' "
                    f"batch size {x.shape[0]} is not a multiple of {s} (ids shape "
                    f"{tuple(x.shape)})")
        elif x.dim() == 3:
            if s == 0 or x.shape[0] % s:
                raise ValueError(
                    f"lorahook.torch: {path}: the selection has {s} sequences, but the input's "
                    f"batch size {x.shape[0]} is not a multiple of {s} (input shape "
                    f"{tuple(x.shape)})")
        elif x.dim() != 2:
            raise ValueError(f"lorahook.torch: {path}: a selection applies to (batch, seq, d_in) "
                             f"or (rows, d_in) inputs, got shape {tuple(x.shape)}")
        elif s == 0 or x.shape[0] % s:
            raise ValueError(f"lorahook.torch: {path}: the selection has {s} sequences, but the "
                             f"input has {x.shape[0]} rows, not a multiple of {s}")
        if not hook.is_active(layer_idx, module):
            return None  # no selected adapter covers this linear: nothing to do
        return _run(hook, path, layer_idx, module, x, output, d_in, d_out)

    return forward_hook
