"""``lorahook serve`` against hostile clients: each bad request gets its own answer, nobody else's.

Two live servers (a local Ray each, the tests' tiny Llama and PEFT adapters):

- ``guarded``: a key read from a file, runtime adapters under a root,
  ``--max-model-len 64``, a 64 KiB body bound, and an adapter whose weights
  overflow (non-finite logits);
- ``bounded``: no key, room for one adapter (``--capacity-bytes``), two rows
  per batch, two queued requests, a 6 s request timeout, a model whose
  context is long enough for a request to outlast it.

In every test the bad request gets its answer -- an OpenAI error object with
the right status and parameter, or an error event then ``[DONE]`` -- while a
good stream sent at the same time equals transformers + PEFT's greedy tokens
and ends with ``[DONE]``.
"""
import concurrent.futures
import json
import os

import numpy as np
import pytest

from required import need as _need  # noqa: E402

for _module in ("ray.serve", "fastapi", "torch", "transformers", "peft", "tokenizers",
                "safetensors"):
    _need(_module)
httpx = _need("httpx")

import serve_files  # noqa: E402
from serve_files import start_server, stop_server  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

KEY = "sk-hostile-test"
PROMPT = "the big red dog runs over the mat"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _overflowing(path, seed):
    """A PEFT adapter whose B factors are so large that the model's logits overflow."""
    from safetensors.numpy import load_file, save_file
    serve_files.save_adapter(path, seed)
    weights = os.path.join(path, "adapter_model.safetensors")
    tensors = load_file(weights)
    save_file({k: (v * np.float32(1e36) if "lora_B" in k else v) for k, v in tensors.items()},
              weights)
    return path


def _never_ending(model_dir):
    """The model without an end-of-sequence token (and a zero logit for the old one).

    Its completions end at max_tokens only, so a long one outlasts the timeout.
    """
    from safetensors.numpy import load_file, save_file
    weights = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(weights)
    tensors["lm_head.weight"][2] = 0  # the other logits' largest is positive
    save_file(tensors, weights, metadata={"format": "pt"})
    path = os.path.join(model_dir, "generation_config.json")  # and no token ends it
    with open(path) as f:
        config = json.load(f)
    config["eos_token_id"] = []
    with open(path, "w") as f:
        json.dump(config, f)


def _start(tmp, *extra, context=256):
    model_dir = serve_files.save_model(os.path.join(tmp, "tiny-llama"), context=context)
    if context > 256:
        _never_ending(model_dir)
    adapters = os.path.join(tmp, "adapters")
    for seed, name in enumerate(("alpha", "beta")):
        serve_files.save_adapter(os.path.join(adapters, name), 100 + seed)
    lines = []
    try:
        proc, url = start_server(model_dir, adapters, *extra, cwd=tmp, lines=lines)
    except RuntimeError as exc:
        pytest.fail(str(exc))
    return dict(proc=proc, url=url, model_dir=model_dir, adapters=adapters, lines=lines,
                base=os.path.basename(model_dir), tmp=tmp)


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("guarded"))
    root = os.path.join(tmp, "runtime")
    serve_files.save_adapter(os.path.join(root, "spare"), 7)
    key_file = os.path.join(tmp, "key")
    with open(key_file, "w") as f:
        f.write(KEY + "\n")
    # the adapters directory gets the overflowing adapter before the server starts
    _overflowing(os.path.join(tmp, "adapters", "overflow"), 9)
    server = _start(tmp, "--api-key-file", key_file, "--allow-runtime-adapters",
                    "--runtime-adapter-root", root, "--max-model-len", "64",
                    "--max-body-bytes", "65536", "--max-batch-size", "8")
    server["root"] = root
    yield server
    stop_server(server["proc"])


