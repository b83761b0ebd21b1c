"""lorahook.ray_serve on a local Ray cluster: multiplexed routing, byte capacity, shared adapters.

The cluster starts once for the module (two CPUs, loopback HTTP on a free
port, usage statistics off) and is shut down at the end, whatever happens.
Traffic is bounded in count and in time.  The replicas' model is a small
numpy MLP (two projections, one adapter on each), so every output can be
checked against a float64 reference computed here.

Skips when ray[serve] is not installed, unless LORAHOOK_REQUIRE_RAY=1 (as
CI sets), which turns every skip of this module into a failure.
"""
import asyncio
import concurrent.futures
import gc
import json
import os
import pickle
import socket
import subprocess
import sys
import time
import warnings
import tracemalloc
import urllib.error
import urllib.request
import weakref

import numpy as np
import pytest

from required import need as _need  # noqa: E402


ray = _need("ray")
serve = _need("ray.serve")

import lorahook  # noqa: E402
from lorahook import AdapterSet, LoraAdapter, LoraFormatError, LoraLayer, apply_lora_rows  # noqa: E402
from lorahook.ray_serve import AdapterLease, batch, multiplexed, shared_resolver  # noqa: E402

# Deployments and remote classes below are shipped to the workers by value:
# the workers cannot import this test module.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
H, I, RANK = 256, 512, 16  # the replicas' model: x (H) -> up (I) -> tanh -> down (H)
NAMES = [f"tenant{i}" for i in range(8)]
TIMEOUT_S = 60  # any one wait on the cluster


# --------------------------------------------------------------------------- model and adapters


def _adapter(seed, h=H, i=I, rank=RANK):
    rng = np.random.default_rng(seed)
    return LoraAdapter({
        (0, "up_proj"): LoraLayer(rng.standard_normal((rank, h)) / np.sqrt(h),
                                  rng.standard_normal((i, rank)) * 0.3, scale=2.0),
        (0, "down_proj"): LoraLayer(rng.standard_normal((rank, i)) / np.sqrt(i),
                                    rng.standard_normal((h, rank)) * 0.3, scale=0.5),
    })


def _weights():
    rng = np.random.default_rng(1234)
    w_up = (rng.standard_normal((I, H)) / np.sqrt(H)).astype(np.float32)
    w_down = (rng.standard_normal((H, I)) / np.sqrt(I)).astype(np.float32)
    return w_up, w_down


def _reference(x, adapter, w_up, w_down):
    """The model's output in float64 (``adapter`` None: the base model)."""
    x = np.asarray(x, np.float64)
    h = x @ w_up.astype(np.float64).T
    if adapter is not None:
        layer = adapter.layers[(0, "up_proj")]
        h += layer.scale * (layer.b.astype(np.float64) @ (layer.a.astype(np.float64) @ x))
    h = np.tanh(h)
    y = h @ w_down.astype(np.float64).T
    if adapter is not None:
        layer = adapter.layers[(0, "down_proj")]
        y += layer.scale * (layer.b.astype(np.float64) @ (layer.a.astype(np.float64) @ h))
    return y


def _assert_close(got, ref):
    got = np.asarray(got, np.float64)
    assert got.shape == ref.shape
    assert np.max(np.abs(got - ref)) <= 1e-5 * np.max(np.abs(ref))


def _uss():
    """This process's unique set size: its private pages (bytes)."""
    total = 0
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith(("Private_Clean:", "Private_Dirty:", "Private_Hugetlb:")):
                total += int(line.split()[1]) * 1024
    return total


def _store_bytes():
    """Bytes the object store holds now (all nodes)."""
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address
    reply = get_memory_info_reply(get_state_from_address(ray.get_runtime_context().gcs_address))
    return int(reply.store_stats.object_store_bytes_used)


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- the replica


