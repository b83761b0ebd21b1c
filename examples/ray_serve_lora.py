"""Serve one causal LM with many LoRA adapters on Ray Serve, several adapters per batch.

    pip install 'lorahook[ray]'        # Ray Serve, torch and transformers
    python examples/ray_serve_lora.py --model /models/base --adapters /models/adapters \
        --replicas 2 --adapters-per-replica 8
    python examples/ray_serve_lora.py --smoke     # end to end on a small random model

The pieces, each one line of the deployment below:

* the base model is a plain transformers causal LM, float32, on the CPU; it is
  attached once to the replica's :class:`lorahook.AdapterSet`
  (``attach(model, adapters)``) and runs every batch's ``generate`` with
  ``attached.sequences(names)``: one adapter (or none) per sequence;
* adapters are PEFT directories ``<adapters>/<name>``, read once for the whole
  cluster by :func:`lorahook.ray_serve.shared_resolver` and mapped by every
  replica of a node from one read-only copy in Ray's object store;
* each replica's set holds at most ``capacity_bytes`` of adapters
  (``--adapters-per-replica`` x the largest adapter's bytes), evicting the
  least recently used;
* :func:`lorahook.ray_serve.multiplexed` reports the adapters a replica holds
  to Ray's routers, so an adapter's requests go where it is already loaded;
* :func:`lorahook.ray_serve.batch` gathers the pending requests of any
  adapters into one ``generate`` (Ray's ``serve.batch`` would run one per
  adapter), at most ``MAX_ADAPTERS_PER_BATCH`` distinct adapters a batch;
  ``max_ongoing_requests`` is twice ``MAX_BATCH_SIZE``, so a replica always
  holds enough requests to fill a batch.  A batched ``generate`` runs until
  its longest request is done: every request of a batch waits for it.

Requests, over HTTP (``POST /``, JSON) or through a ``DeploymentHandle``:

* ``{"input_ids": [...], "max_new_tokens": 16}``, or ``{"prompt": "..."}`` when
  the model directory has a tokenizer;
* the adapter is Ray's multiplexed model id: the ``serve_multiplexed_model_id``
  header, or ``handle.options(multiplexed_model_id=name)``; without one, the
  base model;
* the answer is ``{"adapter": name, "tokens": [...]}`` (and ``"text"`` with a
  tokenizer); an unknown adapter is HTTP 404 naming it, a broken one 422.

To run it on a cluster, start Ray there (``ray start --head`` / ``ray start
--address=...``) and pass ``--address auto``: the code does not change.  The
adapter directory is read on the node the resolver actor runs on (shared
storage, or the head node); the model directory on every replica's node.
"""
import argparse
import asyncio
import logging
import os
import socket
import sys
import tempfile
import time

logger = logging.getLogger("ray.serve")

MAX_BATCH_SIZE = 8  # sequences in one generate
MAX_ADAPTERS_PER_BATCH = 2  # distinct adapters in one generate; <= --adapters-per-replica
BATCH_WAIT_S = 0.02  # how long a batch waits to fill, from its oldest request


def _imports():
    try:
        import ray  # noqa: F401
        import torch  # noqa: F401
        import transformers  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError as exc:
        sys.exit(f"this example needs Ray Serve, PyTorch and transformers ({exc}): "
                 f"pip install 'lorahook[ray]'")


_imports()

import numpy as np  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from ray import serve  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import JSONResponse  # noqa: E402

import lorahook  # noqa: E402
from lorahook.ray_serve import batch, multiplexed, shared_resolver  # noqa: E402
from lorahook.torch import attach, geometry_of  # noqa: E402


