"""The serve engine's batched, per-request decoding against transformers + PEFT."""
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("tokenizers")

import lorahook  # noqa: E402
from lorahook._engine import Batch, Request  # noqa: E402
from lorahook.torch import attach, geometry_of  # noqa: E402

import serve_files  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return serve_files.save_all(str(tmp_path_factory.mktemp("serve")))


def run(batch):
    chunks = [[] for _ in batch.requests]
    while not batch.done:
        for i, report in enumerate(batch.step()):
            if report is not None:
                chunks[i].append(report)
    return chunks


def test_a_mixed_batch_equals_each_request_alone(files):
    import transformers
    model_dir, adapters = files
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    aset = lorahook.AdapterSet(geometry_of(model), resolver=adapters)
    attached = attach(model, aset)
    prompts = ["the cat sat on the mat", "hello world", "one two three four five six",
               "what is the sky"]
    names = ["alpha", None, "beta", "alpha"]
    lengths = [9, 4, 12, 6]
    ids = [tok(p)["input_ids"] for p in prompts]
    reqs = [Request(i, max_tokens=n, temperature=0.0) for i, n in zip(ids, lengths)]
    batch = Batch(model, tok, attached, names, reqs, 0, [2])
    chunks = run(batch)
    for i, name in enumerate(names):
        want = serve_files.peft_reference(model_dir, None if name is None else
                                          os.path.join(adapters, name), ids[i], lengths[i])
        want = [t for t in want if t != 2][:len(batch.generated[i])]
        assert batch.generated[i] == want, (name, batch.generated[i], want)
        text = "".join(c[0] for c in chunks[i])
        assert text == tok.decode(batch.generated[i], skip_special_tokens=True)
        assert chunks[i][-1][1] in ("stop", "length")
        assert all(c[1] is None for c in chunks[i][:-1])


def test_stop_strings_seeds_and_top_p(files):
    import transformers
    model_dir, adapters = files
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    attached = attach(model, lorahook.AdapterSet(geometry_of(model), resolver=adapters))
    ids = tok("the cat sat")["input_ids"]
    full = run(Batch(model, tok, attached, [None], [Request(ids, 10, 0.0)], 0, [2]))
    text = "".join(c[0] for c in full[0])
    words = text.split()
    assert len(words) >= 3
    stop = words[2]
    cut = run(Batch(model, tok, attached, [None], [Request(ids, 10, 0.0, stop=[stop])], 0, [2]))
    assert "".join(c[0] for c in cut[0]) == text[:text.find(stop)]
    assert cut[0][-1][1] == "stop"
    sampled = [run(Batch(model, tok, attached, ["beta"] * 2,
                         [Request(ids, 8, 1.3, 0.9, seed=7)] * 2, 0, [2])) for _ in range(2)]
    assert sampled[0] == sampled[1]  # seeded: the same text every time, on every row
    assert sampled[0][0] == sampled[0][1]
