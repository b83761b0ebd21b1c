"""``lorahook serve`` end to end: a real server process, the official openai client, raw HTTP.

One server for the module (a local Ray, a small random Llama with a tokenizer made
here, three PEFT adapters), started the way a user starts it and stopped with
SIGTERM by the last test. Every answer is checked against transformers + PEFT run
adapter by adapter in this process.

Skips without Ray Serve, FastAPI, openai or httpx, unless LORAHOOK_REQUIRE_RAY=1
(as CI sets), which turns the skip into a failure.
"""
import concurrent.futures
import json
import os
import signal
import time

import pytest

from required import need as _need  # noqa: E402


for _module in ("ray.serve", "fastapi", "torch", "transformers", "peft", "tokenizers"):
    _need(_module)
openai = _need("openai")
httpx = _need("httpx")

import serve_files  # noqa: E402
from serve_files import start_server  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

KEY = "sk-lorahook-test"
NAMES = ("alpha", "beta", "gamma")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    model_dir, adapters = serve_files.save_all(str(tmp), NAMES)
    spare = serve_files.save_adapter(str(tmp / "spare"), 7)
    spare2 = serve_files.save_adapter(str(tmp / "spare2"), 8)
    lines = []
    try:
        proc, url = start_server(model_dir, adapters, "--api-key", KEY,
                                 "--allow-runtime-adapters", "--runtime-adapter-root", str(tmp),
                                 "--max-batch-size", "8",
                                 cwd=str(tmp), lines=lines)
    except RuntimeError as exc:
        pytest.fail(str(exc))
    info = dict(proc=proc, url=url, model_dir=model_dir,
                adapters=adapters, spare=spare, spare2=spare2, lines=lines,
                base=os.path.basename(model_dir))
    yield info
    if proc.poll() is None:
        proc.kill()
        proc.wait(30)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(server):
    import transformers
    return transformers.AutoTokenizer.from_pretrained(server["model_dir"])


def _reference(server, tokenizer, name, ids, n, adapter_dir=None):
    if adapter_dir is None and name != server["base"]:
        adapter_dir = os.path.join(server["adapters"], name)
    tokens = serve_files.peft_reference(server["model_dir"], adapter_dir, ids, n)
    tokens = tokens[:tokens.index(2)] if 2 in tokens else tokens
    return tokenizer.decode(tokens, skip_special_tokens=True)


def test_models_lists_the_base_model_and_every_adapter(server, client):
    ids = [m.id for m in client.models.list().data]
    assert ids == [server["base"], *sorted(NAMES)]


def test_greedy_completions_equal_peft_adapter_by_adapter(server, client, tokenizer):
    prompt = "the cat sat on the mat"
    ids = tokenizer(prompt)["input_ids"]
    answers = {}
    for name in (server["base"], *NAMES):
        r = client.completions.create(model=name, prompt=prompt, max_tokens=10, temperature=0)
        assert r.choices[0].text == _reference(server, tokenizer, name, ids, 10)
        assert r.usage.prompt_tokens == len(ids)
        assert r.usage.total_tokens == len(ids) + r.usage.completion_tokens
        answers[name] = r.choices[0].text
    assert len(set(answers.values())) == len(answers)  # the adapters do change the output
    r = client.completions.create(model="beta", prompt=ids, max_tokens=5, temperature=0)
    assert r.choices[0].text == _reference(server, tokenizer, "beta", ids, 5)