@serve.deployment(max_ongoing_requests=64, ray_actor_options={"num_cpus": 0})
class Server:
    """A replica: the numpy model, a byte-bounded AdapterSet, multiplexed routing, mixed batches."""

    def __init__(self, resolver, capacity_bytes, max_models, w_up, w_down, stats_dir):
        lorahook.threads.configure(blas_threads=1)
        self.w_up, self.w_down = w_up, w_down
        self.stats_dir = stats_dir
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.copies = {}  # name -> weak references to the arrays of every copy resolved here

        def resolve(name):
            adapter = resolver(name)
            refs = self.copies.setdefault(name, [])
            refs.extend(weakref.ref(layer.a) for layer in adapter.layers.values())
            return adapter

        self.adapters = AdapterSet(capacity_bytes=capacity_bytes, resolver=resolve)
        self.load = multiplexed(self.adapters, max_models)
        self.batches = []
        self.max_nbytes = 0

    async def __call__(self, request):
        from starlette.requests import Request
        from starlette.responses import JSONResponse
        if not isinstance(request, Request):  # a DeploymentHandle call: the item itself
            name = await self.load(serve.get_multiplexed_model_id())
            return await self.forward(name, np.asarray(request, np.float32))
        body = await request.json()
        try:
            name = await self.load(serve.get_multiplexed_model_id())
        except KeyError as exc:
            return JSONResponse({"error": str(exc.args[0])}, status_code=404)
        y = await self.forward(name, np.asarray(body["x"], np.float32))
        return {"adapter": name, "y": y.tolist()}

    @batch(max_batch_size=16, batch_wait_timeout_s=0.05)
    async def forward(self, names, xs):
        return await asyncio.to_thread(self._forward, names, xs)

    def _forward(self, names, xs):
        hook = self.adapters.bind(names)
        self.max_nbytes = max(self.max_nbytes, self.adapters.nbytes)
        self.batches.append(list(names))
        x = np.ascontiguousarray(np.stack(xs), np.float32)
        h = x @ self.w_up.T
        apply_lora_rows(hook, 0, "up_proj", x, h, H, I)
        h = np.tanh(h)
        y = h @ self.w_down.T
        apply_lora_rows(hook, 0, "down_proj", h, y, I, H)
        self.max_nbytes = max(self.max_nbytes, self.adapters.nbytes)
        self._write_stats()
        return list(y)

    def info(self):
        gc.collect()
        alive = sorted(name for name, refs in self.copies.items()
                       if any(ref() is not None for ref in refs))
        return {
            "replica": self.replica,
            "lorahook": lorahook.__file__,
            "set": self.adapters.stats(),
            "resident": self.adapters.names(),
            "capacity_bytes": self.adapters.capacity_bytes,
            "routed": self.load.routed(),
            "alive": alive,
            "batches": self.batches,
            "max_nbytes": self.max_nbytes,
        }

    def _write_stats(self):
        path = os.path.join(self.stats_dir, f"{self.replica}.json")
        info = {"replica": self.replica, "set": self.adapters.stats(), "batches": self.batches,
                "max_nbytes": self.max_nbytes, "capacity_bytes": self.adapters.capacity_bytes,
                "resident": self.adapters.names(), "routed": self.load.routed()}
        with open(path + ".tmp", "w") as f:
            json.dump(info, f)
        os.replace(path + ".tmp", path)


def _replica_stats(stats_dir):
    out = {}
    for fname in os.listdir(stats_dir):
        if fname.endswith(".json"):
            with open(os.path.join(stats_dir, fname)) as f:
                info = json.load(f)
            out[info["replica"]] = info
    return out


@ray.remote(num_cpus=0)
class Reader:
    """A process that resolves adapters through a shared resolver and reports its memory."""

    def __init__(self, shared):
        self.shared = shared
        self.kept = []

    def pid(self):
        return os.getpid()

    def read(self, names):
        before = _uss()
        adapters = AdapterSet(resolver=self.shared)
        nbytes, read_only, checksum = 0, True, 0.0
        for name in names:
            adapter = adapters.get(name)
            nbytes += adapter.nbytes
            for layer in adapter.layers.values():
                for arr in layer._arrays():
                    read_only = read_only and not arr.flags.writeable
                    checksum += float(arr.sum())  # every page touched
        self.kept.append(adapters)
        return {"uss_growth": _uss() - before, "nbytes": nbytes, "read_only": read_only,
                "checksum": checksum}


# --------------------------------------------------------------------------- the example, first
# It starts a Ray of its own: run it before this module's cluster starts.


def test_example_smoke_runs_end_to_end():
    for module in ("torch", "transformers"):
        _need(module)
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "ray_serve_lora.py"), "--smoke"],
        cwd=HERE, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "smoke test passed" in proc.stdout
    assert not ray.is_initialized()


# --------------------------------------------------------------------------- without a cluster


