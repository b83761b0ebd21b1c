"""lorahook.vllm's punica wrapper, method by method, against vLLM's own CPU wrapper and float64.

No engine starts here: both wrappers get the same step (a LoRAMapping over
slots, with rows of no adapter) and the same stacked tensors, laid out as
vLLM's LoRA layers make them.  A missing vLLM skips this module, or fails it
with LORAHOOK_REQUIRE_VLLM=1.
"""
import logging

import pytest

from required import need

torch = need("torch", "LORAHOOK_REQUIRE_VLLM")
need("vllm", "LORAHOOK_REQUIRE_VLLM")
lv = need("lorahook.vllm", "LORAHOOK_REQUIRE_VLLM")
from lorahook.vllm import plugin  # noqa: E402
from lorahook.vllm.custom_op import pack_call  # noqa: E402
from vllm.config import CompilationMode as M  # noqa: E402
from vllm.lora.layers import LoRAMapping  # noqa: E402
from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU  # noqa: E402

SLOTS = 4
IDS = [7, None, 3, 9]  # slot -> adapter id (slot 1 empty)
TOKENS = [7, 7, 0, 3, 9, 9, 9, 0, 3, 7, 0, 9]  # adapter id per token (0: base model)
PROMPTS = [7, 0, 3, 9]  # adapter id per sampled row


def _wrappers(prefill=True):
    mapping = LoRAMapping(TOKENS, PROMPTS, is_prefill=prefill)
    out = []
    for cls in (lv.PunicaWrapperLorahook, PunicaWrapperCPU):
        w = cls(64, 16, "cpu")
        w.update_metadata(mapping, list(IDS), SLOTS + 1, 100)
        out.append(w)
    return out


def _slot_of(ids):
    return [IDS.index(i) if i else -1 for i in ids]


def _stack(shape, dtype, gen):
    return (torch.randn(*shape, generator=gen) * 0.2).to(dtype)


def _close(got, ref, tol):
    got, ref = got.double(), ref.double()
    err = (got - ref).abs().max().item()
    assert err <= tol * max(ref.abs().max().item(), 1e-12), err


def _tol(dtype):
    return 1e-5 if dtype == torch.float32 else 1.6e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("prefill", [True, False])