def test_chat_uses_the_chat_template(server, client, tokenizer):
    messages = [{"role": "user", "content": "hello tell me why the sky is blue"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    r = client.chat.completions.create(model="gamma", messages=messages, max_tokens=8,
                                       temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == _reference(server, tokenizer, "gamma", list(ids), 8)
    assert r.object == "chat.completion"


def test_streams_concatenate_to_the_text_and_end_with_done(server, client):
    kw = dict(model="alpha", prompt="one two three", max_tokens=12, temperature=0)
    whole = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    with httpx.stream("POST", server["url"] + "/v1/chat/completions", timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": "beta", "stream": True, "max_tokens": 6, "temperature": 0,
                            "messages": [{"role": "user", "content": "hello"}]}) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [line for line in resp.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    body = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert all(e["object"] == "chat.completion.chunk" for e in body)


def test_a_short_stream_ends_before_a_long_one_in_the_same_batch(server, client):
    ends = {}

    def run(name, n):
        stream = client.completions.create(model=name, prompt="the dog runs over the mat",
                                           max_tokens=n, temperature=0, stream=True)
        for chunk in stream:
            pass
        ends[name] = time.monotonic()

    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        futures = [ex.submit(run, "alpha", 2), ex.submit(run, "beta", 200)]
        for f in futures:
            f.result()
    # beta stops early only at its end-of-sequence token; it ran past alpha either way
    assert ends["alpha"] < ends["beta"]


def _admissions(server):
    return httpx.get(server["url"] + "/lorahook/stats", timeout=30,
                     headers={"Authorization": f"Bearer {KEY}"}).json()["batches"]


def test_a_request_joins_a_running_stream_and_ends_first(server, client, tokenizer):
    prompt = "the dog runs over the mat"
    before = len(_admissions(server))
    stream = iter(client.completions.create(model="beta", prompt=prompt, max_tokens=120,
                                            temperature=0, stream=True))
    chunks = [next(stream)]  # beta is decoding
    short = client.completions.create(model="alpha", prompt="hello", max_tokens=2,
                                      temperature=0)
    chunks += list(stream)
    # alpha joined beta's running batch (two adapters open) and finished while beta went on
    assert _admissions(server)[before:] == [[1, 1], [1, 2]]
    assert short.choices[0].text == _reference(server, tokenizer, "alpha",
                                               tokenizer("hello")["input_ids"], 2)
    ids = tokenizer(prompt)["input_ids"]
    assert "".join(c.choices[0].text for c in chunks) == _reference(server, tokenizer, "beta",
                                                                     ids, 120)


def test_a_client_that_disconnects_frees_its_row(server, client):
    kw = dict(model="beta", prompt="the dog runs over the mat", max_tokens=240, temperature=0)
    assert client.completions.create(**kw).choices[0].finish_reason == "length"
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", server["url"] + "/v1/completions", headers=headers, timeout=60,
                      json=dict(kw, stream=True)) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                break  # one chunk, then hang up
    start = httpx.get(server["url"] + "/lorahook/stats", headers=headers, timeout=30).json()["steps"]
    time.sleep(1.0)
    steps = httpx.get(server["url"] + "/lorahook/stats", headers=headers, timeout=30).json()["steps"]
    assert steps - start < 120  # the request left its batch, far short of its 240 tokens


def test_concurrent_mixed_requests_are_all_right(server, client, tokenizer):
    names = [server["base"], *NAMES]
    prompt = "what is the big red star"
    ids = tokenizer(prompt)["input_ids"]
    want = {n: _reference(server, tokenizer, n, ids, 8) for n in names}

    def ask(i):
        name = names[i % len(names)]
        return name, client.completions.create(model=name, prompt=prompt, max_tokens=8,
                                               temperature=0).choices[0].text

    before = len(httpx.get(server["url"] + "/lorahook/stats", timeout=30,
                           headers={"Authorization": f"Bearer {KEY}"}).json()["batches"])
    with concurrent.futures.ThreadPoolExecutor(24) as ex:
        got = list(ex.map(ask, range(24)))
    assert [text for _, text in got] == [want[name] for name, _ in got]
    batches = httpx.get(server["url"] + "/lorahook/stats", timeout=30,
                        headers={"Authorization": f"Bearer {KEY}"}).json()["batches"][before:]
    assert sum(n for n, _ in batches) == 24
    assert max(k for _, k in batches) >= 2  # requests for different adapters shared a batch


def test_errors_are_openai_error_objects(server, client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="nope", prompt="the", max_tokens=2)
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    for bad, param in ((dict(max_tokens=0), "max_tokens"), (dict(temperature=5), "temperature"),
                       (dict(n=2), "n"), (dict(prompt=[10 ** 6]), "prompt")):
        kw = dict(model="alpha", prompt="the", max_tokens=2)
        kw.update(bad)
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(**kw)
        assert info.value.body["param"] == param, (bad, info.value.body)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server["url"] + "/v1", api_key="wrong",
                      max_retries=0).models.list()
    resp = httpx.post(server["url"] + "/v1/completions", json={"model": "alpha"}, timeout=30)
    assert resp.status_code == 401 and set(resp.json()["error"]) == {"message", "type", "param",
                                                                      "code"}
    assert httpx.get(server["url"] + "/health", timeout=30).status_code == 200
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    for path in ("/v1/completions", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        for body in (b"{not json", b"[1, 2]"):
            resp = httpx.post(server["url"] + path, content=body, headers=headers, timeout=30)
            assert resp.status_code == 400, (path, body, resp.text)
            assert resp.json()["error"]["type"] == "invalid_request_error"


def test_runtime_adapters_load_reload_and_unload(server, client, tokenizer):
    headers = {"Authorization": f"Bearer {KEY}"}
    ids = tokenizer("the sun and the moon")["input_ids"]

    def ask():
        return client.completions.create(model="extra", prompt="the sun and the moon",
                                         max_tokens=8, temperature=0).choices[0].text

    with pytest.raises(openai.NotFoundError):
        ask()
    r = httpx.post(server["url"] + "/v1/load_lora_adapter", headers=headers, timeout=60,
                   json={"lora_name": "extra", "lora_path": server["spare"]})
    assert r.status_code == 200, r.text
    assert "extra" in [m.id for m in client.models.list().data]
    assert ask() == _reference(server, tokenizer, "extra", ids, 8, server["spare"])
    # a reload while a request decodes: that request keeps the old version to its end
    running = iter(client.completions.create(model="extra", prompt="the sun and the moon",
                                             max_tokens=200, temperature=0, stream=True))
    chunks = [next(running)]
    r = httpx.post(server["url"] + "/v1/load_lora_adapter", headers=headers, timeout=60,
                   json={"lora_name": "extra", "lora_path": server["spare2"]})
    assert r.status_code == 400 and "load_inplace" in r.json()["error"]["message"]
    r = httpx.post(server["url"] + "/v1/load_lora_adapter", headers=headers, timeout=60,
                   json={"lora_name": "extra", "lora_path": server["spare2"],
                         "load_inplace": True})
    assert r.status_code == 200
    assert ask() == _reference(server, tokenizer, "extra", ids, 8, server["spare2"])
    chunks += list(running)
    assert "".join(c.choices[0].text for c in chunks) == _reference(
        server, tokenizer, "extra", ids, 200, server["spare"])
    r = httpx.post(server["url"] + "/v1/unload_lora_adapter", headers=headers, timeout=60,
                   json={"lora_name": "extra"})
    assert r.status_code == 200
    with pytest.raises(openai.NotFoundError):
        ask()
    r = httpx.post(server["url"] + "/v1/load_lora_adapter", headers=headers, timeout=60,
                   json={"lora_name": "broken", "lora_path": server["model_dir"] + "/nope"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"


def test_sigterm_stops_the_server_with_exit_0(server):
    proc = server["proc"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(120) == 0, "".join(server["lines"][-30:])