def test_arrays_an_adapter_keeps_are_contiguous():
    adapter = _adapter(0)
    for layer in adapter.layers.values():
        for arr in (*layer._arrays(), layer.a, layer.b):
            assert arr.flags.c_contiguous or arr.flags.f_contiguous


def test_unpickling_from_out_of_band_buffers_allocates_under_a_tenth():
    adapter = _adapter(1, h=1024, i=1024, rank=64)  # 1 MiB
    buffers = []
    data = pickle.dumps(adapter, protocol=5, buffer_callback=buffers.append)
    raw = [memoryview(bytes(b.raw())) for b in buffers]  # read-only, as the object store hands out
    assert sum(r.nbytes for r in raw) == adapter.nbytes
    tracemalloc.start()
    try:
        back = pickle.loads(data, buffers=raw)
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < adapter.nbytes / 10, (peak, adapter.nbytes)
    assert back.nbytes == adapter.nbytes
    for layer in back.layers.values():
        assert not layer.a.flags.writeable and not layer.b.flags.writeable


def test_lease_is_a_plain_object_without_arrays():
    lease = AdapterLease("a")
    assert not hasattr(type(lease), "__slots__")
    assert not hasattr(lease, "__del__")
    assert vars(lease) == {"name": "a"}
    weakref.ref(lease)


def test_multiplexed_checks_its_arguments():
    with pytest.raises(TypeError, match=r"adapters must be a lorahook.AdapterSet, found dict"):
        multiplexed({}, 2)
    with pytest.raises(TypeError, match=r"max_num_models_per_replica must be an int >= 1, found float"):
        multiplexed(AdapterSet(), 2.0)
    with pytest.raises(ValueError, match=r"max_num_models_per_replica must be an int >= 1.*-1"):
        multiplexed(AdapterSet(), -1)


def test_base_model_requests_never_reach_ray():
    # Outside a replica, Ray's serve.multiplexed raises on any call: None means it was not called.
    load = multiplexed(AdapterSet(), 2)
    assert asyncio.run(load("")) is None
    assert asyncio.run(load(None)) is None
    with pytest.raises(TypeError, match=r"model id must be an adapter name.*found int"):
        asyncio.run(load(3))
    assert load.routed() == []


def test_unknown_adapter_raises_before_ray_hears_of_it():
    load = multiplexed(AdapterSet(), 2)
    with pytest.raises(KeyError, match="nope"):
        asyncio.run(load("nope"))  # no replica here: reaching Ray would raise RuntimeError
    assert load.routed() == []


def test_shared_resolver_checks_and_pickles():
    # a shared resolver needs something to load with: None is not offered
    with pytest.raises(TypeError, match=r"resolver must be a directory .* got int"):
        shared_resolver(3)
    with pytest.raises(TypeError, match=r"resolver must be a directory .* got NoneType"):
        shared_resolver(None)
    with pytest.raises(TypeError, match=r"name \(the actor's name\) must be a str, got int"):
        shared_resolver("/tmp", name=3)
    with pytest.raises(ValueError, match=r"name \(the actor's name\) must be a non-empty str, got ''"):
        shared_resolver("/tmp", name="")
    with pytest.raises(TypeError, match="dtype must be float32, float16, bfloat16 or int8"):
        shared_resolver("/tmp", dtype="float64")
    assert shared_resolver("/tmp", dtype="int8").dtype == np.int8
    with pytest.raises(ValueError, match=r"capacity_bytes must be >= 0 or None, got -1"):
        shared_resolver("/tmp", capacity_bytes=-1)
    shared = shared_resolver("/some/adapters", name="x", dtype=np.float16, capacity_bytes=1 << 20)
    back = pickle.loads(pickle.dumps(shared))
    assert (back.resolver, back.name, back.dtype, back.capacity_bytes) == (
        "/some/adapters", "x", np.dtype(np.float16), 1 << 20)
    if not ray.is_initialized():
        with pytest.raises(RuntimeError, match=r"needs a running Ray: call ray.init\(\)"):
            shared("a")


