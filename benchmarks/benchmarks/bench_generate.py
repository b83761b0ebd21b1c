"""Mixed-adapter ``generate`` (see :mod:`lorahook.cli.bench.generate`): base, PEFT, lorahook.

``GenerateRatios`` times lorahook and a peer (PEFT's ``adapter_names``, or the
base model without adapters) in alternation in one benchmark and tracks the
ratio of their medians.  Skipped (``NotImplementedError``) where torch,
transformers or peft are not installed, or on lorahook versions without
sequence selections.
"""
import tempfile

from . import first_module, module_setup, preimport

# every benchmark here runs only where LORAHOOK_ASV_ONLY allows it
setup = module_setup(__name__)
# the peers, imported once in asv's forkserver rather than in each benchmark's process
preimport("torch", "transformers", "peft")


class _Generate:
    """One contender's ``generate`` on a scenario built once per parameter set."""

    timeout = 900
    number = 1
    repeat = 5

    def _build(self, contender, dtype, quant=None):
        try:
            import torch
            from lorahook import threads
            bench_generate = first_module("lorahook.cli.bench.generate", "lorahook.bench.generate")
        except ImportError:
            raise NotImplementedError
        if quant is not None and not hasattr(bench_generate, "QUANTIZED"):
            raise NotImplementedError  # a lorahook version without quantized bases
        threads.configure(blas_threads=1)
        torch.set_num_threads(2)
        self.workdir = tempfile.TemporaryDirectory(prefix="lorahook-asv-")
        try:
            parts = (bench_generate.build(self.workdir.name, dtype, quant) if quant is not None
                     else bench_generate.build(self.workdir.name, dtype))
        except ImportError:
            raise NotImplementedError
        self.calls = bench_generate.contenders(*parts)
        if contender is not None:
            self.call = self.calls[contender]
            self.call()  # warm-up

    def teardown(self, *params):
        # asv runs teardown after a setup that raised (NotImplementedError: a peer is missing)
        workdir = getattr(self, "workdir", None)
        if workdir is not None:
            workdir.cleanup()


class MixedGenerate(_Generate):
    params = [["base", "peft", "lorahook"], ["float32", "bfloat16"]]
    param_names = ["contender", "dtype"]

    def setup(self, contender, dtype):
        self._build(contender, dtype)

    def time_generate(self, contender, dtype):
        self.call()


class QuantizedMixedGenerate(_Generate):
    """The same scenario on quantized bases: bitsandbytes 4-bit and torchao int8 (float32 rows)."""

    params = [["base", "peft", "lorahook"], ["bnb-4bit", "torchao-int8"]]
    param_names = ["contender", "quant"]

    def setup(self, contender, quant):
        self._build(contender, "float32", quant)

    def time_generate(self, contender, quant):
        self.call()


class GenerateRatios(_Generate):
    """lorahook's mixed ``generate`` over PEFT's, and over the base model's without adapters."""

    params = [["float32", "bfloat16"]]
    param_names = ["dtype"]

    def setup(self, dtype):
        self._build(None, dtype)

    def _ratio(self, peer):
        from .bench_ratios import median_ratio
        return median_ratio(self.calls["lorahook"], self.calls[peer], rounds=5)

    def track_vs_peft(self, dtype):
        return self._ratio("peft")

    track_vs_peft.unit = "lorahook / PEFT"

    def track_vs_base(self, dtype):
        return self._ratio("base")

    track_vs_base.unit = "lorahook / base model"
