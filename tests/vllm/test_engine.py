"""lorahook inside a real vLLM engine: greedy tokens against vLLM's own kernels and PEFT.

Each engine runs in a process of its own (tests/support/vllm_run.py); engine starts
are few and shared by module-scoped fixtures.  A missing vLLM skips this
module, or fails it with LORAHOOK_REQUIRE_VLLM=1.
"""
import os
import tempfile

import pytest

from required import need

need("torch", "LORAHOOK_REQUIRE_VLLM")
need("vllm", "LORAHOOK_REQUIRE_VLLM")
need("peft", "LORAHOOK_REQUIRE_VLLM")
need("httpx", "LORAHOOK_REQUIRE_VLLM")
from vllm_files import assert_same_or_tie, int8_copy, peft_greedy, save_model_and_adapters  # noqa: E402
from vllm_run import launch  # noqa: E402

TOKENS = 10
# adapters on q_proj v_proj o_proj down_proj, and one on every projection (vLLM merges
# q/k/v into one qkv_proj and gate/up into gate_up_proj: slices of one linear)
NAMES = ["alpha", "beta", "gamma"]
MERGED = "merged"
EMBED = "embed"  # LoRA on embed_tokens and lm_head too, which vLLM accepts
# rank 16 on one slice of qkv_proj, one of gate_up_proj and lm_head: with max_loras 2 the
# slots are reused, at rank 8 and 16, for adapters on other modules
R16 = "r16"
PROMPTS = [[1, 10, 11, 12, 13], [1, 20, 21], [1, 5, 6, 7, 8, 9], [1, 30, 31, 32],
           [1, 40, 41, 42, 43, 44, 45], [1, 50, 51], [1, 12, 22, 32], [1, 9, 8, 7, 6],
           [1, 33, 44, 55], [1, 6, 16, 26, 36], [1, 7, 8, 9], [1, 44, 45, 46, 47]]
ROWS = ["alpha", "beta", None, "gamma", MERGED, None, "beta", MERGED, EMBED, EMBED, R16, R16]