def test_lorahook_exports_nothing_that_imports_ray():
    code = ("import sys, lorahook; "
            "print(any(m == 'ray' or m.startswith('ray.') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=HERE, capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip() == "False", out.stderr
    assert not any("ray" in name.lower() for name in lorahook.__all__)


# --------------------------------------------------------------------------- the cluster


@pytest.fixture(scope="module")
def cluster():
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    port = _free_port()
    # Ray puts the driver's working directory first on every worker's sys.path:
    # from the repository root, the source tree's lorahook (no compiled core in
    # CI) would shadow the tested one.  Start it from this directory instead.
    cwd = os.getcwd()
    os.chdir(HERE)
    try:
        ray.init(num_cpus=2, address="local", include_dashboard=False, log_to_driver=False,
                 namespace="lorahook-tests")
    finally:
        os.chdir(cwd)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield {"port": port}
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    for i, name in enumerate(NAMES):
        _adapter(100 + i).save_peft(root / name, architecture="llama")
    (root / "broken").mkdir()  # not a PEFT directory
    return root


@pytest.fixture(scope="module")
def local_adapters(adapter_dir):
    return {name: LoraAdapter.from_peft(adapter_dir / name) for name in NAMES}


@pytest.fixture(scope="module")
def mixed_app(cluster, adapter_dir, local_adapters, tmp_path_factory):
    """Two replicas with room for 4 adapters each, 8 adapters from one shared resolver."""
    stats_dir = tmp_path_factory.mktemp("replica-stats")
    per_adapter = local_adapters[NAMES[0]].nbytes
    shared = shared_resolver(str(adapter_dir), name="test-mixed-adapters")
    w_up, w_down = _weights()
    app = Server.options(num_replicas=2).bind(shared, 4 * per_adapter, 4, w_up, w_down,
                                              str(stats_dir))
    handle = serve.run(app, name="mixed", route_prefix="/mixed")
    try:
        yield {"handle": handle, "shared": shared, "stats_dir": str(stats_dir),
               "per_adapter": per_adapter, "weights": (w_up, w_down), "port": cluster["port"]}
    finally:
        serve.delete("mixed")
        shared.close()


def _send(handle, requests):
    """``requests``: (name or None, x) pairs sent at once; their results, in order."""
    responses = [(handle.options(multiplexed_model_id=name) if name else handle).remote(x)
                 for name, x in requests]
    return [r.result(timeout_s=TIMEOUT_S) for r in responses]


def test_two_replicas_serve_eight_adapters_with_room_for_four(mixed_app, local_adapters):
    handle, stats_dir = mixed_app["handle"], mixed_app["stats_dir"]
    w_up, w_down = mixed_app["weights"]
    rng = np.random.default_rng(7)

    # warm-up: each adapter once, with time for the replicas to report what they hold
    for name in NAMES:
        x = rng.standard_normal(H).astype(np.float32)
        (y,) = _send(handle, [(name, x)])
        _assert_close(y, _reference(x, local_adapters[name], w_up, w_down))
        time.sleep(0.3)
    warm = _replica_stats(stats_dir)
    assert len(warm) == 2, "both replicas served"
    loads_warm = sum(s["set"]["loads"] for s in warm.values())

    # steady traffic: 4 rounds of 32 requests, 4 per adapter, in random order
    deadline = time.monotonic() + 90
    for _ in range(4):
        requests = [(name, rng.standard_normal(H).astype(np.float32))
                    for name in NAMES for _ in range(4)]
        order = rng.permutation(len(requests))
        requests = [requests[k] for k in order]
        for (name, x), y in zip(requests, _send(handle, requests)):
            _assert_close(y, _reference(x, local_adapters[name], w_up, w_down))
        assert time.monotonic() < deadline
    stats = _replica_stats(stats_dir)
    loads_after = sum(s["set"]["loads"] for s in stats.values()) - loads_warm
    for s in stats.values():
        assert s["max_nbytes"] <= s["capacity_bytes"] == 4 * mixed_app["per_adapter"]
        assert s["set"]["nbytes"] <= s["capacity_bytes"]
        assert len(s["routed"]) <= 4
        assert all(len(b) <= 16 for b in s["batches"])
    # routing keeps each adapter where it is: almost no loads once warm
    assert loads_after <= 2, {r: s["set"] for r, s in stats.items()}
    # batches mix adapters
    mixed = [b for s in stats.values() for b in s["batches"]
             if len({n for n in b if n is not None}) >= 2]
    assert mixed, "no batch held two adapters"
    # one load of each adapter for the whole cluster
    loads = mixed_app["shared"].stats()["loads_by_name"]
    assert loads == {name: 1 for name in NAMES}


def test_http_with_and_without_the_header(mixed_app, local_adapters):
    url = f"http://127.0.0.1:{mixed_app['port']}/mixed"
    w_up, w_down = mixed_app["weights"]
    x = np.random.default_rng(8).standard_normal(H).astype(np.float32)

    def post(header):
        req = urllib.request.Request(url, data=json.dumps({"x": x.tolist()}).encode(),
                                     headers={"Content-Type": "application/json", **header})
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
            return resp.status, json.loads(resp.read())

    status, body = post({"serve_multiplexed_model_id": NAMES[3]})
    assert status == 200 and body["adapter"] == NAMES[3]
    _assert_close(body["y"], _reference(x, local_adapters[NAMES[3]], w_up, w_down))
    status, body = post({})
    assert status == 200 and body["adapter"] is None
    _assert_close(body["y"], _reference(x, None, w_up, w_down))
    with pytest.raises(urllib.error.HTTPError) as info:
        post({"serve_multiplexed_model_id": "no-such-tenant"})
    assert info.value.code == 404
    assert "no-such-tenant" in info.value.read().decode()


@pytest.fixture(scope="module")
def small_app(cluster, adapter_dir, local_adapters, tmp_path_factory):
    """One replica with room for 2 adapters while Ray's list holds 4."""
    per_adapter = local_adapters[NAMES[0]].nbytes
    shared = shared_resolver(str(adapter_dir), name="test-small-adapters")
    w_up, w_down = _weights()
    app = Server.bind(shared, 2 * per_adapter, 4, w_up, w_down,
                      str(tmp_path_factory.mktemp("small-stats")))
    handle = serve.run(app, name="small", route_prefix="/small")
    try:
        yield {"handle": handle, "shared": shared, "weights": (w_up, w_down)}
    finally:
        serve.delete("small")
        shared.close()


def test_evicted_adapters_do_not_stay_alive(small_app, local_adapters):
    handle = small_app["handle"]
    w_up, w_down = small_app["weights"]
    rng = np.random.default_rng(9)
    used = NAMES[:6]
    for name in used:
        x = rng.standard_normal(H).astype(np.float32)
        (y,) = _send(handle, [(name, x)])
        _assert_close(y, _reference(x, local_adapters[name], w_up, w_down))
    info = handle.info.remote().result(timeout_s=TIMEOUT_S)
    assert info["lorahook"].startswith(os.path.dirname(os.path.dirname(lorahook.__file__)))
    assert info["routed"] == sorted(used[-4:])  # Ray's count-based list
    assert info["resident"] == sorted(used[-2:])  # the byte capacity
    assert info["alive"] == info["resident"]  # nothing else kept by Ray's leases
    assert info["max_nbytes"] <= info["capacity_bytes"]

    # no model id: the base model
    x = rng.standard_normal(H).astype(np.float32)
    (y,) = _send(handle, [(None, x)])
    _assert_close(y, _reference(x, None, w_up, w_down))


def test_bad_adapters_leave_rays_list_unchanged(small_app):
    handle = small_app["handle"]
    x = np.zeros(H, np.float32)
    before = handle.info.remote().result(timeout_s=TIMEOUT_S)["routed"]
    with pytest.raises(KeyError, match="no-such-tenant"):
        _send(handle, [("no-such-tenant", x)])
    with pytest.raises(LoraFormatError, match="broken"):
        _send(handle, [("broken", x)])
    after = handle.info.remote().result(timeout_s=TIMEOUT_S)
    assert after["routed"] == before
    assert "no-such-tenant" not in after["alive"] and "broken" not in after["alive"]


FORWARD_S = 0.03  # a forward that dominates: its cost does not depend on its rows
# a batch waits this long to fill: all 64 requests of a round are sent well within it, so
# how batches form does not depend on how busy the machine is
BATCH_WAIT_S = 0.5


@serve.deployment(max_ongoing_requests=64, ray_actor_options={"num_cpus": 0})
class Batchers:
    """One replica, the same forward behind lorahook's batch and Ray's serve.batch."""

    def __init__(self):
        self.adapters = AdapterSet()
        for i, name in enumerate(NAMES):
            self.adapters.add(name, _adapter(300 + i, h=8, i=8, rank=2))
        self.load = multiplexed(self.adapters, len(NAMES))
        self.pool = concurrent.futures.ThreadPoolExecutor(1)  # one forward thread either way
        self.forwards = []

    def _forward(self, names, items):
        self.adapters.bind(names)
        time.sleep(FORWARD_S)
        self.forwards.append(list(names))
        return [(name, item) for name, item in zip(names, items)]

    async def _run(self, names, items):
        return await asyncio.get_running_loop().run_in_executor(
            self.pool, self._forward, names, items)

    async def mixed(self, item):
        name = await self.load(serve.get_multiplexed_model_id())
        return await self.mixed_batch(name, item)

    @batch(max_batch_size=16, batch_wait_timeout_s=BATCH_WAIT_S)
    async def mixed_batch(self, names, items):
        return await self._run(names, items)

    async def split(self, item):
        await self.load(serve.get_multiplexed_model_id())
        return await self.split_batch(item)

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=BATCH_WAIT_S)
    async def split_batch(self, items):
        name = serve.get_multiplexed_model_id() or None
        return await self._run([name] * len(items), items)

    def take_forwards(self):
        out, self.forwards = self.forwards, []
        return out


