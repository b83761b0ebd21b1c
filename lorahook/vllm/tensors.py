"""Tensors as lorahook's kernels take them: NumPy views of vLLM's CPU tensors, never copies.

A call whose tensors these views cannot serve raises :class:`Fallback` before
anything is written, and the wrapper runs vLLM's own op for it.
"""
from __future__ import annotations

import numpy as np
import torch

__all__ = ["Fallback", "HALF", "array_of", "rows_of", "rows_as", "one_kind"]

HALF = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


class Fallback(Exception):
    """A call lorahook does not serve: vLLM's own op runs it."""


def array_of(t: torch.Tensor, half: list) -> np.ndarray:
    """A numpy view of a CPU tensor (16-bit tensors as uint16 patterns); ``half`` collects kinds."""
    if t.device.type != "cpu":
        raise Fallback
    if t.dtype == torch.float32:
        return t.detach().numpy()
    kind = HALF.get(t.dtype)
    if kind is None:
        raise Fallback
    if kind not in half:
        half.append(kind)
    return t.detach().view(torch.int16).numpy().view(np.uint16)


def rows_of(t: torch.Tensor, half: list) -> np.ndarray:
    """``t`` as a 2-D ``(rows, width)`` numpy view; never a copy (an output must be written in place)."""
    kind = None
    if t.dtype != torch.float32:
        kind = HALF.get(t.dtype)
        if kind is None:
            raise Fallback
        if kind not in half:
            half.append(kind)
    return rows_as(t, kind)


def rows_as(t: torch.Tensor, half: str | None) -> np.ndarray:
    """``t`` as a 2-D numpy view, its dtype known to be served (``half``: its 16-bit kind).

    The fewest torch calls that make the view (the pairs kernel's path per
    projection), or ``Fallback``; never a copy.
    """
    if t.dim() != 2:
        try:
            t = t.view(-1, t.shape[-1])
        except RuntimeError:  # strides a flat view cannot express
            raise Fallback from None
    if not t.is_cpu or (t.stride(1) != 1 and t.shape[1] > 1):  # rows of adjacent values
        raise Fallback
    if t.requires_grad:
        t = t.detach()
    return t.numpy() if half is None else t.view(torch.int16).numpy().view(np.uint16)


def one_kind(half: list) -> str | None:
    """The one 16-bit kind of a call's arrays (``apply_slots``' ``half``)."""
    if len(half) > 1:
        raise Fallback  # two 16-bit kinds in one call
    return half[0] if half else None
