"""Several BERT cross-encoder rerankers, chosen per row, in one forward.

    pip install lorahook torch==2.13.0 transformers peft
    python examples/cross_encoder_rerankers.py

A reranker fine-tuned with PEFT is a LoRA adapter on the encoder plus its own
classification head (``modules_to_save``: ``classifier``). lorahook serves many of
them on one base model: each row of the batch (a query-passage pair) is scored by
its own reranker -- the adapter's LoRA on the encoder, then its saved head -- and
rows without a reranker get the base model's head. The script builds a small random
BERT, saves three reranker adapters, scores a mixed batch once, and checks each row
against PEFT with that reranker alone.
"""
import tempfile

import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model

import lorahook
from lorahook.torch import attach

RERANKERS = ("news", "code", "legal")


def make_model():
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=128, num_labels=1)
    return transformers.BertForSequenceClassification(config).eval()


def save_reranker(path, seed):
    torch.manual_seed(seed)
    model = get_peft_model(make_model(), LoraConfig(
        task_type="SEQ_CLS", r=8, lora_alpha=16, init_lora_weights=False,
        target_modules=["query", "key", "value"]))
    with torch.no_grad():  # a head trained away from the base's
        model.base_model.model.classifier.modules_to_save["default"].weight.add_(0.1)
    model.save_pretrained(path)


def main():
    lorahook.threads.configure(blas_threads=1)  # the server setting (README, Threads)
    workdir = tempfile.mkdtemp(prefix="lorahook-rerank-")
    for i, name in enumerate(RERANKERS):
        save_reranker(f"{workdir}/{name}", 10 + i)
    model = make_model()
    adapters = lorahook.AdapterSet(lorahook.torch.geometry_of(model), resolver=workdir)
    attached = attach(model, adapters)
    names = ["news", "legal", None, "code", "news", "code"]
    pairs = torch.randint(1, 256, (len(names), 32), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(pairs)
    mask[2, 20:] = 0  # a padded pair
    with torch.inference_mode(), attached.sequences(names):  # rerankers load on first use
        scores = model(input_ids=pairs, attention_mask=mask).logits[:, 0]
    for i, name in enumerate(names):
        alone = make_model() if name is None else PeftModel.from_pretrained(make_model(), f"{workdir}/{name}")
        with torch.inference_mode():
            ref = alone(input_ids=pairs[i:i + 1], attention_mask=mask[i:i + 1]).logits[0, 0]
        print(f"row {i} {str(name):>6}: score {float(scores[i]):+.5f}  PEFT alone {float(ref):+.5f}")
        assert abs(float(scores[i]) - float(ref)) <= 1e-5 * max(1.0, abs(float(ref)))


if __name__ == "__main__":
    main()
