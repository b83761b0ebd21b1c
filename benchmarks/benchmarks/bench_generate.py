"""Mixed-adapter ``generate`` (see :mod:`lorahook.bench.generate`): base, PEFT, lorahook.

Skipped (``NotImplementedError``) where torch, transformers or peft are not
installed, or on lorahook versions without sequence selections.
"""
import tempfile


class _Generate:
    """One contender's ``generate`` on a scenario built once per parameter set."""

    timeout = 900
    number = 1
    repeat = 5

    def _build(self, contender, dtype, quant=None):
        try:
            import torch
            from lorahook import threads
            from lorahook.bench import generate as bench_generate
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
        self.call = bench_generate.contenders(*parts)[contender]
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
