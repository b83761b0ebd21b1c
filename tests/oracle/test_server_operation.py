"""``lorahook serve`` in operation: loopback, draining on SIGTERM, a cluster that loses a node,
and Ray Serve's own tooling (``serve run`` of a config file, a redeployment under load).

Every server and cluster here runs on this machine on loopback, with bounded
traffic, and is stopped by its test.  Skips without Ray Serve, torch,
transformers, PEFT or httpx, unless LORAHOOK_REQUIRE_RAY=1 (as CI sets).
"""
import concurrent.futures
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

from required import need as _need  # noqa: E402

for _module in ("ray.serve", "fastapi", "torch", "transformers", "peft", "tokenizers", "yaml"):
    _need(_module)
httpx = _need("httpx")
psutil = _need("psutil")

import serve_files  # noqa: E402
from serve_files import start_server  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

HERE = os.path.dirname(os.path.abspath(__file__))
LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
PROMPT = "the dog runs over the mat"
# a model slow enough, and a context long enough, for a stream of several seconds
SIZE = dict(hidden=128, layers=4, context=4096)
DRAIN_S = 1.5


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("operation")
    model_dir, adapters = serve_files.save_all(str(tmp), ("alpha", "beta"), **SIZE)
    _never_ends(model_dir)
    other = os.path.join(str(tmp), "adapters2")
    serve_files.save_adapter(os.path.join(other, "alpha"), 100, SIZE)
    serve_files.save_adapter(os.path.join(other, "delta"), 300, SIZE)
    runtime = serve_files.save_adapter(os.path.join(str(tmp), "runtime", "rt"), 200,
                                       SIZE)
    return dict(tmp=str(tmp), model_dir=model_dir, adapters=adapters, other=other,
                runtime=runtime, base=os.path.basename(model_dir))


def _never_ends(model_dir):
    """The end-of-sequence token's logit held at 0, below the largest of the others: greedy
    streams run to ``max_tokens``."""
    import torch
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        model.lm_head.weight[2] = 0
    model.save_pretrained(model_dir)


def _tree(proc):
    root = psutil.Process(proc.pid)
    return [root, *root.children(recursive=True)]


def _alive(processes):
    alive = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.NoSuchProcess:
            pass
    return alive


def _stream(url, model, max_tokens, timeout=120, first=None):
    """A streamed completion: ``(status, events)``; events are parsed JSON or ``"[DONE]"``.

    ``first()`` is called once the first event has come."""
    events = []
    with httpx.stream("POST", url + "/v1/completions", timeout=timeout,
                      json=dict(model=model, prompt=PROMPT, max_tokens=max_tokens,
                                temperature=0, stream=True)) as resp:
        if resp.status_code != 200:
            resp.read()
            return resp.status_code, [resp.json()]
        for line in resp.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
                if first is not None and len(events) == 1:
                    first()
    return 200, events


def _finished(events):
    """Whether a stream ended as a completion does: a finish reason, then ``[DONE]``."""
    return (len(events) >= 2 and events[-1] == "[DONE]" and "error" not in events[-2]
            and events[-2]["choices"][0]["finish_reason"] in ("stop", "length"))


def _peft_text(files, adapter_dir, max_tokens=6):
    """The greedy text transformers (+ PEFT with ``adapter_dir``) gives for ``PROMPT``."""
    import transformers
    tokenizer = transformers.AutoTokenizer.from_pretrained(files["model_dir"])
    ids = tokenizer(PROMPT)["input_ids"]
    tokens = serve_files.peft_reference(files["model_dir"], adapter_dir, ids, max_tokens)
    return tokenizer.decode(tokens, skip_special_tokens=True)


def _complete(url, model, max_tokens=6, timeout=120):
    r = httpx.post(url + "/v1/completions", timeout=timeout,
                   json=dict(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0))
    return r.status_code, r.json()


# --------------------------------------------------------------------------- one server, local Ray


@pytest.fixture(scope="module")
def local_server(files):
    lines = []
    try:
        proc, url = start_server(files["model_dir"], files["adapters"], "--replicas", "2",
                                 "--threads", "1", "--drain-timeout", str(DRAIN_S),
                                 cwd=files["tmp"], lines=lines)
    except RuntimeError as exc:
        pytest.fail(str(exc))
    yield dict(proc=proc, url=url, lines=lines)
    if proc.poll() is None:
        proc.kill()
        proc.wait(30)


def test_nothing_listens_beyond_loopback_but_serve_replica_grpc(local_server):
    beyond = []
    replicas = set()
    for p in _tree(local_server["proc"]):
        try:
            title = " ".join(p.cmdline())
            listening = [c.laddr for c in p.net_connections(kind="inet") if c.status == "LISTEN"]
        except psutil.Error:
            continue
        if "ServeReplica:lorahook:LorahookServer" in title:
            replicas.add(p.pid)
        beyond += [(addr.ip, addr.port, title[:80], p.pid) for addr in listening
                   if addr.ip not in ("127.0.0.1", "::ffff:127.0.0.1", "::1")]
    assert len(replicas) == 2
    # Ray Serve binds each replica's gRPC server to all interfaces, whatever it is told
    assert [pid for *_, pid in beyond if pid not in replicas] == [], beyond
    assert sorted(pid for *_, pid in beyond) == sorted(replicas), beyond


