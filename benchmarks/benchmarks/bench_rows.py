"""apply_lora_rows on the paths users hit: noop, decode, prefill, a server loop.

Every ``setup`` calls ``lorahook.threads.configure(blas_threads=...)``
explicitly: 1 (SciPy's BLAS, the one the kernels call, on one thread: the
server setting) unless a parameter says otherwise.  The ``threads`` parameter
runs that many Python threads calling at once, each on its own buffers, and
times the whole batch of calls (GIL-release check); ``LargeCall`` varies
SciPy's BLAS threads for a lone large call; ``ServerLoop`` also runs with
SciPy's BLAS as the process found it (``blas="default"``).
"""
import inspect
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import lorahook
from lorahook import LoraAdapter, LoraLayer, NoopLoraHook, Qwen35Config, apply_lora_rows
from lorahook import threads as lh_threads

from . import first_module, module_setup

# every benchmark here runs only where LORAHOOK_ASV_ONLY allows it
setup = module_setup(__name__)


def qwen35_0_8b():
    """Qwen3.5-0.8B's config (``lorahook.cli.bench.rows``), imported when a benchmark runs.

    Imported at setup, not with the module, so that asv discovers the suite on
    commits older than ``lorahook.cli.bench`` (their benchmarks that need it skip).
    """
    return first_module("lorahook.cli.bench.rows", "lorahook.bench.rows").QWEN35_0_8B


def _layer(rng, d_in, d_out, rank):
    a = (rng.standard_normal((rank, d_in)) / np.sqrt(d_in)).astype(np.float32)
    b = (rng.standard_normal((d_out, rank)) / np.sqrt(rank)).astype(np.float32)
    return LoraLayer(a, b, 2.0)


def _configure(blas_threads=1):
    """``configure(blas_threads=...)``, on versions that have it (``None``: as found)."""
    configure = getattr(lh_threads, "configure", None)
    if configure is not None:
        configure(blas_threads=blas_threads)
        return
    if hasattr(lh_threads, "set_num_threads"):  # older versions: no own threads
        lh_threads.set_num_threads(1)
    if blas_threads is not None and hasattr(lh_threads, "set_blas_threads"):
        lh_threads.set_blas_threads(blas_threads)


class _Concurrent:
    """Runs ``self._call(i)`` on ``threads`` callers at once."""

    def _setup_pool(self, threads):
        _configure()
        self.pool = ThreadPoolExecutor(threads) if threads > 1 else None
        self.threads = threads

    def _run(self):
        if self.pool is None:
            self._call(0)
        else:
            list(self.pool.map(self._call, range(self.threads)))

    def teardown(self, *params):
        if getattr(self, "pool", None) is not None:
            self.pool.shutdown()


class Noop(_Concurrent):
    params = [[1, 2]]
    param_names = ["threads"]

    def setup(self, threads):
        self._setup_pool(threads)
        self.hook = NoopLoraHook()
        self.bufs = [(np.zeros((1, 1024), np.float32), np.zeros((1, 1024), np.float32))
                     for _ in range(threads)]

    def _call(self, i):
        x, y = self.bufs[i]
        for _ in range(100):
            apply_lora_rows(self.hook, 0, "q_proj", x, y, 1024, 1024)

    def time_noop_x100(self, threads):
        self._run()


class Rows(_Concurrent):
    """One adapter layer, ``rows`` rows: 1 is decode (sgemv), more is prefill (sgemm)."""
    params = [[1, 8, 128, 512], [(1024, 1024), (1024, 3584), (4096, 4096)], [8, 16, 64], [1, 2]]
    param_names = ["rows", "shape", "rank", "threads"]

    def setup(self, rows, shape, rank, threads):
        if rows == 512 and shape != (4096, 4096):
            raise NotImplementedError
        self._setup_pool(threads)
        rng = np.random.default_rng(0)
        d_in, d_out = shape
        self.args = (d_in, d_out)
        self.hook = LoraAdapter({(0, "q_proj"): _layer(rng, d_in, d_out, rank)})
        self.bufs = [(rng.standard_normal((rows, d_in)).astype(np.float32),
                      np.zeros((rows, d_out), np.float32)) for _ in range(threads)]

    def _call(self, i):
        x, y = self.bufs[i]
        apply_lora_rows(self.hook, 0, "q_proj", x, y, *self.args)

    def time_apply(self, rows, shape, rank, threads):
        self._run()

    def peakmem_apply(self, rows, shape, rank, threads):
        self._run()


