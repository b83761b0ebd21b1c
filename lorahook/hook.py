"""The hook contract: what a server calls after each linear projection.

A server computes ``y = W x`` for a batch of token rows, then calls
:func:`apply_lora_rows`, which adds the hook's delta to every row of ``y``
in place.  :class:`LoraHook` is the abstract contract; :class:`NoopLoraHook`
is the "no adapter loaded" hook; :class:`lorahook.LoraAdapter` and the hooks
returned by :meth:`lorahook.AdapterSet.bind` run in the compiled core.
"""
from abc import ABC, abstractmethod

from ._rows import apply_lora_embedding, apply_lora_rows, set_hook_base

__all__ = ["LoraHook", "NoopLoraHook", "apply_lora_rows", "apply_lora_embedding"]


class LoraHook(ABC):
    """A LoRA hook: adds a delta to the output rows of linear projections.

    Subclasses implement :meth:`apply` for one row.  :func:`apply_lora_rows`
    checks the call, asks :meth:`is_active` once per projection, and then
    calls :meth:`apply` once per row, in row order, with ``x`` a read-only
    1-D float32 view of the input row and ``output`` a writable 1-D float32
    view aliasing the caller's output row.

    A class registered with ``LoraHook.register`` is a hook too: it gets the
    same per-row path, and one without ``is_active`` counts as active for
    every projection.
    """

    __slots__ = ()

    @abstractmethod
    def apply(self, layer_idx, module, x, output):
        """Add this hook's delta for one row of projection ``(layer_idx, module)``."""

    def is_active(self, layer_idx, module):
        """Whether this hook has anything to apply to ``(layer_idx, module)``.

        Asked once per projection, before any row work.  Default ``True``.
        """
        return True

    def validate_against(self, config):
        """Check this hook's geometry against a model configuration.

        Raise :class:`lorahook.LoraValidationError` on a misfit, return
        ``None`` when it fits.  The default trusts the caller.
        """
        return None

    def validate_against_bert(self, num_hidden_layers, hidden_size, intermediate_size):
        """The same check for a BERT encoder of the given dimensions.

        May be called many times per request: implement it as a repeatable
        read without side effects.  The default trusts the caller.
        """
        return None


class NoopLoraHook(LoraHook):
    """The hook used when no adapter is loaded: inactive for every projection."""

    __slots__ = ()

    def apply(self, layer_idx, module, x, output):
        return None

    def is_active(self, layer_idx, module):
        return False

    def __repr__(self):
        return "NoopLoraHook()"


# the compiled entry points (lorahook._rows) are this module's too: re-exported by lorahook
set_hook_base(LoraHook)