@pytest.fixture(scope="module")
def files():
    with tempfile.TemporaryDirectory(prefix="lorahook-vllm-") as tmp:
        model_dir, adapters, _ = save_model_and_adapters(tmp, NAMES)
        save_model_and_adapters(tmp, [MERGED], target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
        save_model_and_adapters(tmp, [EMBED], target_modules=[
            "q_proj", "v_proj", "embed_tokens", "lm_head"])
        save_model_and_adapters(tmp, [R16], r=16, target_modules=["q_proj", "gate_proj",
                                                                   "lm_head"])
        yield model_dir, adapters


def run(spec, **env):
    """tests/support/vllm_run.py on ``spec`` in a fresh process; its answer and output."""
    return launch(spec, env, timeout=900)


def offline(files, dtype="float32", max_lora_rank=16, **env):
    model_dir, adapters = files
    # max_loras 2 < 5 adapters: slots are reused (LRU) within one generate call
    return run(dict(mode="offline", model=model_dir, adapters=adapters, names=ROWS,
                    prompts=PROMPTS, max_tokens=TOKENS, max_loras=2, max_cpu_loras=6,
                    dtype=dtype, max_lora_rank=max_lora_rank), **env)


@pytest.fixture(scope="module")
def float32_runs(files):
    return offline(files), offline(files, VLLM_PLUGINS="none")


@pytest.fixture(scope="module")
def references(files):
    model_dir, adapters = files
    return [peft_greedy(model_dir, os.path.join(adapters, n) if n else None, p, TOKENS)
            for p, n in zip(PROMPTS, ROWS)]


def test_the_plugin_serves_and_turns_off(float32_runs):
    (ours, log), (theirs, _) = float32_runs
    assert ours["wrapper"] == "lorahook.vllm.PunicaWrapperLorahook"
    assert "Using PunicaWrapperLorahook" in log
    assert "runs on lorahook's kernels" in log
    assert theirs["wrapper"] == "vllm.lora.punica_wrapper.punica_cpu.PunicaWrapperCPU"


def test_slots_refer_to_the_adapters_and_embeddings_keep_vllms(float32_runs):
    # linear layers and the logits hold each adapter's own tensors at its own rank; the
    # embedding's forward reads vLLM's stacked A itself: it keeps vLLM's slots, said once
    (_, log), (_, their_log) = float32_runs
    assert "lorahook: LoRA slots refer to each adapter's own tensors at its own rank" in log
    kept = [line for line in log.splitlines() if "layers keep vLLM's slots" in line]
    assert len(kept) == 1, kept
    assert ("VocabParallelEmbeddingWithLoRA layers keep vLLM's slots (--max-loras x "
            "--max-lora-rank): its forward reads vLLM's stacked A itself") in kept[0]
    assert "keep vLLM's slots" not in their_log and "LoRA slots refer" not in their_log


def test_the_plugin_keeps_vllms_compiler_with_lora(float32_runs):
    # vLLM's defaults (no enforce_eager): vLLM alone turns compilation off when LoRA is on;
    # with the plugin the model is compiled, lorahook's calls custom ops in its graph
    (_, log), (_, their_log) = float32_runs
    assert "lorahook: vLLM compiles with LoRA (compilation mode DYNAMO_TRACE_ONCE)" in log
    assert "'mode': <CompilationMode.DYNAMO_TRACE_ONCE: 2>" in log
    assert "'mode': <CompilationMode.NONE: 0>" in their_log


def test_the_compile_switch_gives_vllm_its_choice_back(files, references):
    # and vLLM's stacked slots (LORAHOOK_VLLM_SLOTS=stacked), which lorahook's kernels read
    # at each slot's real rank as they did before slots held adapters' own tensors
    eager, log = offline(files, LORAHOOK_VLLM_COMPILE="0", LORAHOOK_VLLM_SLOTS="stacked")
    assert eager["wrapper"] == "lorahook.vllm.PunicaWrapperLorahook"
    assert "LORAHOOK_VLLM_COMPILE=0: vLLM decides whether to compile with LoRA" in log
    assert "layers keep vLLM's slots (--max-loras x --max-lora-rank): LORAHOOK_VLLM_SLOTS" in log
    assert "'mode': <CompilationMode.NONE: 0>" in log
    exact = 0
    for i, (got, (ref, top2)) in enumerate(zip(eager["tokens"], references)):
        exact += assert_same_or_tie(got, ref, top2, 1e-3, f"row {i} ({ROWS[i]})")
    assert exact >= len(ROWS) - 1


def test_mixed_generate_equals_peft_adapter_by_adapter(float32_runs, references):
    (ours, _), _ = float32_runs
    exact = 0
    for i, (got, (ref, top2)) in enumerate(zip(ours["tokens"], references)):
        exact += assert_same_or_tie(got, ref, top2, 1e-3, f"row {i} ({ROWS[i]})")
    assert exact >= len(ROWS) - 1  # a tie is the exception, not the rule


def test_mixed_generate_equals_vllms_own_kernels(float32_runs):
    (ours, _), (theirs, _) = float32_runs
    for i, name in enumerate(ROWS):
        # vLLM's own CPU ops index the stacked weights with -1 for a row without an
        # adapter, which adds the last slot's adapter to it when that slot is taken:
        # base rows are compared with transformers above, not with vLLM's own path
        if name is None:
            continue
        assert_same_or_tie(ours["tokens"][i], theirs["tokens"][i],
                           theirs["logprobs"][i], 1e-3, f"row {i} ({name})")


def test_two_threads_and_padded_ranks_equal_vllms_own_kernels(files, float32_runs):
    # vLLM on two threads with --max-lora-rank 64 for adapters of rank 8 and 16: lorahook's
    # kernels run on vLLM's two OpenMP threads, each slot at its adapter's own rank
    _, (theirs, _) = float32_runs
    ours, log = offline(files, max_lora_rank=64, VLLM_CPU_OMP_THREADS_BIND="0-1")
    assert ours["wrapper"] == "lorahook.vllm.PunicaWrapperLorahook"
    assert "lorahook: LoRA runs on 2 thread(s)" in log
    for i, name in enumerate(ROWS):
        if name is None:
            continue
        assert_same_or_tie(ours["tokens"][i], theirs["tokens"][i], theirs["logprobs"][i], 1e-3,
                           f"row {i} ({name})")


def test_int8_adapters_equal_peft_on_their_int8_values(files, float32_runs):
    # LORAHOOK_VLLM_ADAPTER_DTYPE=int8: each slot's factors quantized once when vLLM sets
    # it; greedy tokens as PEFT's on adapters holding those int8 values (the embeddings'
    # factors as they were: they keep vLLM's slots), and often as the float32 run's
    model_dir, adapters = files
    ours, log = offline(files, LORAHOOK_VLLM_ADAPTER_DTYPE="int8")
    assert ours["wrapper"] == "lorahook.vllm.PunicaWrapperLorahook"
    assert "lorahook: adapters held in int8 in lorahook's slots" in log
    assert ("VocabParallelEmbeddingWithLoRA layers keep vLLM's slots (--max-loras x "
            "--max-lora-rank, in vLLM's LoRA dtype, not int8)") in log
    int8_dirs = {n: int8_copy(os.path.join(adapters, n), os.path.join(adapters, "..", "int8", n))
                 for n in set(ROWS) - {None}}
    exact = same_as_f32 = 0
    (f32, _), _ = float32_runs
    for i, (name, prompt) in enumerate(zip(ROWS, PROMPTS)):
        ref, top2 = peft_greedy(model_dir, int8_dirs.get(name), prompt, TOKENS)
        exact += assert_same_or_tie(ours["tokens"][i], ref, top2, 1e-3, f"row {i} ({name})")
        same_as_f32 += ours["tokens"][i] == f32["tokens"][i]
    assert exact >= len(ROWS) - 1
    # this random model's logits lie close together (8 of 12 rows measured the same as
    # float32 over 10 tokens); the share on a well-separated model is the guide's, from
    # tests/oracle/test_int8_torch.py
    assert same_as_f32 >= len(ROWS) - 4, same_as_f32


def _tighter(one, other):
    """Per step, whichever of two runs' top-two log-probabilities lie closer together."""
    return [a if a[0] - a[1] <= b[0] - b[1] else b for a, b in zip(one, other)]


def test_bfloat16_equals_vllms_own_kernels(files):
    # on two threads: lorahook's kernels split each projection over vLLM's threads, in the
    # compiled model, against vLLM's own kernels in its uncompiled one
    two = dict(VLLM_CPU_OMP_THREADS_BIND="0-1")
    ours, log = offline(files, "bfloat16", **two)
    theirs, _ = offline(files, "bfloat16", VLLM_PLUGINS="none", **two)
    assert ours["wrapper"] == "lorahook.vllm.PunicaWrapperLorahook"
    assert "lorahook: LoRA runs on 2 thread(s)" in log
    assert "lorahook: vLLM compiles with LoRA" in log
    exact = 0
    for i, name in enumerate(ROWS):
        if name is None:
            continue
        # vLLM's own ops multiply in bfloat16, lorahook's in float32 and round once, and
        # Inductor rounds the model's own bfloat16 intermediates elsewhere than eager
        # PyTorch: this model's logits (around 10, where a bfloat16 step is 0.06) may part
        # where either run saw its top two within a few steps of each other
        exact += assert_same_or_tie(ours["tokens"][i], theirs["tokens"][i],
                                    _tighter(ours["logprobs"][i], theirs["logprobs"][i]),
                                    0.5, f"row {i} ({name})")
    assert exact >= 4


def test_openai_server_loads_and_unloads_at_run_time(files, references):
    model_dir, adapters = files
    # max_loras 2: alpha and delta take both slots; once delta is unloaded, epsilon (rank
    # 16, other modules) is loaded and served in a slot an adapter left
    steps = [("complete", "alpha", 0),
             ("load", "delta", "beta"), ("complete", "delta", 1),
             ("unload", "delta"), ("complete", "delta", 1),
             ("load", "epsilon", R16), ("complete", "epsilon", 10),
             ("complete", "base", 2)]
    out, log = run(dict(mode="server", model=model_dir, adapters=adapters, names=["alpha"],
                        prompts=PROMPTS, max_tokens=TOKENS, max_loras=2, max_lora_rank=16,
                        steps=steps,
                        log=os.path.join(os.path.dirname(model_dir), "server.log")))
    assert out["updates"] == [["load", "delta", 200], ["unload", "delta", 200],
                              ["load", "epsilon", 200]]
    (m0, s0, t0), (m1, s1, t1), (m2, s2, _), (m4, s4, t4), (m3, s3, t3) = out["completions"]
    assert (s0, s1, s2, s4, s3) == (200, 200, 404, 200, 200)
    for got, (ref, top2), what in ((t0, references[0], "alpha"), (t1, references[1], "delta"),
                                   (t4, references[10], "epsilon"),
                                   (t3, references[2], "base")):
        assert_same_or_tie(got, ref, top2, 1e-3, what)
    assert out["models"] == ["alpha", "base", "epsilon"]
    with open(os.path.join(os.path.dirname(model_dir), "server.log")) as f:
        text = f.read()
    assert "Using PunicaWrapperLorahook" in text, text[-6000:]
