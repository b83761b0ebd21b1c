"""Where a vLLM worker's LoRA time goes (``LORAHOOK_VLLM_PROFILE=FILE``)."""
from __future__ import annotations

import atexit
import json
import os
import time

__all__ = ["Profile", "clock"]

clock = time.perf_counter


class Profile:
    """Where a worker's LoRA time goes, per projection kind and for the per-step metadata.

    On when ``LORAHOOK_VLLM_PROFILE`` names a file: every 32 steps (and at
    exit) the worker writes its totals there as JSON, ``{"steps": ...,
    "metadata_s": ..., "calls": {"linear 896->896+128+128": [calls,
    seconds], ...}}``.  Off, it costs one ``is None`` test per call.
    """

    def __init__(self, path: str):
        self.path = path
        self.steps = 0
        self.metadata_s = 0.0
        self.calls: dict = {}
        atexit.register(self.write)

    @classmethod
    def from_env(cls) -> "Profile | None":
        path = os.environ.get("LORAHOOK_VLLM_PROFILE", "").strip()
        return cls(path) if path else None

    def step(self, seconds: float) -> None:
        self.steps += 1
        self.metadata_s += seconds
        if self.steps % 32 == 0:
            self.write()

    def add(self, key, seconds: float) -> None:
        entry = self.calls.get(key)
        if entry is None:
            entry = self.calls[key] = [0, 0.0]
        entry[0] += 1
        entry[1] += seconds

    def write(self) -> None:
        calls = {f"{kind} {d_in}->{'+'.join(map(str, outs))}": v
                 for (kind, d_in, outs), v in self.calls.items()}
        with open(self.path, "w", encoding="utf-8") as f:
            json.dump({"steps": self.steps, "metadata_s": self.metadata_s, "calls": calls}, f)
