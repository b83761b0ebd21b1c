"""Could the kernels read ``lora_B`` in the file's layout? (A question for memory-mapped loading.)

    python benchmarks/mmap_layout.py [--repeats N] [--quick]

A PEFT file holds ``lora_B.weight`` as ``(d_out, rank)`` row-major; lorahook's kernels read
``B^T``, ``(rank, d_out)`` row-major, which the loader makes by transposing. Mapping adapter
files read-only (so that worker processes share the page cache) needs kernels that use the
file's layout as it is: ``y += s * B t`` becomes ``sgemv('T')`` over the ``(rank, d_out)``
column-major view instead of ``sgemv('N')``, and the prefill ``sgemm`` takes ``B`` transposed.
``A`` is ``(rank, d_in)`` row-major in both, so only ``B``'s products change.

This script compiles a small Cython harness (outside the package) that makes exactly the BLAS
calls of ``lorahook._rows`` for one projection, both products (``t = A x``, then
``y += s * B t``), with SciPy's BLAS on one thread, and times, in turns within one run:

* ``today``: ``B^T`` row-major, 64-byte aligned (what the loader makes);
* ``file``: ``B`` row-major, 64-byte aligned;
* ``file+8``: ``B`` row-major at an address 8 bytes past a 64-byte boundary, as tensors sit
  in a mapped safetensors file (offsets are only guaranteed to be multiples of 8).

for decode (1 row: two ``sgemv``) and prefill (256 rows: two ``sgemm``), ``hot`` (the same
matrices every call: they stay in cache) and ``cold`` (a pool of copies larger than the last
level cache, as when a server steps through every layer of a model and many adapters).
Prints medians per apply and the ratios ``file / today``.
"""
import argparse
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np

SHAPES = [(1024, 1024), (1024, 3584), (4096, 4096)]
RANKS = [8, 16, 64]
LAYOUTS = ["today", "file", "file+8"]
PREFILL_ROWS = 256
COLD_BYTES = 96 * 1024 * 1024  # per layout; larger than this machine's last-level cache

HARNESS = textwrap.dedent('''
    # cython: language_level=3, boundscheck=False, wraparound=False
    from libc.stdint cimport uintptr_t
    from libc.stdlib cimport malloc, free
    from scipy.linalg.cython_blas cimport sgemv, sgemm
    from posix.time cimport clock_gettime, timespec, CLOCK_MONOTONIC

    cdef double _now() noexcept nogil:
        cdef timespec ts
        clock_gettime(CLOCK_MONOTONIC, &ts)
        return ts.tv_sec + ts.tv_nsec * 1e-9

    def run(int file_layout, int rows, int d_in, int d_out, int rank, list a_addrs, list b_addrs,
            uintptr_t x_addr, uintptr_t y_addr, uintptr_t t_addr, int calls):
        """Seconds for ``calls`` applications, cycling through the (A, B) pool."""
        cdef int pool = len(a_addrs)
        cdef uintptr_t *pa = <uintptr_t *>malloc(pool * sizeof(uintptr_t))
        cdef uintptr_t *pb = <uintptr_t *>malloc(pool * sizeof(uintptr_t))
        cdef int i
        for i in range(pool):
            pa[i] = a_addrs[i]
            pb[i] = b_addrs[i]
        cdef float *x = <float *>x_addr
        cdef float *y = <float *>y_addr
        cdef float *t = <float *>t_addr
        cdef float *A
        cdef float *B
        cdef char tr = b'T'
        cdef char nt = b'N'
        cdef int one_i = 1
        cdef float one = 1.0, zero = 0.0, s = 0.5
        cdef double t0, t1
        with nogil:
            t0 = _now()
            for i in range(calls):
                A = <float *>pa[i % pool]
                B = <float *>pb[i % pool]
                if rows == 1:
                    sgemv(&tr, &d_in, &rank, &one, A, &d_in, x, &one_i, &zero, t, &one_i)
                    if file_layout:
                        sgemv(&tr, &rank, &d_out, &s, B, &rank, t, &one_i, &one, y, &one_i)
                    else:
                        sgemv(&nt, &d_out, &rank, &s, B, &d_out, t, &one_i, &one, y, &one_i)
                else:
                    sgemm(&tr, &nt, &rank, &rows, &d_in, &one, A, &d_in, x, &d_in, &zero, t, &rank)
                    if file_layout:
                        sgemm(&tr, &nt, &d_out, &rows, &rank, &s, B, &rank, t, &rank, &one, y, &d_out)
                    else:
                        sgemm(&nt, &nt, &d_out, &rows, &rank, &s, B, &d_out, t, &rank, &one, y, &d_out)
            t1 = _now()
        free(pa)
        free(pb)
        return t1 - t0
''')