@pytest.fixture(scope="module")
def bounded(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("bounded"))
    root = os.path.join(tmp, "runtime")
    os.makedirs(root)
    one = _adapter_bytes(tmp)
    serve_files.save_adapter(os.path.join(tmp, "adapters", "huge"), 5, r=64)
    server = _start(tmp, "--capacity-bytes", str(one + one // 2), "--max-batch-size", "2",
                    "--max-queued-requests", "2", "--request-timeout", "6",
                    "--allow-runtime-adapters", "--runtime-adapter-root", root, context=16384)
    yield server
    stop_server(server["proc"])


def _adapter_bytes(tmp):
    """Bytes lorahook keeps for one of the tests' adapters."""
    import lorahook
    return lorahook.LoraAdapter.from_peft(serve_files.save_adapter(os.path.join(tmp, "probe"),
                                                                   1)).nbytes


@pytest.fixture(scope="module")
def tokenizer(guarded):
    import transformers
    return transformers.AutoTokenizer.from_pretrained(guarded["model_dir"])


def reference(server, name, max_tokens):
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(server["model_dir"])
    ids = tok(PROMPT)["input_ids"]
    adapter_dir = None if name == server["base"] else os.path.join(server["adapters"], name)
    tokens = serve_files.peft_reference(server["model_dir"], adapter_dir, ids, max_tokens)
    tokens = tokens[:tokens.index(2)] if 2 in tokens else tokens
    return tok.decode(tokens, skip_special_tokens=True)


def stream(server, model="alpha", max_tokens=24, headers=AUTH, **extra):
    """A streamed completion: (the text, the events after the last text, whether it ended with [DONE])."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, **extra}
    text, events = [], []
    with httpx.stream("POST", server["url"] + "/v1/completions", headers=headers, json=body,
                      timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if line[6:] != "[DONE]":
                event = json.loads(line[6:])
                if "choices" in event:
                    text.append(event["choices"][0]["text"])
    return "".join(text), events


def post(server, path, body=None, headers=AUTH, content=None, **kw):
    return httpx.post(server["url"] + path, json=body if content is None else None,
                      content=content, headers=headers, timeout=120, **kw)


def is_error(resp, status, param=None):
    assert resp.status_code == status, (resp.status_code, resp.text)
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["param"] == param, error
    return error["message"]


def beside_a_good_stream(server, bad, model="alpha", max_tokens=24):
    """Run ``bad()`` while a good stream runs; check the stream, return ``bad()``'s result."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        good = pool.submit(stream, server, model, max_tokens,
                           headers=AUTH if server.get("root") else {})
        result = bad()
        text, events = good.result()
    assert events[-1] == "[DONE]"
    assert text == reference(server, model, max_tokens)
    return result


# --------------------------------------------------------------------------- isolation


def test_an_adapter_with_non_finite_logits_fails_alone(guarded):
    def bad():
        return (post(guarded, "/v1/completions", {"model": "overflow", "prompt": PROMPT,
                                                  "max_tokens": 8, "temperature": 0}),
                stream(guarded, "overflow", 8))

    whole, (text, events) = beside_a_good_stream(guarded, bad)
    assert "not finite" in is_error(whole, 500)
    assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])


def test_sampling_parameters_that_cannot_sample_are_refused_or_safe(guarded):
    def bad():
        zero = post(guarded, "/v1/completions", {"model": "alpha", "prompt": PROMPT, "top_p": 0})
        tiny, _ = stream(guarded, "beta", 8, temperature=1e-30)  # greedy, not an overflow
        return zero, tiny

    zero, tiny = beside_a_good_stream(guarded, bad)
    is_error(zero, 400, "top_p")
    assert tiny == reference(guarded, "beta", 8)


# --------------------------------------------------------------------------- context


