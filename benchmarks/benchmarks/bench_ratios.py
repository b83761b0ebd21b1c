"""lorahook against numpy in the same benchmark: ratios that survive a change of machine.

Each scenario's ``track_vs_numpy`` times lorahook's call and the same delta in
numpy (``y += (x @ Aᵀ) @ (scale·B)ᵀ``, float32, numpy's BLAS as the process
found it) in alternation, on the same data, and returns the median of
lorahook's times over the median of numpy's: below 1, lorahook is faster.
``time_lorahook`` times lorahook's call alone, as the other suites do.

Scenarios (Qwen-like projections, rank 16 unless named):

- ``decode``: 1 row, 1024 -> 1024;
- ``decode_r64``: 1 row, 4096 -> 4096, rank 64;
- ``prefill``: 256 rows, 1024 -> 3584;
- ``prefill_large``: 512 rows, 4096 -> 4096;
- ``mixed``: 128 rows over 8 adapters (16 rows each, shuffled), 1024 -> 3584;
  numpy computes each adapter's rows with a gather and a scatter.

``Int8Adapters`` times a mixed batch of 8 adapters (1 or 16 rows each) held in
int8 against the same adapters in float32, and their bytes.

``LORAHOOK_BENCH_SLOWDOWN=k`` (an integer, default 1) makes lorahook's side do
its call ``k`` times: a known slowdown, to see ``asv continuous`` and ``asv
compare`` flag it with its factor (see the Benchmarks guide).
``LORAHOOK_BENCH_QUICK=1`` times every ratio (here, in ``bench_generate`` and
``bench_serve``) over 3 rounds instead of its usual count: a check that the
benchmarks run (as CI's ``asv run --quick``), not a measurement.
"""
import os
import time

import numpy as np

import lorahook
from lorahook import LoraAdapter, apply_lora_rows

from . import module_setup
from .bench_rows import _configure, _layer

# every benchmark here runs only where LORAHOOK_ASV_ONLY allows it
setup = module_setup(__name__)


ROUNDS = 31
SCENARIOS = {
    # name: (rows, d_in, d_out, rank, adapters)
    "decode": (1, 1024, 1024, 16, 1),
    "decode_r64": (1, 4096, 4096, 64, 1),
    "prefill": (256, 1024, 3584, 16, 1),
    "prefill_large": (512, 4096, 4096, 16, 1),
    "mixed": (128, 1024, 3584, 16, 8),
}


def slowdown():
    """The injected slowdown factor, ``LORAHOOK_BENCH_SLOWDOWN`` (1: none)."""
    text = os.environ.get("LORAHOOK_BENCH_SLOWDOWN", "1")
    try:
        k = int(text)
    except ValueError:
        raise ValueError(f"LORAHOOK_BENCH_SLOWDOWN must be a positive integer, got {text!r}")
    if k < 1:
        raise ValueError(f"LORAHOOK_BENCH_SLOWDOWN must be a positive integer, got {k}")
    return k


def median_ratio(f, g, rounds=ROUNDS):
    """Median time of ``f`` over median time of ``g``, called in alternation (one warm-up each).

    ``rounds`` rounds, or 3 with ``LORAHOOK_BENCH_QUICK=1``.
    """
    if os.environ.get("LORAHOOK_BENCH_QUICK") == "1":
        rounds = min(rounds, 3)
    f(), g()
    tf, tg = [], []
    for i in range(rounds):
        first, second = (f, g) if i % 2 == 0 else (g, f)
        t0 = time.perf_counter()
        first()
        t1 = time.perf_counter()
        second()
        t2 = time.perf_counter()
        a, b = (t1 - t0, t2 - t1) if i % 2 == 0 else (t2 - t1, t1 - t0)
        tf.append(a)
        tg.append(b)
    return float(np.median(tf) / np.median(tg))