def test_one_replica_mixed_batches_need_fewer_forwards_than_serve_batch(cluster):
    # forwards are what a replica pays for; their time is measured in
    # benchmarks/ray_serve_batch.py, not asserted here
    handle = serve.run(Batchers.bind(), name="batchers", route_prefix="/batchers")
    try:
        def round_(method):
            responses = [getattr(handle.options(multiplexed_model_id=NAMES[i % 8]), method)
                         .remote(i) for i in range(64)]
            results = [r.result(timeout_s=TIMEOUT_S) for r in responses]
            assert results == [(NAMES[i % 8], i) for i in range(64)]  # each caller its own
            return handle.take_forwards.remote().result(timeout_s=TIMEOUT_S)

        round_("mixed"), round_("split")  # warm-up
        mixed = round_("mixed")
        split = round_("split")
        assert sum(map(len, mixed)) == sum(map(len, split)) == 64
        assert any(len(set(b)) >= 2 for b in mixed)
        assert all(len(set(b)) == 1 for b in split)  # Ray's: one adapter per forward
        # so Ray's needs a forward per adapter at least; mixed batches fill up across adapters
        assert len(mixed) < len(NAMES) <= len(split), ([len(b) for b in mixed], [len(b) for b in split])
    finally:
        serve.delete("batchers")