class LargeCall:
    """A lone large prefill call with SciPy's BLAS on 1 or 2 threads."""
    params = [[(256, 1024, 3584), (512, 4096, 4096)], [1, 2]]
    param_names = ["rows_shape", "blas_threads"]

    def setup(self, rows_shape, blas_threads):
        _configure(blas_threads)
        rows, d_in, d_out = rows_shape
        rng = np.random.default_rng(0)
        self.args = (d_in, d_out)
        self.hook = LoraAdapter({(0, "q_proj"): _layer(rng, d_in, d_out, 16)})
        self.x = rng.standard_normal((rows, d_in)).astype(np.float32)
        self.y = np.zeros((rows, d_out), np.float32)

    def teardown(self, rows_shape, blas_threads):
        _configure()

    def time_apply(self, rows_shape, blas_threads):
        apply_lora_rows(self.hook, 0, "q_proj", self.x, self.y, *self.args)


class ServerLoop(_Concurrent):
    """Qwen3.5-0.8B projections, numpy base matmul then the hook (rank 16)."""
    params = [[1, 128], [False, True], [1, 2], ["configured", "default"]]
    param_names = ["rows", "hook", "threads", "blas"]
    timeout = 120

    def setup(self, rows, hook, threads, blas):
        self._setup_pool(threads)
        _configure(1 if blas == "configured" else None)
        rng = np.random.default_rng(0)
        cfg = Qwen35Config.from_dict(qwen35_0_8b())
        n_layers = 4  # one full-attention block: 3 linear-attention layers + 1 full
        layers, self.plan = {}, []
        self.inputs = [{} for _ in range(threads)]
        for li in range(n_layers):
            for m in cfg.modules_for_layer(li):
                d_in, d_out = cfg.projection_shape(li, m)
                w = (rng.standard_normal((d_out, d_in)) / np.sqrt(d_in)).astype(np.float32)
                layers[(li, m)] = _layer(rng, d_in, d_out, 16)
                for inp in self.inputs:
                    inp.setdefault(d_in, rng.standard_normal((rows, d_in)).astype(np.float32))
                self.plan.append((li, m, w.T, d_in, d_out))
        self.hook = LoraAdapter(layers) if hook else None

    def _call(self, i):
        inputs = self.inputs[i]
        for li, m, wt, d_in, d_out in self.plan:
            x = inputs[d_in]
            y = x @ wt
            if self.hook is not None:
                apply_lora_rows(self.hook, li, m, x, y, d_in, d_out)

    def teardown(self, *params):
        super().teardown(*params)
        _configure()

    def time_loop(self, rows, hook, threads, blas):
        self._run()

    def peakmem_loop(self, rows, hook, threads, blas):
        self._run()


class MixedBatch:
    """128 rows, 8 adapters x 16 rows, 1024 -> 3584 r16 (skipped without AdapterSet)."""
    params = [[1, 8]]
    param_names = ["adapters"]

    def setup(self, adapters):
        AdapterSet = getattr(lorahook, "AdapterSet", None)
        if AdapterSet is None:
            raise NotImplementedError
        _configure()
        rng = np.random.default_rng(0)
        s = AdapterSet()
        for k in range(adapters):
            s.add(f"a{k}", LoraAdapter({(0, "up_proj"): _layer(rng, 1024, 3584, 16)}))
        self.hook = s.bind([f"a{i * adapters // 128}" for i in range(128)])
        self.x = rng.standard_normal((128, 1024)).astype(np.float32)
        self.y = np.zeros((128, 3584), np.float32)

    def time_mixed(self, adapters):
        apply_lora_rows(self.hook, 0, "up_proj", self.x, self.y, 1024, 3584)


class BindPerStep:
    """``bind`` of 256 rows over 8 adapters, then one pass over every Qwen3.5-0.8B projection.

    ``bound_earlier`` times the pass alone with a batch bound in ``setup``;
    ``bind_each_step`` binds first, as a server of packed, continuous batches
    does once per step (plans are then built during the pass).
    """
    params = [["bound_earlier", "bind_each_step"]]
    param_names = ["mode"]
    timeout = 300

    def setup(self, mode):
        rows = first_module("lorahook.cli.bench.rows", "lorahook.bench.rows")
        bind_cost_setup = getattr(rows, "bind_cost_setup", None)
        if bind_cost_setup is None:  # a version older than the function
            raise NotImplementedError
        _configure()
        self.adapters, self.names, self.one_pass = bind_cost_setup(np.random.default_rng(0))
        self.bound = self.adapters.bind(self.names)
        self.one_pass(self.bound)

    def time_pass(self, mode):
        hook = self.adapters.bind(self.names) if mode == "bind_each_step" else self.bound
        self.one_pass(hook)


