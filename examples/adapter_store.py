"""Serving more adapters than fit in memory: a capacity, LRU eviction, loading by name.

    pip install lorahook
    python examples/adapter_store.py

Twelve tenants' adapters are written as PEFT directories under one folder; the
server's AdapterSet has room for four (by bytes) and pins one that every
request may use.  Requests name their adapters; the set loads a name on its
first use, evicts the least recently used unpinned adapters to stay within
the capacity, and each batch is checked against a float64 numpy reference.
"""
import random
import tempfile

import numpy as np

import lorahook

D_IN, D_OUT, RANK = 256, 512, 16
MODULES = ("q_proj", "v_proj")
LAYERS = 4


def tenant_adapter(seed):
    rng = np.random.default_rng(seed)
    return lorahook.LoraAdapter({
        (layer, module): lorahook.LoraLayer(rng.standard_normal((RANK, D_IN)) / 16,
                                            rng.standard_normal((D_OUT, RANK)) / 4, scale=2.0)
        for layer in range(LAYERS) for module in MODULES})


def main():
    lorahook.threads.configure(blas_threads=1)
    per_adapter = 4 * RANK * (D_IN + D_OUT) * LAYERS * len(MODULES)  # bytes, float32
    print(f"one adapter: 4 bytes x rank {RANK} x (d_in + d_out) x {LAYERS * len(MODULES)} "
          f"projections = {per_adapter / 1024:.0f} KiB")
    with tempfile.TemporaryDirectory(prefix="lorahook-store-") as root:
        for i in range(12):
            tenant_adapter(i).save_peft(f"{root}/tenant{i}", architecture="llama")
        adapters = lorahook.AdapterSet(capacity_bytes=4 * per_adapter, resolver=root)
        adapters.pin("tenant0")  # always resident
        rng = np.random.default_rng(0)
        picker = random.Random(0)
        for step in range(40):
            names = [picker.choice([f"tenant{i}" for i in range(12)] + [None]) for _ in range(8)]
            if len({n for n in names if n}) > 3:  # with one pinned, a batch fits three more
                names = names[:3] + ["tenant0"] * 5
            hook = adapters.bind(names)
            x = rng.standard_normal((len(names), D_IN)).astype(np.float32)
            y = np.zeros((len(names), D_OUT), np.float32)
            lorahook.apply_lora_rows(hook, 2, "v_proj", x, y, D_IN, D_OUT)
            for i, name in enumerate(names):  # check each row against float64 numpy
                if name is None:
                    assert not y[i].any()
                    continue
                layer = hook.adapters[name].layers[(2, "v_proj")]
                ref = layer.scale * (layer.b.astype(np.float64)
                                     @ (layer.a.astype(np.float64) @ x[i].astype(np.float64)))
                assert np.max(np.abs(y[i] - ref)) <= 1e-5 * np.max(np.abs(ref))
            assert adapters.nbytes <= adapters.capacity_bytes
        stats = adapters.stats()
        print(f"40 batches over 12 adapters with room for 4: resident {adapters.names()}, "
              f"{stats['loads']} loads, {stats['evictions']} evictions, {stats['hits']} hits, "
              f"{stats['nbytes'] / 1024:.0f} of {stats['capacity_bytes'] / 1024:.0f} KiB; "
              f"every row matched the float64 reference")


if __name__ == "__main__":
    main()