@serve.deployment(max_ongoing_requests=2 * MAX_BATCH_SIZE)
class LoraLM:
    """One replica: the base model, its adapter set, routing by adapter, mixed batches."""

    def __init__(self, model_path, resolver, capacity_bytes, adapters_per_replica,
                 torch_threads=1):
        if adapters_per_replica < MAX_ADAPTERS_PER_BATCH:
            raise ValueError(
                f"adapters_per_replica ({adapters_per_replica}) must be >= "
                f"MAX_ADAPTERS_PER_BATCH ({MAX_ADAPTERS_PER_BATCH}): a batch needs all of its "
                f"adapters resident at once")
        torch.set_num_threads(torch_threads)
        lorahook.threads.configure(blas_threads=1)  # a server setting: see the README's "Threads"
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            model_path, dtype=torch.float32).eval()
        try:
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
        except (OSError, ValueError):
            self.tokenizer = None  # token ids only
        config = self.model.generation_config
        self.pad_token_id = next((t for t in (config.pad_token_id, config.eos_token_id, 0)
                                  if isinstance(t, int)), 0)
        # Every adapter is validated against the model's linears before it is installed.
        self.adapters = lorahook.AdapterSet(geometry_of(self.model),
                                            capacity_bytes=capacity_bytes, resolver=resolver)
        self.attached = attach(self.model, self.adapters)
        self.load = multiplexed(self.adapters, adapters_per_replica)
        self.batches = []  # the adapter names of every batch, for stats()

    # --- requests -----------------------------------------------------------

    async def __call__(self, request: Request):
        """HTTP: ``POST /`` with JSON; the adapter in the ``serve_multiplexed_model_id`` header."""
        try:
            body = await request.json()
            input_ids = self._input_ids(body)
            max_new_tokens = int(body.get("max_new_tokens", 16))
        except (ValueError, TypeError, KeyError) as exc:
            return JSONResponse({"error": f"bad request: {exc}"}, status_code=400)
        model_id = serve.get_multiplexed_model_id()
        try:
            name = await self.load(model_id)
        except KeyError as exc:
            # The full message may name server paths: the replica's log gets it, clients do not.
            logger.warning("adapter %r: %s", model_id, exc)
            return JSONResponse({"error": f"no adapter named {model_id!r}"}, status_code=404)
        except (lorahook.LoraFormatError, lorahook.LoraValidationError) as exc:
            logger.warning("adapter %r: %s", model_id, exc)
            return JSONResponse({"error": f"adapter {model_id!r} cannot be served here: "
                                          f"{type(exc).__name__}"}, status_code=422)
        tokens = await self.generate_batch(name, (input_ids, max_new_tokens))
        answer = {"adapter": name, "tokens": tokens}
        if self.tokenizer is not None:
            answer["text"] = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return answer

    async def generate(self, input_ids, max_new_tokens=16):
        """For a ``DeploymentHandle``: ``handle.options(multiplexed_model_id=name).generate.remote(...)``."""
        name = await self.load(serve.get_multiplexed_model_id())
        return await self.generate_batch(name, (list(map(int, input_ids)), int(max_new_tokens)))

    def stats(self):
        return {"adapters": self.adapters.stats(), "resident": self.adapters.names(),
                "routed": self.load.routed(), "batches": list(self.batches)}

    def _input_ids(self, body):
        if "input_ids" in body:
            return [int(t) for t in body["input_ids"]]
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: send input_ids")
        return self.tokenizer(str(body["prompt"]))["input_ids"]

    # --- one batch: several adapters, one generate --------------------------

    @batch(max_batch_size=MAX_BATCH_SIZE, batch_wait_timeout_s=BATCH_WAIT_S,
           max_adapters=MAX_ADAPTERS_PER_BATCH)
    async def generate_batch(self, names, items):
        # generate holds the GIL for long stretches: off the replica's event loop.
        return await asyncio.to_thread(self._generate, names, items)

    def _generate(self, names, items):
        self.batches.append(list(names))
        width = max(len(ids) for ids, _ in items)
        pad = self.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids, _ in items])
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _ in items])
        longest = max(n for _, n in items)  # the batch runs until its longest request is done
        with torch.inference_mode(), self.attached.sequences(names):
            out = self.model.generate(input_ids=input_ids, attention_mask=mask,
                                      max_new_tokens=longest, do_sample=False,
                                      pad_token_id=pad)
        return [out[i, width:width + n].tolist() for i, (_, n) in enumerate(items)]


