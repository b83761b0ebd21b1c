"""Mixed-adapter ``generate`` (see :mod:`lorahook.bench_generate`): base, PEFT, lorahook.

Skipped (``NotImplementedError``) where torch, transformers or peft are not
installed, or on lorahook versions without sequence selections.
"""
import tempfile


class MixedGenerate:
    params = [["base", "peft", "lorahook"]]
    param_names = ["contender"]
    timeout = 600
    number = 1
    repeat = 5


    def setup(self, contender):
        try:
            import torch
            from lorahook import bench_generate, threads
        except ImportError:
            raise NotImplementedError
        threads.configure(blas_threads=1)
        torch.set_num_threads(2)
        self.workdir = tempfile.TemporaryDirectory(prefix="lorahook-asv-")
        try:
            parts = bench_generate.build(self.workdir.name)
        except ImportError:
            raise NotImplementedError
        self.call = bench_generate.contenders(*parts)[contender]
        self.call()  # warm-up

    def teardown(self, contender):
        self.workdir.cleanup()

    def time_generate(self, contender):
        self.call()
