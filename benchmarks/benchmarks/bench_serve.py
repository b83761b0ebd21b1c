"""``lorahook serve``'s mixed batches against one adapter per forward, in this process.

The server's engine (``lorahook.server.engine.Batch``: what each replica of
``lorahook serve`` steps) on a random Llama (hidden 512, 4 layers, MLP 1408)
with 8 PEFT adapters of rank 8 on ``q_proj v_proj o_proj down_proj``: 32
requests, 4 per adapter, 16 greedy tokens each.

- ``mixed``: one batch holds all 32 requests, whatever their adapters (what
  ``lorahook serve`` does);
- ``one_adapter_per_forward``: one batch per adapter, in turn (what a server
  without mixed batches does: ``lorahook serve --max-adapters 1``).

``track_mixed_vs_one_per_forward`` times both in alternation and returns the
ratio of their medians (below 1: mixed batches are faster).  No Ray, no HTTP:
``benchmarks/serve_bench.py`` measures the whole server.  Skipped without
torch, transformers and PEFT, and on lorahook versions without the engine.
"""
import inspect
import os
import tempfile

from . import module_setup, preimport

# every benchmark here runs only where LORAHOOK_ASV_ONLY allows it
setup = module_setup(__name__)
# the peers, imported once in asv's forkserver rather than in each benchmark's process
preimport("torch", "transformers", "peft")


ADAPTERS = 8
PER_ADAPTER = 4
NEW_TOKENS = 16
PROMPT = [1, 9, 27, 14, 33, 5, 61, 8]
SIZE = dict(vocab_size=128, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256)


class _Ids:
    """A tokenizer for token ids: the engine decodes what it streams; here, the ids' text."""

    @staticmethod
    def decode(ids, **kwargs):
        return " ".join(map(str, ids))


def _saved(workdir):
    """The base model and ``ADAPTERS`` PEFT adapters saved under ``workdir``."""
    import peft
    import torch
    import transformers

    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **SIZE, pad_token_id=0, bos_token_id=1, eos_token_id=2)).eval()
    names = [f"adapter{i}" for i in range(ADAPTERS)]
    pm = peft.get_peft_model(transformers.LlamaForCausalLM(base.config).eval(),
                             peft.LoraConfig(r=8, lora_alpha=16, init_lora_weights=False,
                                             target_modules=["q_proj", "v_proj", "o_proj",
                                                             "down_proj"]))
    with torch.no_grad():
        for i, name in enumerate(names):
            torch.manual_seed(100 + i)
            for key, p in pm.named_parameters():
                if "lora_" in key:  # a new adapter: A and B drawn anew
                    p.copy_(torch.randn_like(p) * 0.05)
            pm.save_pretrained(os.path.join(workdir, name))
    return base, names


class _Engine:
    timeout = 600

    def _build(self):
        try:
            import torch
            import lorahook
            from lorahook.server.engine import Batch, Request
            from lorahook.torch import attach
        except ImportError:
            raise NotImplementedError
        if "eos_ids" not in inspect.signature(Batch).parameters:
            raise NotImplementedError  # an engine older than this benchmark
        lorahook.threads.configure(blas_threads=1)
        torch.set_num_threads(1)  # a replica's setting: one thread per replica
        self.workdir = tempfile.TemporaryDirectory(prefix="lorahook-asv-serve-")
        model, names = _saved(self.workdir.name)
        store = lorahook.AdapterSet()
        for name in names:
            store.add(name, lorahook.LoraAdapter.from_peft(os.path.join(self.workdir.name, name)))
        attached = attach(model, store)

        def run(groups):
            for group in groups:
                batch = Batch(model, _Ids(), attached, 0, [])
                batch.admit(group, [Request(PROMPT, NEW_TOKENS, 0.0) for _ in group])
                while not batch.done:
                    batch.step()

        mixed = [[names[i % ADAPTERS] for i in range(ADAPTERS * PER_ADAPTER)]]
        alone = [[name] * PER_ADAPTER for name in names]
        self.runs = {"mixed": lambda: run(mixed), "one_adapter_per_forward": lambda: run(alone)}

    def teardown(self, *params):
        workdir = getattr(self, "workdir", None)  # None: setup did not get that far
        if workdir is not None:
            workdir.cleanup()


class Batches(_Engine):
    number = 1
    repeat = 5
    params = [["mixed", "one_adapter_per_forward"]]
    param_names = ["batching"]

    def setup(self, batching):
        self._build()
        self.runs[batching]()  # warm-up

    def time_requests(self, batching):
        self.runs[batching]()


class BatchRatio(_Engine):
    def setup(self):
        self._build()

    def track_mixed_vs_one_per_forward(self):
        from .bench_ratios import median_ratio
        return median_ratio(self.runs["mixed"], self.runs["one_adapter_per_forward"], rounds=5)

    track_mixed_vs_one_per_forward.unit = "mixed / one adapter per forward"
