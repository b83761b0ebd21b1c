"""What the server tests serve, made here (nothing is downloaded), and a PEFT reference.

A word-level ``tokenizers`` tokenizer with a chat template over a fixed
vocabulary, a random Llama, random PEFT LoRA adapters; a ``lorahook serve``
process started and stopped; the greedy tokens transformers + PEFT give for a
prompt.  ``benchmarks/serve_bench.py`` and ``benchmarks/vllm_bench.py`` serve
the same files at larger sizes (:data:`SIZES`).
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


def model(hidden=64, layers=2, intermediate=None, heads=4, kv_heads=2, context=256):
    import torch
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(SPECIAL) + len(WORDS), hidden_size=hidden,
        intermediate_size=intermediate or 2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=context, initializer_range=0.3, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)
    return transformers.LlamaForCausalLM(config).eval()


def save_model(path, chat=True, **size):
    model(**size).save_pretrained(path)
    tokenizer(chat).save_pretrained(path)
    return path


def save_adapter(path, seed, size=None, **lora):
    import torch
    from peft import LoraConfig, get_peft_model
    config = dict(r=8, lora_alpha=32, init_lora_weights=False,
                  target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])
    config.update(lora)
    base = model(**(size or {}))
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


def save_all(tmp, names=("alpha", "beta", "gamma"), **size):
    model_dir = save_model(os.path.join(tmp, "tiny-llama"), **size)
    adapters = os.path.join(tmp, "adapters")
    for seed, name in enumerate(names):
        save_adapter(os.path.join(adapters, name), 100 + seed, size)
    return model_dir, adapters


# Model shapes the benchmark serves (random weights, the test tokenizer's small vocabulary).
SIZES = {
    # a small model whose steps cost little next to HTTP streaming on a shared machine
    "small": dict(hidden=1024, layers=4),
    # the shape of a 0.5B decoder (Qwen2.5-0.5B's layers, as a Llama): what a CPU serves
    "0.5b": dict(hidden=896, layers=24, intermediate=4864, heads=14, kv_heads=2),
}


# --------------------------------------------------------------------------- a server process


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir, adapters, *extra, cwd=None, lines=None, env=None):
    """A ``lorahook serve`` process; returns ``(process, base URL)`` once it answers.

    Its output lines are appended to ``lines`` (a list) as they come; ``env``
    adds to its environment."""
    import subprocess
    import sys
    import threading
    port = _free_port()
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", **(env or {}))
    proc = subprocess.Popen([sys.executable, "-m", "lorahook", "serve", model_dir, "--adapters",
                             adapters, "--port", str(port), *extra],
                            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    ready = threading.Event()
    lines = [] if lines is None else lines

    def read():
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("lorahook serve: http"):
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(300):
        proc.kill()
        raise RuntimeError("the server did not start:\n" + "".join(lines[-30:]))
    return proc, f"http://127.0.0.1:{port}"


def stop_server(proc):
    import signal
    proc.send_signal(signal.SIGTERM)
    return proc.wait(120)



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