def build_app(model_path, adapters_dir, replicas=1, adapters_per_replica=8, capacity_bytes=None,
              torch_threads=1):
    """The application: ``replicas`` copies of :class:`LoraLM`, adapters from ``adapters_dir``.

    ``capacity_bytes`` defaults to ``adapters_per_replica`` times the largest
    adapter found in ``adapters_dir`` (read here, from the safetensors
    headers), so Ray's count and the set's bytes agree.
    """
    if capacity_bytes is None:
        capacity_bytes = adapters_per_replica * _largest_adapter_bytes(adapters_dir)
    resolver = shared_resolver(os.path.abspath(adapters_dir))
    return LoraLM.options(num_replicas=replicas).bind(
        os.path.abspath(model_path), resolver, capacity_bytes, adapters_per_replica,
        torch_threads)


def _largest_adapter_bytes(adapters_dir):
    """The largest adapter's bytes as lorahook keeps it (float32), from the files' headers."""
    from safetensors import safe_open
    largest = 0
    for name in sorted(os.listdir(adapters_dir)):
        path = os.path.join(adapters_dir, name, "adapter_model.safetensors")
        if not os.path.isfile(path):
            continue
        with safe_open(path, framework="numpy") as f:
            total = sum(4 * int(np.prod(f.get_slice(k).get_shape())) for k in f.keys())
        largest = max(largest, total)
    if not largest:
        raise SystemExit(f"no PEFT adapters (<name>/adapter_model.safetensors) in {adapters_dir}")
    return largest


# --------------------------------------------------------------------------- --smoke


