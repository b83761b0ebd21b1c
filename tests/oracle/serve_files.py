"""A small causal LM with a locally built tokenizer and chat template, and PEFT adapters.

Nothing is downloaded: the tokenizer is a word-level ``tokenizers`` model over a
fixed vocabulary, the model a random Llama, the adapters random PEFT LoRA.
"""
import os
import warnings

WORDS = ("the a cat dog sat on mat red blue green fast slow runs jumps over under and or "
         "not yes no one two three four five six seven eight nine ten hello world what is "
         "why how who where when big small old new good bad sun moon star sky sea tree "
         "user assistant system say tell me you it this that").split()
SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant{% endif %}")


def tokenizer(chat=True):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>",
                                   chat_template=CHAT_TEMPLATE if chat else None)


def model():
    import torch
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(SPECIAL) + len(WORDS), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, initializer_range=0.3, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)
    return transformers.LlamaForCausalLM(config).eval()


def save_model(path, chat=True):
    model().save_pretrained(path)
    tokenizer(chat).save_pretrained(path)
    return path


def save_adapter(path, seed, **lora):
    import torch
    from peft import LoraConfig, get_peft_model
    config = dict(r=8, lora_alpha=32, init_lora_weights=False,
                  target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])
    config.update(lora)
    base = model()
    torch.manual_seed(seed)  # after the model, which seeds its own weights
    pm = get_peft_model(base, LoraConfig(**config))
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.mul_(3.0)  # an adapter that changes greedy tokens
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm.save_pretrained(path)
    return path


def save_all(tmp, names=("alpha", "beta", "gamma")):
    model_dir = save_model(os.path.join(tmp, "tiny-llama"))
    adapters = os.path.join(tmp, "adapters")
    for seed, name in enumerate(names):
        save_adapter(os.path.join(adapters, name), 100 + seed)
    return model_dir, adapters


def peft_reference(model_dir, adapter_dir, prompt_ids, max_new_tokens):
    """Greedy tokens of transformers (+ PEFT with ``adapter_dir``) for one prompt."""
    import torch
    import transformers
    from peft import PeftModel
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    m = base if adapter_dir is None else PeftModel.from_pretrained(base, adapter_dir).eval()
    with torch.inference_mode():
        out = m.generate(input_ids=torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=0, eos_token_id=2)
    return out[0, len(prompt_ids):].tolist()