def test_prompts_and_max_tokens_must_fit_the_context(guarded):
    def bad():
        long = post(guarded, "/v1/completions", {"model": "alpha", "prompt": "the " * 70})
        many = post(guarded, "/v1/completions",
                    {"model": "alpha", "prompt": PROMPT, "max_tokens": 1 << 20})
        huge = post(guarded, "/v1/completions", {"model": "alpha", "prompt": "the " * 300_000})
        return long, many, huge

    long, many, huge = beside_a_good_stream(guarded, bad)
    assert "context is 64 tokens" in is_error(long, 400, "prompt")
    assert "context is 64 tokens" in is_error(many, 400, "max_tokens")
    is_error(huge, 413)


# --------------------------------------------------------------------------- capacity


def test_an_adapter_that_does_not_fit_beside_a_running_one_waits_for_it(bounded):
    # room for one adapter: beta's request waits until alpha's stream ends, and neither fails
    def bad():
        return stream(bounded, "beta", 8, headers={})

    text, events = beside_a_good_stream(bounded, bad, "alpha", 40)
    assert events[-1] == "[DONE]" and text == reference(bounded, "beta", 8)
    resp = post(bounded, "/v1/completions", {"model": "huge", "prompt": PROMPT}, headers={})
    assert "cannot be made resident" in is_error(resp, 503, "model")


# --------------------------------------------------------------------------- runtime adapters


def _load(server, name, path, **extra):
    return post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path, **extra})


def test_runtime_adapters_come_only_from_under_the_root(guarded, tmp_path):
    outside = serve_files.save_adapter(str(tmp_path / "outside"), 11)
    os.symlink(outside, os.path.join(guarded["root"], "link"))
    broken = os.path.join(guarded["root"], "broken")
    os.makedirs(broken)
    with open(os.path.join(broken, "adapter_config.json"), "wb") as f:
        f.write(b'{"peft_type": "LORA", "r": "\xff\xfe SECRET-BYTES"}')

    def bad():
        return (_load(guarded, "x", outside), _load(guarded, "y", os.path.join(guarded["root"], "link")),
                _load(guarded, "z", broken), _load(guarded, "w", guarded["model_dir"]))

    for resp in beside_a_good_stream(guarded, bad):
        message = is_error(resp, 400, "lora_path")
        assert "SECRET" not in message and "\\x" not in message and "xff" not in message


def test_a_served_name_is_replaced_only_in_place_and_unloaded_names_are_gone(guarded):
    spare = os.path.join(guarded["root"], "spare")

    def bad():
        return _load(guarded, "alpha", spare)

    assert "load_inplace" in is_error(beside_a_good_stream(guarded, bad, "beta"), 400, "lora_name")
    assert _load(guarded, "extra", spare).status_code == 200
    assert "load_inplace" in is_error(_load(guarded, "extra", spare), 400, "lora_name")
    assert _load(guarded, "extra", spare, load_inplace=True).status_code == 200
    for alias in ("extra/v1", "extra/v2", "extra/v3", "alpha/v1"):
        resp = post(guarded, "/v1/completions", {"model": alias, "prompt": PROMPT})
        assert resp.status_code in (400, 404), (alias, resp.text)
    assert post(guarded, "/v1/unload_lora_adapter", {"lora_name": "extra"}).status_code == 200
    is_error(post(guarded, "/v1/completions", {"model": "extra", "prompt": PROMPT}), 404, "model")
    is_error(post(guarded, "/v1/unload_lora_adapter", {"lora_name": "extra"}), 404, "lora_name")


def test_runtime_adapters_without_a_key_warn_at_start_up(bounded):
    assert any("runtime adapters are allowed without an API key" in line
               for line in bounded["lines"])


# --------------------------------------------------------------------------- bounds