def test_sigterm_drains_then_stops_with_exit_0(local_server, files):
    url, proc = local_server["url"], local_server["proc"]
    processes = _tree(proc)
    results = {}
    started = threading.Barrier(3)

    def run(name, model, max_tokens):
        # every stream is decoding before the signal
        status, events = _stream(url, model, max_tokens, first=lambda: started.wait(60))
        results[name] = (events, time.monotonic())

    with concurrent.futures.ThreadPoolExecutor(3) as ex:
        futures = [ex.submit(run, "short", "alpha", 30), ex.submit(run, "long", "beta", 4000)]
        started.wait(60)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while not any("draining" in line for line in local_server["lines"]):
            assert time.monotonic() < deadline, "".join(local_server["lines"][-20:])
            time.sleep(0.05)
        # a new request is refused at once: a 503 error object, or no connection at all
        try:
            status, body = _complete(url, "alpha", timeout=30)
            assert status == 503 and body["error"]["code"] == "shutting_down", body
        except httpx.ConnectError:
            pass
        late = ex.submit(_complete, url, "beta", 4000)  # never admitted either
        for f in futures:
            f.result(timeout=120)
        try:
            status, body = late.result(timeout=120)
            assert status == 503, body
        except httpx.TransportError:
            pass
    assert proc.wait(60) == 0
    stopped = time.monotonic()
    # the stream admitted before the signal finished as it would have
    short, _ = results["short"]
    assert _finished(short), short[-3:]
    # the one still running when the drain ended got an error event, then [DONE]
    long, ended = results["long"]
    assert long[-1] == "[DONE]" and long[-2].get("error", {}).get("code") == "shutting_down", (
        long[-3:], len(long), ended - signalled)
    assert DRAIN_S <= ended - signalled < DRAIN_S + 10
    assert stopped - signalled < DRAIN_S + 30
    assert any("lorahook serve: stopped" in line for line in local_server["lines"])
    time.sleep(1.0)
    assert _alive(processes) == []  # no process of the server's is left behind


# --------------------------------------------------------------------------- a cluster of nodes


class Driver:
    """``tests/support/ray_driver.py`` in a process of its own: a loopback cluster, driven by commands."""

    def __init__(self, nodes, port=None):
        env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", **LOOPBACK)
        argv = [sys.executable, os.path.join(HERE, "..", "support", "ray_driver.py"), str(nodes)]
        self.proc = subprocess.Popen(argv + ([str(port)] if port else []), cwd=HERE, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.answers = queue.Queue()
        self.lines = []
        # every line is read as it comes (a full pipe would stop the driver)
        threading.Thread(target=self._read, daemon=True).start()
        self.address = self._answer("address", 180, "start").split()[1]

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.split()[:1] in (["address"], ["added"], ["removed"], ["deployed"], ["error"]):
                self.answers.put(line.strip())

    def _answer(self, word, timeout, command):
        try:
            got = self.answers.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"{command}: no answer in {timeout} s; the driver said:\n"
                                 + "".join(self.lines[-30:])) from None
        assert got.split()[0] == word, (command, got)
        return got

    def do(self, command, timeout=300):
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        done = {"add": "added", "remove": "removed", "deploy": "deployed"}
        return self._answer(done[command.split(" ", 1)[0]], timeout, command[:40])

    def close(self):
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(120)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(30)


def _replica_ids(url, key, want, timeout):
    """Stats from replicas until ``want`` distinct ones have answered (or ``timeout``)."""
    seen = set()
    end = time.monotonic() + timeout
    while len(seen) < want and time.monotonic() < end:
        try:
            r = httpx.get(url + "/lorahook/stats", timeout=10,
                          headers={"Authorization": f"Bearer {key}"})
            if r.status_code == 200:
                seen.add(r.json()["replica"])
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    return seen