class Kernels:
    """``apply_lora_rows`` against numpy, one scenario per parameter."""

    params = [list(SCENARIOS)]
    param_names = ["scenario"]

    def setup(self, scenario):
        rows, d_in, d_out, rank, adapters = SCENARIOS[scenario]
        _configure()
        rng = np.random.default_rng(7)
        layers = [_layer(rng, d_in, d_out, rank) for _ in range(adapters)]
        self.x = rng.standard_normal((rows, d_in)).astype(np.float32)
        self.y = np.zeros((rows, d_out), np.float32)
        self.y_np = np.zeros((rows, d_out), np.float32)
        self.shape = (d_in, d_out)
        if adapters == 1:
            self.hook = LoraAdapter({(0, "up_proj"): layers[0]})
            owner = np.zeros(rows, np.intp)
        else:
            store_class = getattr(lorahook, "AdapterSet", None)
            if store_class is None:
                raise NotImplementedError  # a version without mixed batches
            store = store_class()
            for k, layer in enumerate(layers):
                store.add(f"a{k}", LoraAdapter({(0, "up_proj"): layer}))
            owner = rng.permutation(np.arange(rows) * adapters // rows)
            self.hook = store.bind([f"a{k}" for k in owner])
        # numpy's operands: A and scale * B per adapter, the rows each adapter owns
        self.np_parts = [(np.flatnonzero(owner == k), np.ascontiguousarray(layer.a.T),
                          np.ascontiguousarray((layer.scale * layer.b).T))
                         for k, layer in enumerate(layers)]
        self.k = slowdown()

    def _lorahook(self):
        for _ in range(self.k):
            apply_lora_rows(self.hook, 0, "up_proj", self.x, self.y, *self.shape)

    def _numpy(self):
        if len(self.np_parts) == 1:
            _, at, bt = self.np_parts[0]
            self.y_np += (self.x @ at) @ bt
            return
        for rows, at, bt in self.np_parts:
            self.y_np[rows] += (self.x[rows] @ at) @ bt

    def time_lorahook(self, scenario):
        self._lorahook()

    def track_vs_numpy(self, scenario):
        return median_ratio(self._lorahook, self._numpy)

    track_vs_numpy.unit = "lorahook / numpy"


# mixed batches of adapters held in int8 against the same adapters in float32 (one row or
# 16 rows of each of 8 adapters, 1024 -> 3584, rank 16)
HELD = {"decode": (8, 1), "prefill": (8, 16)}


class Int8Adapters:
    """A mixed batch with its adapters held in int8, against the same in float32."""

    params = [list(HELD)]
    param_names = ["scenario"]

    def setup(self, scenario):
        adapters, per = HELD[scenario]
        _configure()
        rng = np.random.default_rng(11)
        layers = [_layer(rng, 1024, 3584, 16) for _ in range(adapters)]
        store_class = getattr(lorahook, "AdapterSet", None)
        try:
            stores = {dt: store_class(dtype=dt) for dt in ("float32", "int8")}
        except TypeError:  # a version without int8 adapters (or without a store dtype)
            raise NotImplementedError
        names = [f"a{k}" for k in range(adapters)]
        for dt, store in stores.items():
            for name, layer in zip(names, layers):
                store.add(name, LoraAdapter({(0, "up_proj"): layer}))
        rows = [names[i // per] for i in range(adapters * per)]
        self.hooks = {dt: store.bind(rows) for dt, store in stores.items()}
        self.nbytes = {dt: store.nbytes for dt, store in stores.items()}
        self.x = rng.standard_normal((len(rows), 1024)).astype(np.float32)
        self.y = np.zeros((len(rows), 3584), np.float32)

    def _run(self, dt):
        apply_lora_rows(self.hooks[dt], 0, "up_proj", self.x, self.y, 1024, 3584)

    def time_int8(self, scenario):
        self._run("int8")

    def track_int8_vs_float32(self, scenario):
        return median_ratio(lambda: self._run("int8"), lambda: self._run("float32"))

    track_int8_vs_float32.unit = "int8 / float32"

    def track_bytes_int8_vs_float32(self, scenario):
        return self.nbytes["int8"] / self.nbytes["float32"]

    track_bytes_int8_vs_float32.unit = "int8 / float32"