def test_bodies_content_types_and_nesting_are_bounded(guarded):
    deep = b'{"model": "alpha", "prompt": ' + b"[" * 100 + b"]" * 100 + b"}"

    def bad():
        return (post(guarded, "/v1/completions", content=b"x" * 70_000,
                     headers={**AUTH, "Content-Type": "application/json"}),
                post(guarded, "/v1/completions", content=json.dumps(
                    {"model": "alpha", "prompt": PROMPT}).encode(),
                    headers={**AUTH, "Content-Type": "text/plain"}),
                post(guarded, "/v1/completions", content=b'{"model": "alpha"}', headers=AUTH),
                post(guarded, "/v1/completions", content=deep,
                     headers={**AUTH, "Content-Type": "application/json"}),
                httpx.get(guarded["url"] + "/no/such/path", headers=AUTH, timeout=60))

    big, plain, missing, nested, unknown = beside_a_good_stream(guarded, bad)
    is_error(big, 413)
    is_error(plain, 415)
    is_error(missing, 415)
    assert "deeper than 64" in is_error(nested, 400)
    is_error(unknown, 404)


def test_unsupported_parameters_are_refused_by_name_and_chat_takes_max_completion_tokens(guarded):
    def bad():
        return [post(guarded, "/v1/completions", {"model": "alpha", "prompt": PROMPT, name: value})
                for name, value in (("logprobs", 2), ("echo", True), ("logit_bias", {"5": 10}),
                                    ("presence_penalty", 1.0), ("stop", "s" * 300))]

    answers = beside_a_good_stream(guarded, bad)
    for resp, name in zip(answers, ("logprobs", "echo", "logit_bias", "presence_penalty", "stop")):
        is_error(resp, 400, name)
    chat = post(guarded, "/v1/chat/completions", {
        "model": "alpha", "messages": [{"role": "user", "content": "hello"}],
        "max_completion_tokens": 3, "temperature": 0})
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] <= 3


def test_a_full_queue_is_a_503_and_a_request_past_its_deadline_ends_with_an_error(bounded):
    # a stream long enough to outlast the 6 s timeout holds one of the two rows
    def long_stream():
        return stream(bounded, bounded["base"], 16000, headers={})

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        held = pool.submit(long_stream)
        good = pool.submit(stream, bounded, bounded["base"], 16, headers={})
        good_text, good_events = good.result()
        burst = [pool.submit(post, bounded, "/v1/completions",
                             {"model": bounded["base"], "prompt": PROMPT, "max_tokens": 16000},
                             headers={}) for _ in range(6)]
        answers = [f.result() for f in burst]
        text, events = held.result()
    assert good_events[-1] == "[DONE]" and good_text == reference(bounded, bounded["base"], 16)
    statuses = sorted(r.status_code for r in answers)
    assert 503 in statuses and set(statuses) <= {503, 504}, [r.text[-300:] for r in answers if r.status_code == 200]
    for resp in answers:
        is_error(resp, resp.status_code)
    assert events[-1] == "[DONE]"
    assert "timeout" in json.loads(events[-2])["error"]["message"]


# --------------------------------------------------------------------------- authentication


def test_every_endpoint_but_health_needs_the_key(guarded):
    def bad():
        out = {}
        for method, path in (("GET", "/v1/models"), ("GET", "/lorahook/stats"),
                             ("POST", "/v1/completions"), ("POST", "/v1/load_lora_adapter"),
                             ("GET", "/docs"), ("GET", "/openapi.json")):
            out[path] = httpx.request(method, guarded["url"] + path, timeout=60,
                                      headers={"Authorization": "Bearer wrong"})
        out["health"] = httpx.get(guarded["url"] + "/health", timeout=60)
        out["lower"] = httpx.get(guarded["url"] + "/v1/models", timeout=60,
                                 headers={"Authorization": f"bearer {KEY}"})
        return out

    out = beside_a_good_stream(guarded, bad)
    for path in ("/v1/models", "/lorahook/stats", "/v1/completions", "/v1/load_lora_adapter"):
        is_error(out[path], 401)
    assert out["/docs"].status_code in (401, 404) and out["/openapi.json"].status_code in (401, 404)
    assert out["health"].status_code == 200 and out["lower"].status_code == 200