def test_a_cluster_keeps_serving_when_a_node_is_lost(files):
    key = "sk-cluster"
    driver = Driver(2)
    proc = None
    try:
        proc, url = start_server(files["model_dir"], files["adapters"], "--address",
                                 driver.address, "--replicas", "2", "--threads", "1",
                                 "--api-key", key, "--allow-runtime-adapters",
                                 "--runtime-adapter-root", files["tmp"], "--request-timeout",
                                 "60", cwd=files["tmp"], env=LOOPBACK)
        auth = {"Authorization": f"Bearer {key}"}
        client = httpx.Client(base_url=url, headers=auth, timeout=120)
        r = client.post("/v1/load_lora_adapter",
                        json={"lora_name": "rt", "lora_path": files["runtime"]})
        assert r.status_code == 200, r.text
        assert len(_replica_ids(url, key, 2, 60)) == 2  # one replica on each node

        def ask(i):
            model = ("alpha", "rt", files["base"])[i % 3]
            r = client.post("/v1/completions", json=dict(model=model, prompt=PROMPT,
                                                         max_tokens=6, temperature=0))
            return model, r.status_code, r.json()

        want = {"alpha": _peft_text(files, os.path.join(files["adapters"], "alpha")),
                "rt": _peft_text(files, files["runtime"]), files["base"]: _peft_text(files, None)}
        with concurrent.futures.ThreadPoolExecutor(6) as ex:
            before = list(ex.map(ask, range(6)))
        assert all(s == 200 and body["choices"][0]["text"] == want[m] for m, s, body in before)

        # the node that is not the head goes while streams run on both replicas
        def stream(_):
            start = time.monotonic()
            try:
                status, events = _stream(url, "beta", 3000, timeout=90)
            except httpx.TransportError as exc:
                return "transport", type(exc).__name__, time.monotonic() - start
            return status, events[-2:], time.monotonic() - start

        with concurrent.futures.ThreadPoolExecutor(4) as ex:
            running = [ex.submit(stream, i) for i in range(4)]
            time.sleep(1.0)
            driver.do("remove", 90)
            ended = [f.result(timeout=120) for f in running]
        # each ended, finished or with an error, well within its deadline: none hung
        assert all(took < 60 + 5 for *_, took in ended), ended

        # later requests are served by the survivor, runtime adapters included
        time.sleep(5)
        with concurrent.futures.ThreadPoolExecutor(4) as ex:
            after = list(ex.map(ask, range(12)))
        assert [(m, s) for m, s, _ in after] == [(m, 200) for m, _, _ in after], after
        assert all(body["choices"][0]["text"] == want[m] for m, _, body in after)

        # a node joins: Serve brings the second replica back on it
        driver.do("add")
        assert len(_replica_ids(url, key, 2, 180)) == 2
        with concurrent.futures.ThreadPoolExecutor(4) as ex:
            again = list(ex.map(ask, range(8)))
        assert [s for _, s, _ in again] == [200] * 8, again
        assert all(body["choices"][0]["text"] == want[m] for m, _, body in again)
        assert serve_files.stop_server(proc) == 0
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(30)
        driver.close()


# --------------------------------------------------------------------------- Ray Serve's tooling


def _config(files, port, adapters):
    """A Serve config file as the README gives it, for this machine."""
    return {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [{
            "name": "lorahook", "route_prefix": "/",
            "import_path": "lorahook.server.app:app_builder",
            "args": {"model_dir": files["model_dir"], "adapters": adapters, "replicas": 1,
                     "threads": 1, "drain_timeout": 30},
        }],
    }


def _healthy(url, timeout):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    return False


def test_serve_run_of_a_config_file_serves_the_adapters(files, tmp_path):
    import yaml
    port = serve_files._free_port()
    config = tmp_path / "lorahook.yaml"
    config.write_text(yaml.safe_dump(_config(files, port, files["adapters"])))
    serve_cli = os.path.join(os.path.dirname(sys.executable), "serve")
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", **LOOPBACK)
    proc = subprocess.Popen([serve_cli, "run", str(config)], cwd=str(tmp_path), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        assert _healthy(url, 300), "serve run did not answer"
        for model, adapter in (("alpha", os.path.join(files["adapters"], "alpha")),
                               (files["base"], None)):
            status, body = _complete(url, model, 6)
            assert status == 200, body
            assert body["choices"][0]["text"] == _peft_text(files, adapter)
        processes = _tree(proc)
        proc.send_signal(signal.SIGINT)
        proc.wait(120)
        time.sleep(1.0)
        assert _alive(processes) == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def test_a_redeployment_with_new_options_under_load_fails_no_request(files):
    port = serve_files._free_port()
    url = f"http://127.0.0.1:{port}"
    args = _config(files, port, files["adapters"])["applications"][0]["args"]
    driver = Driver(2, port)
    try:
        driver.do("deploy " + json.dumps(args))
        assert _complete(url, "beta")[0] == 200
        stop = threading.Event()

        def streams():
            got = []
            while not stop.is_set():
                got.append(_stream(url, "alpha", 400))
            return got

        def completions():
            got = []
            while not stop.is_set():
                got.append(_complete(url, files["base"], 20))
            return got

        with concurrent.futures.ThreadPoolExecutor(4) as ex:
            load = [ex.submit(streams), ex.submit(streams), ex.submit(completions)]
            time.sleep(2.0)
            # the same application, another adapters directory, while requests stream
            driver.do("deploy " + json.dumps(dict(args, adapters=files["other"])))
            time.sleep(3.0)
            stop.set()
            streamed = load[0].result(300) + load[1].result(300)
            completed = load[2].result(300)
        assert len(streamed) >= 4 and len(completed) >= 2
        assert all(status == 200 and _finished(events) for status, events in streamed), [
            (s, e[-2:]) for s, e in streamed if s != 200 or not _finished(e)]
        assert [status for status, _ in completed] == [200] * len(completed)
        # the new directory is served, the old one's own adapter no longer
        assert _complete(url, "delta")[0] == 200
        assert _complete(url, "beta")[0] == 404
    finally:
        driver.close()
