"""Run vLLM once, as a test or the benchmark asks, in a process of its own.

``python tests/support/vllm_run.py SPEC.json`` reads a spec (mode ``offline`` or
``server``, the model, the adapters, the requests) and prints one line
``RESULT {json}``: each request's greedy tokens and top log-probabilities,
the punica wrapper vLLM used, and requests per second.  Mode ``bursts``
keeps the engine and times bursts on request (see :func:`bursts`).  vLLM
starts its own worker processes, so it never runs inside pytest.
"""
import json
import os
import socket
import subprocess
import sys
import time


def _prompts(spec):
    return [list(p) for p in spec["prompts"]] if "prompts" in spec else [
        [1] + [4 + (7 * i + 3 * j) % 60 for j in range(4 + i % 5)]
        for i in range(spec["requests"])]


def _lora_args(spec):
    if not spec.get("enable_lora", True):
        return {}
    return dict(enable_lora=True, max_loras=spec.get("max_loras", 4),
                max_lora_rank=spec.get("max_lora_rank", 8),
                max_cpu_loras=spec.get("max_cpu_loras"),
                lora_target_modules=spec.get("target_modules"))


def _engine(spec):
    """The engine a spec asks for, its inputs, sampling and each request's adapter."""
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    args = {k: v for k, v in _lora_args(spec).items() if v is not None}
    llm = LLM(spec["model"], dtype=spec.get("dtype", "float32"), max_model_len=256,
              max_num_seqs=spec.get("max_num_seqs", 64), seed=0, **args,
              **spec.get("engine", {}))
    prompts = _prompts(spec)
    names = spec["names"]
    ids = {n: i + 1 for i, n in enumerate(sorted(set(n for n in names if n)))}

    def request(i):
        name = names[i % len(names)] if names else None
        return LoRARequest(name, ids[name], os.path.join(spec["adapters"], name)) if name else None

    reqs = [request(i) for i in range(len(prompts))]
    sp = SamplingParams(max_tokens=spec["max_tokens"], temperature=0, ignore_eos=True,
                        logprobs=2)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    return llm, inputs, sp, reqs


def offline(spec):
    from vllm.platforms import current_platform

    llm, inputs, sp, reqs = _engine(spec)
    t0 = time.perf_counter()
    outs = llm.generate(inputs, sp, lora_request=reqs, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[sorted((lp.logprob for lp in step.values()), reverse=True)[:2]
                 for step in o.outputs[0].logprobs] for o in outs]
    return dict(tokens=tokens, logprobs=logprobs, requests_per_s=len(inputs) / elapsed,
                wrapper=current_platform.get_punica_wrapper(),
                adapters=[r.lora_name if r else None for r in reqs])


def bursts(spec):
    """Keep one engine and time a burst of the spec's requests at each line read from stdin.

    A line ``adapters`` sends the requests with their adapters, ``none``
    without; each burst answers ``RATE <label> <requests/s>`` on stdout.
    ``READY`` is printed once the engine has run a warm-up burst.  The
    benchmark keeps several such engines alive and sends them bursts in
    turn, so that their rates are measured side by side in time.
    """
    from vllm.platforms import current_platform

    llm, inputs, sp, reqs = _engine(spec)
    plain = [None] * len(reqs)
    warm = len(reqs) if spec.get("warm_all") else 8  # warm_all: every adapter loaded once
    llm.generate(inputs[:warm], sp, lora_request=reqs[:warm], use_tqdm=False)
    llm.generate(inputs[:8], sp, lora_request=plain[:8], use_tqdm=False)
    print(f"READY {current_platform.get_punica_wrapper()}", flush=True)
    for line in sys.stdin:
        label = line.strip()
        if not label:
            break
        lora = reqs if label == "adapters" else plain
        t0 = time.perf_counter()
        llm.generate(inputs, sp, lora_request=lora, use_tqdm=False)
        print(f"RATE {label} {len(inputs) / (time.perf_counter() - t0)}", flush=True)
    return {}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_api_server(model, args, env, log, timeout=600):
    """vLLM's OpenAI server for ``model`` on a free loopback port, with ``args`` (a list) and
    ``env`` (its whole environment), its output into ``log``: ``(process, URL)`` once
    ``/health`` answers."""
    import httpx

    port = _free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--host", "127.0.0.1", "--port", str(port), *args]
    # started beside the model, not in the caller's directory: `python -m` puts the working
    # directory first on sys.path, and a lorahook source tree there (no compiled core)
    # would shadow the installed package, and the plugin would fail to load
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            cwd=os.path.dirname(os.path.abspath(model)))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the vLLM server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the vLLM server did not start in {timeout} s")
        time.sleep(1)


