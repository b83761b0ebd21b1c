"""Apply one LoRA adapter to a projection's rows and check it against numpy."""
import numpy as np

import lorahook

rng = np.random.default_rng(0)
d_in, d_out, rank, rows = 1024, 1024, 16, 4

layer = lorahook.LoraLayer(rng.standard_normal((rank, d_in)) * 0.02,
                           rng.standard_normal((d_out, rank)) * 0.02, scale=2.0)
adapter = lorahook.LoraAdapter({(0, "q_proj"): layer}, name="example")

x = rng.standard_normal((rows, d_in)).astype(np.float32)
w = rng.standard_normal((d_out, d_in)).astype(np.float32) * 0.02
y = x @ w.T                                   # the server's base projection
ref = y.astype(np.float64) + 2.0 * (x @ layer.a.T @ layer.b.T).astype(np.float64)

lorahook.apply_lora_rows(adapter, 0, "q_proj", x, y, d_in, d_out)
err = np.abs(y - ref).max() / np.abs(ref).max()
print(f"applied {adapter!r} to {rows} rows; max relative error vs float64 numpy: {err:.2e}")
assert err <= 1e-5