def test_shared_resolver_loads_once_for_two_processes(cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("big-adapters")
    names = [f"big{i}" for i in range(9)]
    for i, name in enumerate(names):
        _adapter(200 + i, h=1024, i=1024, rank=64).save_peft(root / name, architecture="llama")
    shared = shared_resolver(str(root), name="test-big-adapters")
    try:
        readers = [Reader.remote(shared) for _ in range(2)]
        assert len(set(ray.get([r.pid.remote() for r in readers], timeout=TIMEOUT_S))) == 2
        # warm-up: the first adapter (first calls into the actor, Ray's own buffers)
        ray.get([r.read.remote(names[:1]) for r in readers], timeout=TIMEOUT_S)
        store_before = _store_bytes()
        # both processes ask for the same 8 adapters at once
        results = ray.get([r.read.remote(names[1:]) for r in readers], timeout=TIMEOUT_S)
        store_growth = _store_bytes() - store_before
        stats = shared.stats()
        assert stats["loads_by_name"] == {name: 1 for name in names}
        assert stats["resident"] == len(names)
        nbytes = results[0]["nbytes"]
        assert nbytes == 8 * (1 << 20)
        assert stats["nbytes"] == 9 * (1 << 20)
        for res in results:
            assert res["read_only"]
            assert res["uss_growth"] < nbytes / 4, (res["uss_growth"], nbytes)
            assert res["checksum"] == results[0]["checksum"]
        # the object store holds about one copy of the 8 adapters, not one per process
        assert 0.9 * nbytes <= store_growth <= 1.25 * nbytes, (store_growth, nbytes)

        # unpickling from the object store keeps what it maps: a small fraction allocated
        adapters = AdapterSet(resolver=shared)
        tracemalloc.start()
        try:
            adapter = adapters.get(names[1])
            current, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert current < adapter.nbytes / 10, (current, adapter.nbytes)
        assert shared.stats()["loads_by_name"][names[1]] == 1
    finally:
        shared.close()


def test_shared_resolver_loads_in_its_dtype_and_keeps_within_its_capacity(cluster, adapter_dir,
                                                                          local_adapters):
    one = local_adapters[NAMES[0]].astype(np.float16).nbytes
    shared = shared_resolver(str(adapter_dir), name="test-bounded", dtype="float16",
                             capacity_bytes=3 * one)
    try:
        for name in NAMES[:5]:
            got = shared(name)
            assert got.dtype == np.float16 and got.nbytes == one
            # the float32 values rounded to float16 by numpy
            for key, layer in local_adapters[name].layers.items():
                assert np.array_equal(got.layers[key].a, layer.a.astype(np.float16))
                assert np.array_equal(got.layers[key].b, layer.b.astype(np.float16))
        stats = shared.stats()
        # the three most recently resolved are kept; the two oldest were dropped
        assert stats["names"] == sorted(NAMES[2:5]) and stats["nbytes"] == 3 * one
        assert stats["evictions"] == 2 and stats["capacity_bytes"] == 3 * one
        assert stats["dtype"] == "float16"
        shared(NAMES[2])       # a hit: now the most recent
        shared(NAMES[0])       # loaded again, dropping the least recent (NAMES[3])
        stats = shared.stats()
        assert stats["names"] == sorted([NAMES[0], NAMES[2], NAMES[4]])
        assert stats["loads_by_name"][NAMES[0]] == 2 and stats["loads_by_name"][NAMES[2]] == 1
        # a resolver of the same name in another dtype uses the running actor, and says so
        with pytest.warns(RuntimeWarning, match="another resolver or dtype"):
            assert shared_resolver(str(adapter_dir), name="test-bounded")(NAMES[4]).dtype == \
                np.float16
        # replicas' sets in the same dtype hold the object store's copy as it is
        store = AdapterSet(resolver=shared, dtype="float16")
        assert store.get(NAMES[4]).layers[(0, "up_proj")].a.flags.writeable is False
    finally:
        shared.close()


def test_shared_resolver_concurrent_first_uses_drop_close_and_errors(cluster, adapter_dir):
    shared = shared_resolver(str(adapter_dir), name="test-lifecycle")
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            got = list(pool.map(shared, [NAMES[0]] * 8))
        assert shared.stats()["loads_by_name"] == {NAMES[0]: 1}
        # one load, one copy in the object store: every caller maps the same bytes
        assert len({a.layers[(0, "up_proj")].a.ctypes.data for a in got}) == 1
        with pytest.raises(KeyError, match="no-such-tenant"):
            shared("no-such-tenant")
        with pytest.raises(LoraFormatError, match="broken"):
            shared("broken")
        with pytest.raises(ValueError, match=r"adapter name must be a non-empty str, got ''"):
            shared("")
        with pytest.raises(TypeError, match=r"adapter name must be a str, got int"):
            shared.drop(3)
        stats = shared.stats()
        assert set(stats["loads_by_name"]) == {NAMES[0]}  # failed loads do not count
        assert stats["failures_by_name"] == {"no-such-tenant": 1, "broken": 1}

        shared.drop(NAMES[0])
        assert shared.stats()["resident"] == 0
        assert got[0].nbytes > 0 and float(got[0].layers[(0, "up_proj")].a.sum()) == float(
            got[1].layers[(0, "up_proj")].a.sum())  # processes that hold it keep theirs
        with pytest.raises(KeyError, match=r"holds no adapter named 'tenant0'"):
            shared.drop(NAMES[0])
        shared(NAMES[0])
        assert shared.stats()["loads_by_name"] == {NAMES[0]: 2}

        # a second resolver of the same name uses the running actor, and its resolver: it says so
        other = shared_resolver("/nowhere", name="test-lifecycle")
        with pytest.warns(RuntimeWarning, match="running actor that loads with another resolver"):
            assert other(NAMES[0]).nbytes == got[0].nbytes
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            other(NAMES[0])  # once per object
            shared_resolver(str(adapter_dir), name="test-lifecycle")(NAMES[0])  # the same resolver
        pid = shared.stats()["pid"]

        # an actor that died is started again
        ray.kill(ray.get_actor("test-lifecycle", namespace="lorahook"), no_restart=True)
        time.sleep(0.5)
        shared(NAMES[1])
        stats = shared.stats()
        assert stats["pid"] != pid and stats["loads_by_name"] == {NAMES[1]: 1}

        shared.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                ray.get_actor("test-lifecycle", namespace="lorahook")
            except ValueError:
                break
            time.sleep(0.2)
        else:
            pytest.fail("the actor still runs after close()")
    finally:
        shared.close()