def test_merged_linear_equals_vllm_and_float64(dtype, prefill):
    # a qkv-like projection: three slices of one output, each its own A and B
    gen = torch.Generator().manual_seed(1)
    n, d_in, slices, rank = len(TOKENS), 48, (32, 16, 16), 8
    a = tuple(_stack((SLOTS, 1, rank, d_in), dtype, gen) for _ in slices)
    b = tuple(_stack((SLOTS, 1, s, rank), dtype, gen) for s in slices)
    x = _stack((n, d_in), dtype, gen)
    y0 = _stack((n, sum(slices)), dtype, gen)
    y0[[i for i, t in enumerate(TOKENS) if t == 0]] = float("nan")  # base rows: never touched
    ours, theirs = _wrappers(prefill)
    y_ours, y_theirs = y0.clone(), y0.clone()
    assert ours.add_lora_linear(y_ours, x, a, b, 0.5, slices) is None
    theirs.add_lora_linear(y_theirs, x, a, b, 0.5, slices)
    slots = _slot_of(TOKENS)
    ref = y0.double().clone()
    off = 0
    for i, size in enumerate(slices):
        for r, s in enumerate(slots):
            if s >= 0:
                ref[r, off:off + size] += 0.5 * (b[i][s, 0].double() @ (a[i][s, 0].double()
                                                                         @ x[r].double()))
        off += size
    covered = [r for r, s in enumerate(slots) if s >= 0]
    base = [r for r, s in enumerate(slots) if s < 0]
    _close(y_ours[covered], ref[covered], _tol(dtype))
    _close(y_ours[covered], y_theirs[covered], 2 * _tol(dtype))
    assert torch.isnan(y_ours[base]).all()  # rows without an adapter are not written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shrink_then_expand_equals_vllm(dtype):
    gen = torch.Generator().manual_seed(2)
    n, d_in, slices, rank = len(TOKENS), 40, (24, 24), 8
    a = tuple(_stack((SLOTS, 1, rank, d_in), dtype, gen) for _ in slices)
    b = tuple(_stack((SLOTS, 1, s, rank), dtype, gen) for s in slices)
    x = _stack((n, d_in), dtype, gen)
    y0 = _stack((n, sum(slices)), dtype, gen)
    results = []
    for w in _wrappers():
        buf = torch.zeros(len(slices), n, rank, dtype=torch.float32)
        w.add_shrink(buf, x, a, 2.0)
        y = y0.clone()
        w.add_expand(y, buf, b, slices, offset_start=0, add_inputs=True)
        results.append((buf, y))
    covered = [r for r, s in enumerate(_slot_of(TOKENS)) if s >= 0]
    _close(results[0][0][:, covered], results[1][0][:, covered], _tol(dtype))
    _close(results[0][1][covered], results[1][1][covered], 2 * _tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_logits_and_full_linear_equal_vllm(dtype):
    gen = torch.Generator().manual_seed(3)
    n, rank, dim, vocab, hidden = len(TOKENS), 8, 24, 50, 32
    ours, theirs = _wrappers(prefill=False)
    covered = [r for r, s in enumerate(_slot_of(TOKENS)) if s >= 0]
    # embedding: x holds each token's gathered row of A
    x = _stack((n, rank), dtype, gen)
    b = _stack((SLOTS, 1, dim, rank), dtype, gen)
    y0 = _stack((n, dim), dtype, gen)
    y1, y2 = y0.clone(), y0.clone()
    ours.add_lora_embedding(y1, x, b, add_inputs=True)
    theirs.add_lora_embedding(y2, x, b, add_inputs=True)
    _close(y1[covered], y2[covered], 2 * _tol(dtype))
    assert torch.equal(y1[[r for r in range(n) if r not in covered]],
                       y0[[r for r in range(n) if r not in covered]])
    # logits: one row per request, grouped by the sampled rows' slots
    m = len(PROMPTS)
    h = _stack((m, hidden), dtype, gen)
    a = _stack((SLOTS, 1, rank, hidden), dtype, gen)
    bl = _stack((SLOTS, 1, vocab, rank), dtype, gen)
    logits0 = _stack((m, vocab + 6), dtype, gen)  # padded wider than the vocabulary
    l1, l2 = logits0.clone(), logits0.clone()
    ours.add_lora_logits(l1, h, a, bl, 1.0)
    theirs.add_lora_logits(l2, h, a, bl, 1.0)
    sampled = [r for r, s in enumerate(_slot_of(PROMPTS)) if s >= 0]
    _close(l1[sampled, :vocab], l2[sampled, :vocab], 2 * _tol(dtype))
    assert torch.equal(l1[:, vocab:], logits0[:, vocab:])
    # a request-routed classifier head
    w = _stack((SLOTS, 6, hidden), dtype, gen)
    bias = _stack((SLOTS, 6), dtype, gen)
    enabled = torch.tensor([True, False, True, True])
    c1, c2 = _stack((m, 6), dtype, gen), None
    c2 = c1.clone()
    ours.apply_lora_full_linear(c1, h, w, bias, enabled)
    theirs.apply_lora_full_linear(c2, h, w, bias, enabled)
    _close(c1, c2, 2 * _tol(dtype))


@pytest.mark.parametrize("aliases", [False, True])
def test_weights_written_after_a_step_are_seen(aliases):
    # vLLM writes a slot's weights in place when it activates an adapter: the
    # transposed copy lorahook keeps must follow.  With ``aliases``, every call after
    # the first hands new tensor objects of the layer's memory, as a compiled graph may:
    # they find the layer's entry by address and never grow the by-id cache
    gen = torch.Generator().manual_seed(4)
    a = (_stack((SLOTS, 1, 8, 16), torch.float32, gen),)
    b = (torch.zeros(SLOTS, 1, 12, 8),)
    x = _stack((len(TOKENS), 16), torch.float32, gen)
    ours, theirs = _wrappers()
    covered = [r for r, s in enumerate(_slot_of(TOKENS)) if s >= 0]
    for step in range(3):
        y1, y2 = torch.zeros(len(TOKENS), 12), torch.zeros(len(TOKENS), 12)
        mine = ((a[0].view(a[0].shape),), (b[0][:],)) if aliases and step else (a, b)
        ours.add_lora_linear(y1, x, *mine, 1.0, (12,))
        theirs.add_lora_linear(y2, x, a, b, 1.0, (12,))
        if step:
            _close(y1[covered], y2[covered], 1e-5)
            assert y1[covered].abs().sum() > 0
        else:
            assert not y1.any()
            b[0][2, 0].copy_(torch.randn(12, 8, generator=gen))  # slot 2 activated
    assert len(ours._pairs) == 1 and len(ours._pairs_by_id) == 1


def test_an_output_the_kernels_cannot_view_goes_to_vllms_op():
    # rows that are not adjacent values (a transposed tensor): vLLM's own op serves the
    # call, in place all the same, never into a copy
    gen = torch.Generator().manual_seed(5)
    n, d_in, d_out, rank = len(TOKENS), 16, 12, 4
    a = (_stack((SLOTS, 1, rank, d_in), torch.float32, gen),)
    b = (_stack((SLOTS, 1, d_out, rank), torch.float32, gen),)
    x = _stack((n, d_in), torch.float32, gen)
    y = _stack((d_out, n), torch.float32, gen).t()  # (n, d_out), column stride n
    y0 = y.clone()
    ours, _ = _wrappers()
    ours.add_lora_linear(y, x, a, b, 1.0, (d_out,))
    slots = _slot_of(TOKENS)
    covered = [r for r, s in enumerate(slots) if s >= 0]
    ref = y0.double().clone()
    for r in covered:
        ref[r] += b[0][slots[r], 0].double() @ (a[0][slots[r], 0].double() @ x[r].double())
    _close(y[covered], ref[covered], 1e-5)


def test_no_adapter_step_writes_nothing():
    mapping = LoRAMapping([0] * 5, [0, 0], is_prefill=True)
    w = lv.PunicaWrapperLorahook(64, 16, "cpu")
    w.update_metadata(mapping, list(IDS), SLOTS + 1, 100)
    y = torch.full((5, 8), float("nan"))
    w.add_lora_linear(y, torch.ones(5, 4), (torch.ones(SLOTS, 1, 2, 4),),
                      (torch.ones(SLOTS, 1, 8, 2),), 1.0, (8,))
    assert torch.isnan(y).all()


# --------------------------------------------------------------------------- the plugin

class _Platform:
    def __init__(self, cpu=True, wrapper=plugin._CPU_QUALNAME):
        self._cpu, self._wrapper = cpu, wrapper

    def is_cpu(self):
        return self._cpu

    def get_punica_wrapper(self):
        return self._wrapper


def test_declines_off_cpu_and_on_other_wrappers():
    assert "not a CPU" in plugin._why_not(_Platform(cpu=False))
    assert "not vLLM's CPU wrapper" in plugin._why_not(_Platform(wrapper="other.Wrapper"))
    assert plugin._why_not(_Platform()) is None


def test_declines_an_unknown_wrapper_interface():
    class Changed:
        def update_metadata(self, mapping, lora_index_to_id, max_loras, vocab_size):
            pass

        def add_shrink(self, y, x, lora_a_stacked):  # "scale" gone
            pass
    reason = plugin._interface_mismatch(Changed)
    assert reason == "Changed.add_shrink has no parameter scale"


def test_declines_vllm_0_30_without_apply_lora_full_linear():
    # vLLM 0.30's CPU wrapper: every method lorahook implements but the full-linear one
    members = {name: getattr(PunicaWrapperCPU, name) for name in plugin._INTERFACE
               if name != "apply_lora_full_linear"}
    members.update(token_lora_indices=PunicaWrapperCPU.token_lora_indices,
                   sampler_indices=PunicaWrapperCPU.sampler_indices)
    old = type("PunicaWrapperCPU", (), members)
    assert plugin._interface_mismatch(old) == "PunicaWrapperCPU has no method apply_lora_full_linear"


def test_register_never_raises(monkeypatch, caplog):
    def boom(platform):
        raise RuntimeError("a surprise")
    monkeypatch.setattr(plugin, "_why_not", boom)
    with caplog.at_level(logging.INFO, logger="vllm.lorahook"):
        assert lv.register() is None
    assert "not active: RuntimeError: a surprise" in caplog.text


def test_register_names_the_wrapper_on_this_cpu(monkeypatch, caplog):
    from vllm.platforms import current_platform
    for name in ("get_punica_wrapper", "check_and_update_config"):
        monkeypatch.setattr(current_platform, name, getattr(current_platform, name),
                            raising=False)
    with caplog.at_level(logging.INFO, logger="vllm.lorahook"):
        lv.register()
    assert current_platform.get_punica_wrapper() == lv.QUALNAME
    assert f"runs on lorahook's kernels ({lv.QUALNAME})" in caplog.text
    assert issubclass(lv.PunicaWrapperLorahook, PunicaWrapperCPU)


def test_entry_point_is_installed():
    from importlib.metadata import entry_points
    found = [e for e in entry_points(group="vllm.general_plugins") if e.name == "lorahook"]
    assert [e.value for e in found] == ["lorahook.vllm:register"]


# --------------------------------------------------------------------------- ranks, threads

def _padded(dtype, gen, rmax=64, rank=8, slices=(40, 8, 8), d_in=48):
    """Stacked tensors padded to ``rmax`` as vLLM keeps them, slots of rank ``rank``."""
    a = tuple(torch.zeros(SLOTS, 1, rmax, d_in, dtype=dtype) for _ in slices)
    b = tuple(torch.zeros(SLOTS, 1, s, rmax, dtype=dtype) for s in slices)
    for i, s in enumerate(slices):
        for slot in range(SLOTS):
            if IDS[slot] is None or (i == 1 and slot == 3):  # slot 3 has no k slice
                continue
            a[i][slot, 0, :rank].copy_(_stack((rank, d_in), dtype, gen))
            b[i][slot, 0, :, :rank].copy_(_stack((s, rank), dtype, gen))
    return a, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_slot_padded_to_the_servers_rank_costs_its_own_rank(dtype):
    gen = torch.Generator().manual_seed(6)
    slices = (40, 8, 8)
    a, b = _padded(dtype, gen, slices=slices)
    x = _stack((len(TOKENS), 48), dtype, gen)
    y0 = _stack((len(TOKENS), sum(slices)), dtype, gen)
    ours, theirs = _wrappers(prefill=False)
    y1, y2 = y0.clone(), y0.clone()
    ours.add_lora_linear(y1, x, a, b, 1.0, slices)
    theirs.add_lora_linear(y2, x, a, b, 1.0, slices)
    covered = [r for r, s in enumerate(_slot_of(TOKENS)) if s >= 0]
    _close(y1[covered], y2[covered], 2 * _tol(dtype))
    pairs = ours._pairs_of(a, b)
    assert [r.tolist() for r in pairs.ranks] == [[8, 0, 8, 8], [8, 0, 8, 0], [8, 0, 8, 8]]
    # B is kept transposed in the model's dtype, not as a float32 copy
    assert all(t.dtype == dtype and t.shape == (SLOTS, 64, s) for t, s in zip(pairs.bt, slices))
    # vLLM activates an adapter of rank 3 in slot 2 (zeroing the slot, then writing it)
    for i, s in enumerate(slices):
        a[i][2] = 0
        b[i][2] = 0
        a[i][2, 0, :3].copy_(_stack((3, 48), dtype, gen))
        b[i][2, 0, :, :3].copy_(_stack((s, 3), dtype, gen))
    y1, y2 = y0.clone(), y0.clone()
    ours.add_lora_linear(y1, x, a, b, 1.0, slices)
    theirs.add_lora_linear(y2, x, a, b, 1.0, slices)
    _close(y1[covered], y2[covered], 2 * _tol(dtype))
    assert [r.tolist()[2] for r in pairs.ranks] == [3, 3, 3]


def test_a_projection_no_adapter_touches_is_left_alone():
    # vLLM wraps every linear layer; one the adapters do not target holds zeros in all slots
    a = (torch.zeros(SLOTS, 1, 8, 16),)
    b = (torch.zeros(SLOTS, 1, 12, 8),)
    y0 = torch.randn(len(TOKENS), 12)
    ours, _ = _wrappers(prefill=False)
    y = y0.clone()
    ours.add_lora_linear(y, torch.full((len(TOKENS), 16), float("inf")), a, b, 1.0, (12,))
    assert torch.equal(y, y0)
    assert not ours._pairs_of(a, b).used


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_threads_give_the_same_bits(monkeypatch, dtype):
    gen = torch.Generator().manual_seed(7)
    slices = (40, 8, 8)
    a, b = _padded(dtype, gen, rmax=16, slices=slices)
    x = _stack((len(TOKENS), 48), dtype, gen)
    y0 = _stack((len(TOKENS), sum(slices)), dtype, gen)
    outs = []
    for threads in ("1", "2", "2"):
        monkeypatch.setenv("LORAHOOK_VLLM_THREADS", threads)
        ours, _ = _wrappers(prefill=True)
        assert (ours._team.n_threads if ours._team else 1) == int(threads)
        y = y0.clone()
        ours.add_lora_linear(y, x, a, b, 0.5, slices)
        outs.append(y)
    assert torch.equal(outs[0].view(torch.uint8), outs[1].view(torch.uint8))
    assert torch.equal(outs[1].view(torch.uint8), outs[2].view(torch.uint8))


def test_threads_setting_is_checked(monkeypatch):
    monkeypatch.setenv("LORAHOOK_VLLM_THREADS", "two")
    with pytest.raises(ValueError, match="LORAHOOK_VLLM_THREADS must be a positive integer"):
        _wrappers()


# --------------------------------------------------------------------------- compiled


class _Counting:
    """A torch.compile backend that counts the graphs it is given, then compiles them with Inductor."""

    def __init__(self):
        self.graphs = 0
        self.ops = []  # how each lorahook op gets the wrapper's handle

    def __call__(self, gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx
        self.graphs += 1
        self.ops += [n.args[0].op for n in gm.graph.nodes if "lorahook.punica" in str(n.target)]
        return compile_fx(gm, example_inputs)


def _delta_reference(y0, x, a, b, slices, slots, scale):
    ref = y0.double().clone()
    off = 0
    for i, size in enumerate(slices):
        for r, s in enumerate(slots):
            if s >= 0:
                ref[r, off:off + size] += scale * (b[i][s, 0].double() @ (a[i][s, 0].double()
                                                                           @ x[r].double()))
        off += size
    return ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_compiled_graph_follows_every_steps_grouping(dtype):
    # one graph, compiled once with a dynamic row count, run on steps whose rows, slots
    # and sizes all differ: the grouping is read when the op runs, never baked in
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(11)
    d_in, slices, rank = 48, (32, 16, 16), 8
    a = tuple(_stack((SLOTS, 1, rank, d_in), dtype, gen) for _ in slices)
    b = tuple(_stack((SLOTS, 1, s, rank), dtype, gen) for s in slices)
    wrapper = lv.PunicaWrapperLorahook(64, 16, "cpu")
    backend = _Counting()

    @torch.compile(backend=backend, fullgraph=True, dynamic=True)
    def project(y, x):
        wrapper.add_lora_linear(y, x, a, b, 0.5, slices)
        return y * 1  # a use of the written output after the op, inside the graph

    steps = [TOKENS, [3, 0, 0, 9, 7, 7, 3], [9] * 5 + [0] * 4 + [7] * 2, [0, 0, 0]]
    for tokens in steps:
        wrapper.update_metadata(LoRAMapping(tokens, tokens, is_prefill=True), list(IDS),
                                SLOTS + 1, 100)
        x = _stack((len(tokens), d_in), dtype, gen)
        y = _stack((len(tokens), sum(slices)), dtype, gen)
        y0 = y.clone()
        got = project(y, x)
        slots = _slot_of(tokens)
        ref = _delta_reference(y0, x, a, b, slices, slots, 0.5)
        _close(got, ref, _tol(dtype))
        _close(y, ref, _tol(dtype))  # the caller's output is written in place
        base = [r for r, s in enumerate(slots) if s < 0]
        assert torch.equal(got[base], y0[base])
    # one graph; the handle is one of its inputs (bound from the live wrapper at every
    # call), not a constant baked into it
    assert (backend.graphs, backend.ops) == (1, ["placeholder"])


def test_the_custom_op_traces_as_a_write_of_its_output():
    from torch._subclasses.fake_tensor import FakeTensorMode
    op = torch.ops.lorahook.punica.default
    assert op._schema.arguments[2].alias_info.is_write  # y
    assert not any(arg.alias_info and arg.alias_info.is_write
                   for arg in op._schema.arguments[3:])
    with FakeTensorMode():
        y, x = torch.empty(5, 8), torch.empty(5, 4)
        a, b = [torch.empty(SLOTS, 1, 2, 4)], [torch.empty(SLOTS, 1, 8, 2)]
        assert op(torch.empty(1), pack_call("linear", 0, True), y, x, a, b, 1.0) is None


def test_the_custom_op_names_a_handle_that_is_no_wrappers():
    with pytest.raises(RuntimeError, match="no live wrapper's in this process"):
        torch.ops.lorahook.punica(torch.zeros(1), pack_call("linear", 0, True),
                                  torch.zeros(2, 4), torch.zeros(2, 4), [], [], 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_shrink_and_expand_equal_vllm(dtype):
    # the op's one int carries method, add and offset; the slices come from B's heights:
    # the compiled calls against vLLM's own CPU ops, eager, on the same step
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(12)
    n, d_in, slices, rank, offset = len(TOKENS), 40, (24, 16), 8, 8
    a = tuple(_stack((SLOTS, 1, rank, d_in), dtype, gen) for _ in slices)
    b = tuple(_stack((SLOTS, 1, s, rank), dtype, gen) for s in slices)
    x = _stack((n, d_in), dtype, gen)
    y0 = _stack((n, offset + sum(slices) + 4), dtype, gen)
    ours, theirs = _wrappers()

    def project(wrapper, y, add):
        buf = torch.zeros(len(slices), n, rank)
        wrapper.add_shrink(buf, x, a, 2.0)
        wrapper.add_expand(y, buf, b, slices, offset_start=offset, add_inputs=add)
        return y * 1

    backend = _Counting()
    compiled = torch.compile(project, backend=backend, fullgraph=True)
    covered = [r for r, s in enumerate(_slot_of(TOKENS)) if s >= 0]
    base = [r for r in range(n) if r not in covered]
    cols = slice(offset, offset + sum(slices))
    for add in (True, False):
        got = compiled(ours, y0.clone(), add)
        ref = project(theirs, y0.clone(), add)
        _close(got[covered][:, cols], ref[covered][:, cols], 2 * _tol(dtype))
        # outside the slices' columns nothing is written, nor are base rows when adding
        assert torch.equal(got[:, :offset], y0[:, :offset])
        assert torch.equal(got[:, cols.stop:], y0[:, cols.stop:])
        if add:
            assert torch.equal(got[base], y0[base])
    assert backend.ops == ["placeholder"] * 4  # shrink and expand, one graph for each add


def test_a_compiled_call_whose_slices_are_not_bs_is_named():
    torch._dynamo.reset()
    wrapper = _wrappers()[0]
    a, b = (torch.zeros(SLOTS, 1, 4, 8),), (torch.zeros(SLOTS, 1, 6, 4),)

    @torch.compile(backend="eager", fullgraph=True)
    def project(y, x):
        wrapper.add_lora_linear(y, x, a, b, 1.0, (5,))
        return y

    with pytest.raises(Exception, match=r"output slices \(5,\) are not its B tensors' "
                                        r"heights \(6,\)"):
        project(torch.zeros(len(TOKENS), 6), torch.zeros(len(TOKENS), 8))


class _CompilingPlatform:
    """vLLM's CPU platform as far as its LoRA rule goes: LoRA turns compilation off."""

    @classmethod
    def check_and_update_config(cls, config):
        config.compilation_config.backend = "inductor"
        if config.compilation_config.mode == M.VLLM_COMPILE:
            config.compilation_config.mode = M.DYNAMO_TRACE_ONCE
        if config.lora_config is not None:
            config.compilation_config.mode = M.NONE


def _config(mode, lora):
    from types import SimpleNamespace
    return SimpleNamespace(lora_config=lora,
                           compilation_config=SimpleNamespace(mode=mode, backend=None))


@pytest.mark.parametrize("setting, expected", [("", "DYNAMO_TRACE_ONCE"),
                                               ("1", "DYNAMO_TRACE_ONCE"), ("0", "NONE")])
def test_the_platform_keeps_compiling_with_lora_unless_told_not_to(monkeypatch, setting,
                                                                   expected):
    monkeypatch.setenv("LORAHOOK_VLLM_COMPILE", setting)
    platform = _CompilingPlatform()
    plugin._keep_compiling(platform)
    plugin._keep_compiling(platform)  # twice: wrapped once
    lora = object()
    config = _config(M.VLLM_COMPILE, lora)
    platform.check_and_update_config(config)
    assert config.compilation_config.mode == M[expected]
    assert config.lora_config is lora and config.compilation_config.backend == "inductor"
    # what the user chose stays theirs: eager with LoRA, and everything without LoRA
    for mode, lora in ((M.NONE, lora), (M.VLLM_COMPILE, None), (M.NONE, None)):
        config = _config(mode, lora)
        platform.check_and_update_config(config)
        assert config.compilation_config.mode == (M.NONE if mode == M.NONE or (
            lora is not None and setting == "0") else M.DYNAMO_TRACE_ONCE)


def test_a_wrong_compile_setting_is_named_and_vllm_decides(monkeypatch, caplog):
    monkeypatch.setenv("LORAHOOK_VLLM_COMPILE", "yes")
    platform = _CompilingPlatform()
    with caplog.at_level(logging.INFO, logger="vllm.lorahook"):
        plugin._keep_compiling(platform)
    config = _config(M.VLLM_COMPILE, object())
    platform.check_and_update_config(config)
    assert config.compilation_config.mode == M.NONE
    assert "LORAHOOK_VLLM_COMPILE must be 0 or 1, got 'yes'" in caplog.text
