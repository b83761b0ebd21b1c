"""Adapters beyond plain LoRA against PEFT (see :mod:`lorahook.cli.bench.variants`).

``DoraGenerate``: a DoRA adapter, a plain one and the base in one ``generate``
(lorahook) against PEFT, which runs one ``generate`` per sequence (it cannot
mix DoRA adapters in a batch).  ``CrossEncoder``: four BERT rerankers with
saved classifier heads, mixed per row.  Skipped (``NotImplementedError``)
without torch, transformers or peft, or on lorahook versions without them.
"""
import tempfile

from . import first_module, module_setup, preimport

# every benchmark here runs only where LORAHOOK_ASV_ONLY allows it
setup = module_setup(__name__)
# the peers, imported once in asv's forkserver rather than in each benchmark's process
preimport("torch", "transformers", "peft")


class _Scenario:
    timeout = 900
    number = 1
    repeat = 5

    def _build(self, builder, contenders, contender):
        try:
            import torch
            from lorahook import threads
            variants = first_module("lorahook.cli.bench.variants", "lorahook.bench.variants")
        except ImportError:
            raise NotImplementedError
        threads.configure(blas_threads=1)
        torch.set_num_threads(2)
        self.workdir = tempfile.TemporaryDirectory(prefix="lorahook-asv-")
        parts = getattr(variants, builder)(self.workdir.name)
        self.call = getattr(variants, contenders)(*parts)[contender]
        self.call()  # warm-up

    def teardown(self, *params):
        # asv runs teardown after a setup that raised (NotImplementedError: a peer is missing)
        workdir = getattr(self, "workdir", None)
        if workdir is not None:
            workdir.cleanup()


class DoraGenerate(_Scenario):
    params = [["peft", "lorahook"]]
    param_names = ["contender"]

    def setup(self, contender):
        self._build("build_dora", "dora_contenders", contender)

    def time_generate(self, contender):
        self.call()


class CrossEncoder(_Scenario):
    params = [["peft", "lorahook"]]
    param_names = ["contender"]

    def setup(self, contender):
        self._build("build_rerankers", "reranker_contenders", contender)

    def time_score(self, contender):
        self.call()