def server(spec):
    args = ["--dtype", spec.get("dtype", "float32"), "--max-model-len", "256",
            "--max-num-seqs", str(spec.get("max_num_seqs", 64)), "--served-model-name", "base",
            "--seed", "0"]
    lora = _lora_args(spec)
    if lora:
        args += ["--enable-lora", "--max-loras", str(lora["max_loras"]), "--max-lora-rank",
                 str(lora["max_lora_rank"])]
        if lora["max_cpu_loras"]:
            args += ["--max-cpu-loras", str(lora["max_cpu_loras"])]
        if spec.get("preload", True) and spec["names"]:
            args += ["--lora-modules"] + [f"{n}={os.path.join(spec['adapters'], n)}"
                                          for n in sorted(set(spec["names"]))]
    # unbuffered: every process's log line is in the file even when the server is stopped
    env = dict(os.environ, VLLM_ALLOW_RUNTIME_LORA_UPDATING="1", PYTHONUNBUFFERED="1")
    log = open(spec.get("log", os.devnull), "w")
    proc, url = start_api_server(spec["model"], args, env, log)
    try:
        return _server_work(spec, url)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def _complete(client, url, model, prompt, max_tokens):
    r = client.post(url + "/v1/completions", json=dict(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True,
        logprobs=2, return_tokens_as_token_ids=True), timeout=600)
    return r


def _ids(body):
    return [int(t.split(":")[1]) for t in body["choices"][0]["logprobs"]["tokens"]]


def _server_work(spec, url):
    import concurrent.futures as cf

    import httpx

    out = {}
    prompts = _prompts(spec)
    names = spec["names"] or ["base"]
    with httpx.Client() as client:
        for step in spec.get("steps", []):
            if step[0] == "load":
                r = client.post(url + "/v1/load_lora_adapter", json=dict(
                    lora_name=step[1], lora_path=os.path.join(spec["adapters"], step[2])),
                    timeout=120)
            elif step[0] == "unload":
                r = client.post(url + "/v1/unload_lora_adapter", json=dict(lora_name=step[1]),
                                timeout=120)
            else:  # ("complete", model, prompt index)
                r = _complete(client, url, step[1], prompts[step[2]], spec["max_tokens"])
                out.setdefault("completions", []).append(
                    [step[1], r.status_code, _ids(r.json()) if r.status_code == 200 else None])
                continue
            out.setdefault("updates", []).append([step[0], step[1], r.status_code])
        out["models"] = sorted(m["id"] for m in client.get(url + "/v1/models").json()["data"])
    if spec.get("bench") or spec.get("burst"):
        def one(i):
            with httpx.Client() as c:
                r = _complete(c, url, names[i % len(names)], prompts[i], spec["max_tokens"])
                r.raise_for_status()
                return _ids(r.json())
        with cf.ThreadPoolExecutor(8) as pool:  # warm-up
            list(pool.map(one, range(8)))
        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(len(prompts)) as pool:
            out["tokens"] = list(pool.map(one, range(len(prompts))))
        out["requests_per_s"] = len(prompts) / (time.perf_counter() - t0)
    return out


def child_env(env=None):
    """The environment a vLLM process of this script gets: this one's, without
    ``VLLM_PLUGINS`` unless ``env`` names it, no usage reports, 1 GiB of KV cache and
    CPU 0 unless this environment says otherwise, then ``env``."""
    full = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    full.update(VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
                VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0"))
    full.update(env or {})
    return full


def launch(spec, env=None, timeout=1800):
    """Run this script on ``spec`` in a fresh process: ``(answer, its output)``.

    ``env`` adds to this process's environment (``VLLM_PLUGINS`` is taken from
    it alone); vLLM runs offline, with 1 GiB of KV cache unless the
    environment says otherwise, its compute bound to CPU 0.
    """
    import tempfile
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    full = child_env(env)
    try:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), f.name], env=full,
                              capture_output=True, text=True, timeout=timeout)
    finally:
        os.unlink(f.name)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[7:]), proc.stderr + proc.stdout
    raise RuntimeError(f"vLLM failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n"
                       f"{proc.stderr[-8000:]}")


def main():
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    if spec.get("oom_first"):  # a configuration that may not fit: the kernel ends it first
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    run = {"offline": offline, "server": server, "bursts": bursts}[spec["mode"]]
    result = run(spec)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