class HalfPrecision:
    """One adapter on float32, bfloat16 and float16 rows (decode and prefill shapes).

    bfloat16 rows are passed as uint16 bit patterns through the entry
    lorahook.torch uses, so the suite needs no ml_dtypes.  ``float16_adapter``
    is float32 rows through an adapter kept in float16 (widened per call).
    Skipped on versions without half precision.
    """
    params = [[(1, 1024, 1024), (256, 1024, 3584)],
              ["float32", "bfloat16", "float16", "float16_adapter"]]
    param_names = ["rows_shape", "dtype"]

    def setup(self, rows_shape, dtype):
        # a version without half precision has neither (asv: skipped)
        _halfconv = first_module("lorahook._core.halfconv", "lorahook._halfconv")
        from lorahook import _rows
        # the bfloat16 entry point without ml_dtypes (named _apply_lora_bits before 0.3)
        apply_bits = getattr(_rows, "apply_lora_bits", getattr(_rows, "_apply_lora_bits", None))
        if apply_bits is None:
            raise NotImplementedError
        _configure()
        n, d_in, d_out = rows_shape
        rng = np.random.default_rng(0)
        hook = LoraAdapter({(0, "q_proj"): _layer(rng, d_in, d_out, 16)})
        x = rng.standard_normal((n, d_in)).astype(np.float32)
        y = np.zeros((n, d_out), np.float32)
        if dtype == "bfloat16":
            xb, yb = _halfconv.narrow(x, "bfloat16"), _halfconv.narrow(y, "bfloat16")
            self.call = lambda: apply_bits(hook, 0, "q_proj", xb, yb, d_in, d_out, True)
        elif dtype == "float16":
            xh, yh = x.astype(np.float16), y.astype(np.float16)
            self.call = lambda: apply_lora_rows(hook, 0, "q_proj", xh, yh, d_in, d_out)
        else:
            if dtype == "float16_adapter":
                hook = hook.astype(np.float16)
            self.call = lambda: apply_lora_rows(hook, 0, "q_proj", x, y, d_in, d_out)

    def time_apply(self, rows_shape, dtype):
        self.call()


class DoraRows:
    """A DoRA row against a plain LoRA row of the same rank and shape (decode and prefill).

    The ratio ``time_apply(dora) / time_apply(plain)`` is what a DoRA adapter costs per
    row over plain LoRA in a mixed batch.
    """
    params = [[1, 8, 256], [(1024, 3584), (4096, 4096)], ["plain", "dora"]]
    param_names = ["rows", "shape", "variant"]

    def setup(self, rows, shape, variant):
        if "magnitude" not in inspect.signature(LoraLayer).parameters:
            raise NotImplementedError  # a version without DoRA
        _configure(1)
        rng = np.random.default_rng(0)
        d_in, d_out = shape
        layer = _layer(rng, d_in, d_out, 16)
        if variant == "dora":
            weight = (rng.standard_normal((d_out, d_in)) / np.sqrt(d_in)).astype(np.float32)
            # g = 1: the output neither grows nor decays over repeated calls (a decaying
            # one would time denormal arithmetic, not the kernel)
            magnitude = np.linalg.norm(weight.astype(np.float64) + layer.scale
                                       * layer.b.astype(np.float64) @ layer.a, axis=1)
            layer = LoraLayer(layer.a, layer.b, layer.scale,
                              magnitude=magnitude).with_base(weight, np.zeros(d_out, np.float32))
        self.adapter = LoraAdapter({(0, "q_proj"): layer})
        self.x = rng.standard_normal((rows, d_in)).astype(np.float32)
        self.y = np.zeros((rows, d_out), np.float32)
        self.shape = shape

    def time_apply(self, rows, shape, variant):
        apply_lora_rows(self.adapter, 0, "q_proj", self.x, self.y, *self.shape)
