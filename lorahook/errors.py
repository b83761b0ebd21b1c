"""Exceptions raised by lorahook."""


class LoraValidationError(ValueError):
    """An adapter (or a model configuration) that does not fit a model."""


class LoraFormatError(ValueError):
    """A file that is not a valid, supported LoRA adapter."""


class LoraCapacityError(MemoryError):
    """Adapters that cannot be resident within an :class:`~lorahook.AdapterSet`'s capacity.

    ``nbytes`` (when the set raised it): the bytes those adapters need on
    their own; more than the capacity means they can never be resident.
    """

    nbytes = None
