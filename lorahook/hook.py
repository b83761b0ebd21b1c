"""The hook contract: what a server calls after each linear projection.

A server computes ``y = W x`` for a batch of token rows, then calls
:func:`apply_lora_rows`, which adds the hook's delta to every row of ``y``
in place.  :class:`LoraHook` is the abstract contract; :class:`NoopLoraHook`
is the "no adapter loaded" hook; :class:`lorahook.LoraAdapter` and the hooks
returned by :meth:`lorahook.AdapterSet.bind` run in the compiled core.
"""
from abc import ABC, abstractmethod

from . import _rows

__all__ = ["LoraHook", "NoopLoraHook", "apply_lora_rows"]


class LoraHook(ABC):
    """A LoRA hook: adds a delta to the output rows of linear projections.

    Subclasses implement :meth:`apply` for one row.  :func:`apply_lora_rows`
    checks the call, asks :meth:`is_active` once per projection, and then
    calls :meth:`apply` once per row, in row order, with ``x`` a read-only
    1-D float32 view of the input row and ``output`` a writable 1-D float32
    view aliasing the caller's output row.
    """

    #: Row count a batch-bound hook was made for (``None``: any batch).
    _bound_rows = None

    #: True for hooks whose kernels the core may look up itself (``_kernels``).
    _fused = False

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

    def _apply_rows(self, layer_idx, module, input, output, input_row_width,
                    output_row_width, n_rows):
        # The generic path: one apply() per row, on views of the caller's arrays.
        rows_in = input.reshape(n_rows, input_row_width).view()
        rows_in.flags.writeable = False
        rows_out = output.reshape(n_rows, output_row_width)
        apply = self.apply
        for i in range(n_rows):
            apply(layer_idx, module, rows_in[i], rows_out[i])


class NoopLoraHook(LoraHook):
    """The hook used when no adapter is loaded: inactive for every projection."""

    __slots__ = ()

    def apply(self, layer_idx, module, x, output):
        return None

    def is_active(self, layer_idx, module):
        return False

    def __repr__(self):
        return "NoopLoraHook()"


_rows._set_hook_base(LoraHook)

apply_lora_rows = _rows.apply_lora_rows
