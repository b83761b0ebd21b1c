"""An eviction-heavy bind loop: many adapters, room for a few, loading by name.

Twelve adapters (Qwen3.5-0.8B attention projections of four layers, rank 16)
are PEFT directories in a temporary folder; the set holds ``room`` of them.
Each timed call binds a batch of 8 rows over 3 random names (most of them not
resident when ``room`` is small) and applies it to one projection.  Skipped on
lorahook versions without a capacity.
"""
import random
import tempfile

import numpy as np

from . import module_setup

# every benchmark here runs only where LORAHOOK_ASV_ONLY allows it
setup = module_setup(__name__)


class EvictingBinds:
    params = [[3, 12]]
    param_names = ["room"]
    timeout = 300

    def setup(self, room):
        import lorahook
        try:
            lorahook.AdapterSet(capacity_bytes=1, resolver=None)
        except TypeError:
            raise NotImplementedError
        lorahook.threads.configure(blas_threads=1)
        rng = np.random.default_rng(0)
        self.tmp = tempfile.TemporaryDirectory(prefix="lorahook-asv-evict-")
        one = None
        for i in range(12):
            adapter = lorahook.LoraAdapter({
                (layer, m): lorahook.LoraLayer(rng.standard_normal((16, 1024)).astype(np.float32),
                                               rng.standard_normal((d_out, 16)).astype(np.float32))
                for layer in (3, 7, 11, 15) for m, d_out in (("q_proj", 4096), ("v_proj", 512))})
            adapter.save_peft(f"{self.tmp.name}/a{i}", architecture="qwen3_5")
            one = adapter.nbytes
        self.adapters = lorahook.AdapterSet(capacity_bytes=room * one, resolver=self.tmp.name)
        self.picker = random.Random(0)
        self.x = rng.standard_normal((8, 1024)).astype(np.float32)
        self.y = np.zeros((8, 512), np.float32)
        self.apply = lorahook.apply_lora_rows

    def teardown(self, room):
        tmp = getattr(self, "tmp", None)  # None: setup skipped before making it
        if tmp is not None:
            tmp.cleanup()

    def time_bind_and_apply(self, room):
        names = [f"a{self.picker.randrange(12)}" for _ in range(3)]
        hook = self.adapters.bind([names[i % 3] for i in range(8)])
        self.apply(hook, 7, "v_proj", self.x, self.y, 1024, 512)

    def track_loads_per_call(self, room):
        before = self.adapters.stats()["loads"]
        for _ in range(20):
            self.time_bind_and_apply(room)
        return (self.adapters.stats()["loads"] - before) / 20