def build_harness(directory):
    """Compile the harness into ``directory`` and import it."""
    (Path(directory) / "_mmap_layout_harness.pyx").write_text(HARNESS)
    setup = textwrap.dedent('''
        from setuptools import setup, Extension
        from Cython.Build import cythonize
        setup(ext_modules=cythonize([Extension("_mmap_layout_harness", ["_mmap_layout_harness.pyx"],
              extra_compile_args=["-O2"])], quiet=True), script_args=["build_ext", "--inplace", "-q"])
    ''')
    (Path(directory) / "setup.py").write_text(setup)
    subprocess.run([sys.executable, "setup.py"], cwd=directory, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    sys.path.insert(0, str(directory))
    import _mmap_layout_harness
    return _mmap_layout_harness


def aligned(shape, offset=0, align=64):
    """A float32 C-contiguous array whose data starts ``offset`` bytes past an ``align`` boundary."""
    nbytes = int(np.prod(shape)) * 4
    raw = np.empty(nbytes + 2 * align, dtype=np.uint8)
    start = (-raw.ctypes.data) % align + offset
    return raw[start:start + nbytes].view(np.float32).reshape(shape)


def make_pool(d_in, d_out, rank, layout, copies, rng):
    a_pool, b_pool = [], []
    a0 = (rng.standard_normal((rank, d_in)) / np.sqrt(d_in)).astype(np.float32)
    b0 = (rng.standard_normal((d_out, rank)) / np.sqrt(rank)).astype(np.float32)
    for _ in range(copies):
        a = aligned(a0.shape)
        a[...] = a0
        if layout == "today":
            b = aligned((rank, d_out))
            b[...] = b0.T
        else:
            b = aligned((d_out, rank), offset=8 if layout == "file+8" else 0)
            b[...] = b0
        a_pool.append(a)
        b_pool.append(b)
    return a_pool, b_pool, a0, b0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="fewer calls per measurement")
    args = parser.parse_args(argv)

    from lorahook import threads
    threads.configure(blas_threads=1)

    with tempfile.TemporaryDirectory(prefix="lorahook-mmap-layout-") as tmp:
        harness = build_harness(tmp)
        rng = np.random.default_rng(0)
        print("ratios file / today (> 1: the file's layout is slower); medians of "
              f"{args.repeats} turns, SciPy BLAS on one thread")
        print(f"{'shape':>12} {'rank':>4} {'rows':>4} {'cache':>5} | {'today us':>9} {'file us':>9} "
              f"{'file+8 us':>9} | {'file':>5} {'file+8':>6}")
        worst = {}
        for d_in, d_out in SHAPES:
            for rank in RANKS:
                per_copy = 4 * rank * (d_in + d_out)
                for temp in ("hot", "cold"):
                    copies = 1 if temp == "hot" else max(2, COLD_BYTES // per_copy)
                    pools = {layout: make_pool(d_in, d_out, rank, layout, copies,
                                               np.random.default_rng(rank))
                             for layout in LAYOUTS}
                    for rows in (1, PREFILL_ROWS):
                        x = aligned((rows, d_in))
                        x[...] = rng.standard_normal((rows, d_in))
                        ys = {layout: aligned((rows, d_out)) for layout in LAYOUTS}
                        t = aligned((rows, rank))
                        flops = 2 * rows * rank * (d_in + d_out)
                        calls = max(copies, int(4e8 / flops) if not args.quick else int(1e8 / flops), 20)
                        calls = min(calls, 20000)
                        times = {layout: [] for layout in LAYOUTS}
                        # same results in every layout (checks the harness's calls)
                        for layout in LAYOUTS:
                            a_pool, b_pool, a0, b0 = pools[layout]
                            ys[layout][...] = 0
                            harness.run(layout != "today", rows, d_in, d_out, rank,
                                        [a_pool[0].ctypes.data], [b_pool[0].ctypes.data],
                                        x.ctypes.data, ys[layout].ctypes.data, t.ctypes.data, 1)
                        ref = 0.5 * (x.astype(np.float64) @ pools["today"][2].T.astype(np.float64)
                                     @ pools["today"][3].T.astype(np.float64))
                        for layout in LAYOUTS:
                            err = np.max(np.abs(ys[layout] - ref)) / np.max(np.abs(ref))
                            assert err < 1e-5, (layout, err)
                        for _ in range(args.repeats):
                            for layout in LAYOUTS:
                                a_pool, b_pool, _, _ = pools[layout]
                                seconds = harness.run(
                                    layout != "today", rows, d_in, d_out, rank,
                                    [a.ctypes.data for a in a_pool], [b.ctypes.data for b in b_pool],
                                    x.ctypes.data, ys[layout].ctypes.data, t.ctypes.data, calls)
                                times[layout].append(seconds / calls)
                        med = {k: float(np.median(v)) for k, v in times.items()}
                        r1, r2 = med["file"] / med["today"], med["file+8"] / med["today"]
                        worst[(rows, temp)] = max(worst.get((rows, temp), 0), r1, r2)
                        print(f"{d_in:>5}->{d_out:<5} {rank:>4} {rows:>4} {temp:>5} | "
                              f"{med['today'] * 1e6:9.2f} {med['file'] * 1e6:9.2f} {med['file+8'] * 1e6:9.2f} | "
                              f"{r1:5.2f} {r2:6.2f}", flush=True)
                    del pools
        print("\nworst ratio file / today:")
        for (rows, temp), r in sorted(worst.items()):
            kind = "decode " if rows == 1 else "prefill"
            print(f"  {kind} ({rows:>3} rows), {temp:4s}: {r:.2f}  "
                  f"({'within' if r <= 1.2 else 'beyond'} 1.2)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
