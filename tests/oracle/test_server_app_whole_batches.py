"""``lorahook serve`` on a model whose cache cannot take rows (a sliding window): whole batches.

A small random Mistral with a 4-token sliding window: its cache has sliding-window
layers, so requests cannot join a running batch; the server says so in its stats and
still answers every request as transformers + PEFT do.  The server holds its adapter
in int8 (``--adapter-dtype int8``): PEFT's reference runs the adapter lorahook's
``save_peft`` writes from the int8 one (its dequantized float32 values), in
float32 as lorahook computes.
"""
import concurrent.futures
import os
import warnings

import pytest

from required import need as _need  # noqa: E402

for _module in ("ray.serve", "fastapi", "torch", "transformers", "peft", "tokenizers"):
    _need(_module)
openai = _need("openai")
httpx = _need("httpx")

import serve_files  # noqa: E402
from serve_files import start_server, stop_server  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def _save(tmp):
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model
    tok = serve_files.tokenizer()
    config = transformers.MistralConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=4, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, initializer_range=0.3)
    torch.manual_seed(0)
    model_dir = os.path.join(tmp, "tiny-mistral")
    transformers.MistralForCausalLM(config).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    torch.manual_seed(5)
    pm = get_peft_model(base, LoraConfig(r=8, lora_alpha=32, init_lora_weights=False,
                                         target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.mul_(3.0)
    adapters = os.path.join(tmp, "adapters")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm.save_pretrained(os.path.join(adapters, "windowed"))
    # the reference: the int8 adapter's values, as PEFT files
    from lorahook import LoraAdapter
    LoraAdapter.from_peft(os.path.join(adapters, "windowed"), dtype="int8").save_peft(
        os.path.join(tmp, "rounded", "windowed"))
    return model_dir, adapters


def test_a_sliding_window_model_is_served_in_whole_batches(tmp_path):
    import transformers
    model_dir, adapters = _save(str(tmp_path))
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    try:
        lines = []
        proc, url = start_server(model_dir, adapters, "--max-batch-size", "4",
                                 "--adapter-dtype", "int8", cwd=str(tmp_path), lines=lines)
    except RuntimeError as exc:
        pytest.fail(str(exc))
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        base = os.path.basename(model_dir)
        prompts = ["the cat sat on the mat", "hello world what is", "one two three four five"]
        asks = [(name, prompt) for name in (base, "windowed") for prompt in prompts]

        def ask(pair):
            name, prompt = pair
            return client.completions.create(model=name, prompt=prompt, max_tokens=10,
                                             temperature=0).choices[0].text

        with concurrent.futures.ThreadPoolExecutor(len(asks)) as ex:
            got = list(ex.map(ask, asks))
        for (name, prompt), text in zip(asks, got):
            ids = tok(prompt)["input_ids"]
            adapter = None if name == base else os.path.join(str(tmp_path), "rounded", name)
            want = serve_files.peft_reference(model_dir, adapter, ids, 10)
            want = want[:want.index(2)] if 2 in want else want
            assert text == tok.decode(want, skip_special_tokens=True), (name, prompt)
        chunks = list(client.completions.create(model="windowed", prompt=prompts[0],
                                                max_tokens=10, temperature=0, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == got[3]
        stats = httpx.get(url + "/lorahook/stats", timeout=30).json()
        assert stats["joining"] is False
        # the adapter is held in int8: a quarter of its float32 bytes, and the scales
        from lorahook import LoraAdapter
        f32 = LoraAdapter.from_peft(os.path.join(adapters, "windowed"))
        scales = sum(4 * (layer.rank + layer.d_out) for layer in f32.layers.values())
        assert stats["adapters"]["nbytes"] == f32.nbytes // 4 + scales
        assert any("adapters held in int8" in line for line in lines)
        assert sum(n for n, _ in stats["batches"]) == len(asks) + 1  # every request admitted
    finally:
        assert stop_server(proc) == 0
