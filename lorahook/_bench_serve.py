"""``lorahook serve`` measured: mixed-adapter batches against one adapter per forward.

The model, tokenizer and adapters are made here (nothing is downloaded): a
word-level ``tokenizers`` tokenizer with a chat template over a fixed
vocabulary, a random Llama, random PEFT LoRA adapters.  :func:`run` starts the
server twice -- batches mixing adapters, then ``--max-adapters 1`` (one
adapter per forward, what a server without mixed batches does) -- and sends
both the same burst of concurrent streaming requests over several adapters:
requests per second and time to first token.  Used by the server tests
(the small model) and ``benchmarks/serve_bench.py``.
"""
import os
import warnings

WORDS = ("the a cat dog sat on mat red blue green fast slow runs jumps over under and or "
         "not yes no one two three four five six seven eight nine ten hello world what is "
         "why how who where when big small old new good bad sun moon star sky sea tree "
         "user assistant system say tell me you it this that").split()
SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant{% endif %}")


def tokenizer(chat=True):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>",
                                   chat_template=CHAT_TEMPLATE if chat else None)


def model(hidden=64, layers=2, intermediate=None, heads=4, kv_heads=2):
    import torch
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(SPECIAL) + len(WORDS), hidden_size=hidden,
        intermediate_size=intermediate or 2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=256, initializer_range=0.3, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)
    return transformers.LlamaForCausalLM(config).eval()


def save_model(path, chat=True, **size):
    model(**size).save_pretrained(path)
    tokenizer(chat).save_pretrained(path)
    return path


def save_adapter(path, seed, size=None, **lora):
    import torch
    from peft import LoraConfig, get_peft_model
    config = dict(r=8, lora_alpha=32, init_lora_weights=False,
                  target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])
    config.update(lora)
    base = model(**(size or {}))
    torch.manual_seed(seed)  # after the model, which seeds its own weights
    pm = get_peft_model(base, LoraConfig(**config))
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.mul_(3.0)  # an adapter that changes greedy tokens
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm.save_pretrained(path)
    return path


def save_all(tmp, names=("alpha", "beta", "gamma"), **size):
    model_dir = save_model(os.path.join(tmp, "tiny-llama"), **size)
    adapters = os.path.join(tmp, "adapters")
    for seed, name in enumerate(names):
        save_adapter(os.path.join(adapters, name), 100 + seed, size)
    return model_dir, adapters




# --------------------------------------------------------------------------- the benchmark


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir, adapters, *extra, cwd=None, lines=None):
    """A ``lorahook serve`` process; returns ``(process, base URL)`` once it answers.

    Its output lines are appended to ``lines`` (a list) as they come."""
    import subprocess
    import sys
    import threading
    port = _free_port()
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    proc = subprocess.Popen([sys.executable, "-m", "lorahook", "serve", model_dir, "--adapters",
                             adapters, "--port", str(port), *extra],
                            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    ready = threading.Event()
    lines = [] if lines is None else lines

    def read():
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("lorahook serve: http"):
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(300):
        proc.kill()
        raise RuntimeError("the server did not start:\n" + "".join(lines[-30:]))
    return proc, f"http://127.0.0.1:{port}"


def stop_server(proc):
    import signal
    proc.send_signal(signal.SIGTERM)
    return proc.wait(120)


def burst(url, names, requests=64, max_tokens=32):
    """``requests`` concurrent streaming completions over ``names``: (req/s, TTFT seconds)."""
    import concurrent.futures
    import json
    import time

    import httpx

    def one(i):
        start = time.perf_counter()
        first = None
        with httpx.stream("POST", url + "/v1/completions", timeout=600, json={
                "model": names[i % len(names)], "prompt": "the big red dog runs over the mat",
                "max_tokens": max_tokens, "temperature": 0, "stream": True}) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {") and first is None:
                    if json.loads(line[6:])["choices"][0]["text"] is not None:
                        first = time.perf_counter() - start
        return first

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(requests) as ex:
        ttft = list(ex.map(one, range(requests)))
    wall = time.perf_counter() - t0
    ttft.sort()
    return requests / wall, ttft[len(ttft) // 2]


def lone(url, name):
    """One request alone: (time to first streamed token, time of a 1-token completion)."""
    import time

    import httpx
    body = {"model": name, "prompt": "the big red dog runs over the mat", "temperature": 0}
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        httpx.post(url + "/v1/completions", json=dict(body, max_tokens=1), timeout=120)
        one = time.perf_counter() - t0
        t0 = time.perf_counter()
        with httpx.stream("POST", url + "/v1/completions", timeout=120,
                          json=dict(body, max_tokens=16, stream=True)) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    break
        times.append((time.perf_counter() - t0, one))
    times.sort()
    return times[len(times) // 2]


# Model shapes the benchmark serves (random weights, the test tokenizer's small vocabulary).
SIZES = {
    # a small model whose steps cost little next to HTTP streaming on a shared machine
    "small": dict(hidden=1024, layers=4),
    # the shape of a 0.5B decoder (Qwen2.5-0.5B's layers, as a Llama): what a CPU serves
    "0.5b": dict(hidden=896, layers=24, intermediate=4864, heads=14, kv_heads=2),
}


def run(workdir, size="0.5b", adapters=8, requests=64, max_tokens=32, max_batch_size=64,
        threads=1):
    """Both servers on the same burst; a dict of figures.

    Both run with ``--threads threads`` (the rest of the machine is left to
    Ray's proxy and the clients) and ``--max-batch-size max_batch_size``;
    they differ only in ``--max-adapters 1``.
    """
    names = [f"adapter{i}" for i in range(adapters)]
    model_dir, adapters_dir = save_all(workdir, names, **SIZES[size])
    out = {"size": size, "model": SIZES[size], "max_batch_size": max_batch_size,
           "threads": threads}
    for label, extra in (("mixed", ()), ("one adapter per forward", ("--max-adapters", "1"))):
        proc, url = start_server(model_dir, adapters_dir, "--max-batch-size",
                                 str(max_batch_size), "--threads", str(threads), *extra)
        try:
            burst(url, names, 8, 4)  # warm-up: every adapter resident
            before = _stats(url)
            rps, ttft = burst(url, names, requests, max_tokens)
            after = _stats(url)
            out[label] = {"requests_per_s": rps, "median_ttft_s": ttft,
                          "steps": after["steps"] - before["steps"],
                          "admissions": [f"{n} requests, {k} adapters running" for n, k in
                                         after["batches"][len(before["batches"]):]],
                          "lone_ttft_s, lone_1_token_s": lone(url, names[0])}
        finally:
            stop_server(proc)
    out["mixed / one adapter per forward (requests/s)"] = (
        out["mixed"]["requests_per_s"] / out["one adapter per forward"]["requests_per_s"])
    lone_ttft, one_token = out["mixed"]["lone_ttft_s, lone_1_token_s"]
    out["lone first token / one-token completion"] = lone_ttft / one_token
    return out


def _stats(url):
    import httpx
    return httpx.get(url + "/lorahook/stats", timeout=60).json()