def start_ray(address="local", **kwargs):
    """``ray.init`` from this file's directory, then back to the current one.

    Ray puts the driver's working directory first on every worker's
    ``sys.path``; run from a lorahook source checkout, that directory's
    ``lorahook/`` (without its compiled core) would shadow the installed
    package in every replica.
    """
    here = os.getcwd()
    os.chdir(os.path.dirname(os.path.abspath(__file__)))
    try:
        ray.init(address=address, **kwargs)
    finally:
        os.chdir(here)


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _smoke_files(tmp):
    """A small random Llama and four random PEFT adapters under ``tmp``; returns their paths."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = transformers.LlamaForCausalLM(config).eval()
    model_path = os.path.join(tmp, "model")
    model.save_pretrained(model_path)
    geometry = geometry_of(model)
    adapters_dir = os.path.join(tmp, "adapters")
    names = ["support", "legal", "sql", "poetry"]
    for seed, name in enumerate(names):
        rng = np.random.default_rng(seed)
        layers = {}
        for layer_idx, module, d_in, d_out in geometry.projections():
            layers[(layer_idx, module)] = lorahook.LoraLayer(
                rng.standard_normal((8, d_in)) / np.sqrt(d_in),
                rng.standard_normal((d_out, 8)), scale=1.0)
        lorahook.LoraAdapter(layers).save_peft(os.path.join(adapters_dir, name),
                                               architecture="llama")
    return model_path, adapters_dir, names


def _reference(model_path, adapters_dir, names, prompt, max_new_tokens):
    """Each adapter's (and the base model's) tokens for ``prompt`` alone, in this process."""
    torch.set_num_threads(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    adapters = lorahook.AdapterSet(geometry_of(model), resolver=adapters_dir)
    attached = attach(model, adapters)
    out = {}
    for name in [None, *names]:
        with torch.inference_mode(), attached.sequences([name]):
            tokens = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                                    do_sample=False, pad_token_id=0)
        out[name] = tokens[0, len(prompt):].tolist()
    return out


def _post(port, body, adapter=None):
    import json
    import urllib.error
    import urllib.request
    headers = {"Content-Type": "application/json"}
    if adapter is not None:
        headers["serve_multiplexed_model_id"] = adapter
    req = urllib.request.Request(f"http://127.0.0.1:{port}/", data=json.dumps(body).encode(),
                                 headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def smoke():
    """Start a local Ray, deploy on a small random model, check handle and HTTP answers."""
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    deadline = time.monotonic() + 240
    with tempfile.TemporaryDirectory(prefix="lorahook-ray-smoke-") as tmp:
        model_path, adapters_dir, names = _smoke_files(tmp)
        prompt, new = [1, 17, 42, 99, 5, 23], 6
        want = _reference(model_path, adapters_dir, names, prompt, new)
        assert len({tuple(t) for t in want.values()}) > 1, "the adapters change nothing?"
        port = _free_port()
        start_ray("local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            # two replicas, each with room for the four adapters
            app = build_app(model_path, adapters_dir, replicas=2, adapters_per_replica=4)
            handle = serve.run(app, name="lora", route_prefix="/")

            # each adapter, and the base model, alone: the same tokens as in this process
            for name in [None, *names]:
                h = handle.options(multiplexed_model_id=name) if name else handle
                got = h.generate.remote(prompt, new).result(timeout_s=60)
                assert got == want[name], (name, got, want[name])
                print(f"{name or 'base model'}: {got}")

            # sixteen requests at once, several adapters per batch (a burst or three)
            calls = [(names[i % len(names)] if i % 5 else None) for i in range(16)]
            mixed = set()
            for _ in range(3):
                responses = [(handle.options(multiplexed_model_id=n) if n else handle)
                             .generate.remote(prompt, new) for n in calls]
                results = [r.result(timeout_s=120) for r in responses]
                assert all(len(r) == new for r in results)
                same = sum(r == want[n] for n, r in zip(calls, results))
                print(f"16 concurrent requests: {same}/16 equal the lone generation")
                for _ in range(20):  # the two replicas' stats (each call reaches one)
                    batches = handle.stats.remote().result(timeout_s=60)["batches"]
                    mixed.update(tuple(b) for b in batches if len({n for n in b if n}) >= 2)
                if mixed:
                    break
            print(f"batches holding two adapters: {len(mixed)}")
            assert mixed, "no batch mixed adapters"

            # HTTP: with the header, without it, an unknown adapter
            status, body = _post(port, {"input_ids": prompt, "max_new_tokens": new}, names[1])
            assert status == 200 and body["tokens"] == want[names[1]], (status, body)
            status, body = _post(port, {"input_ids": prompt, "max_new_tokens": new})
            assert status == 200 and body["adapter"] is None and body["tokens"] == want[None]
            status, body = _post(port, {"input_ids": prompt}, "no-such-adapter")
            assert status == 404 and "no-such-adapter" in body["error"], (status, body)
            print(f"HTTP: adapter, base model and 404 ({body['error']})")
            assert time.monotonic() < deadline, "the smoke test took too long"
        finally:
            try:
                serve.shutdown()
            finally:
                ray.shutdown()
    print("smoke test passed")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true",
                        help="run end to end on a small random model and exit")
    parser.add_argument("--model", help="a transformers causal LM directory (float32 on CPU)")
    parser.add_argument("--adapters", help="a directory of PEFT adapter directories, one per name")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--adapters-per-replica", type=int, default=8)
    parser.add_argument("--capacity-mb", type=float, default=None,
                        help="bytes of adapters per replica (default: adapters-per-replica x "
                             "the largest adapter)")
    parser.add_argument("--torch-threads", type=int, default=1, help="per replica")
    parser.add_argument("--address", default="local",
                        help="Ray address ('local' starts one; 'auto' joins a running cluster)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    if args.smoke:
        smoke()
        return 0
    if not args.model or not args.adapters:
        parser.error("--model and --adapters are required (or --smoke)")
    capacity = None if args.capacity_mb is None else int(args.capacity_mb * (1 << 20))
    start_ray(args.address)
    serve.start(http_options={"host": args.host, "port": args.port})
    app = build_app(args.model, args.adapters, args.replicas, args.adapters_per_replica,
                    capacity, args.torch_threads)
    serve.run(app, name="lora", route_prefix="/", blocking=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
