"""The serve engine's batched, per-request decoding against transformers + PEFT."""
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("tokenizers")

import lorahook  # noqa: E402
from lorahook.server.engine import Batch, Request  # noqa: E402
from lorahook.torch import attach, geometry_of  # noqa: E402

import serve_files  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return serve_files.save_all(str(tmp_path_factory.mktemp("serve")))


def make(model, tok, attached, names, reqs, can_join=None):
    batch = Batch(model, tok, attached, 0, [2], can_join)
    lives = batch.admit(names, reqs)
    return batch, lives


def run(batch, lives=None, chunks=None, steps=None):
    """Step ``batch`` (until done, or ``steps`` times); chunks per request, by admission."""
    chunks = {} if chunks is None else chunks
    while not batch.done and steps != 0:
        for live, report in zip(list(batch.open), batch.step()):
            if report is not None:
                chunks.setdefault(live.index, []).append(report)
        steps = None if steps is None else steps - 1
    return [chunks.get(i, []) for i in range(batch._count)]


def loaded(files):
    import transformers
    model_dir, adapters = files
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    attached = attach(model, lorahook.AdapterSet(geometry_of(model), resolver=adapters))
    return model, tok, attached


def check_alone(files, tok, names, ids, lengths, lives, chunks):
    """Each request's tokens equal PEFT generating it alone, and its chunks spell them."""
    model_dir, adapters = files
    for i, name in enumerate(names):
        want = serve_files.peft_reference(model_dir, None if name is None else
                                          os.path.join(adapters, name), ids[i], lengths[i])
        got = lives[i].generated
        want = [t for t in want if t != 2][:len(got)]
        assert got == want, (name, got, want)
        text = "".join(c[0] for c in chunks[i])
        assert text == tok.decode(got, skip_special_tokens=True)
        assert chunks[i][-1][1] in ("stop", "length")
        assert all(c[1] is None for c in chunks[i][:-1])


@pytest.mark.parametrize("can_join", [True, False], ids=["rows-dropped", "rows-kept"])
def test_a_mixed_batch_equals_each_request_alone(files, can_join):
    model, tok, attached = loaded(files)
    prompts = ["the cat sat on the mat", "hello world", "one two three four five six",
               "what is the sky"]
    names = ["alpha", None, "beta", "alpha"]
    lengths = [9, 4, 12, 6]
    ids = [tok(p)["input_ids"] for p in prompts]
    reqs = [Request(i, max_tokens=n, temperature=0.0) for i, n in zip(ids, lengths)]
    batch, lives = make(model, tok, attached, names, reqs, can_join)
    chunks = run(batch)
    check_alone(files, tok, names, ids, lengths, lives, chunks)
    assert len(batch.rows) == (0 if can_join else 4)


def test_requests_join_and_leave_a_running_batch(files):
    model, tok, attached = loaded(files)
    prompts = ["the cat sat on the mat and the dog", "hello", "one two three four five six",
               "what is the sky", "big small old new good bad sun moon star sky sea tree"]
    names = ["alpha", None, "beta", "gamma", "alpha"]
    lengths = [5, 14, 9, 12, 7]
    ids = [tok(p)["input_ids"] for p in prompts]
    reqs = [Request(i, max_tokens=n, temperature=0.0) for i, n in zip(ids, lengths)]
    batch, lives = make(model, tok, attached, names[:2], reqs[:2])
    chunks = {}
    run(batch, chunks=chunks, steps=3)
    lives += batch.admit(names[2:4], reqs[2:4])  # one prompt longer than the running rows
    run(batch, chunks=chunks, steps=4)
    assert len(batch.rows) == 3  # alpha finished after 5 tokens: its row is gone
    lives += batch.admit(names[4:], reqs[4:])
    gone = batch.admit(["beta"], [Request(ids[0], max_tokens=30, temperature=0.0)])[0]
    run(batch, chunks=chunks, steps=1)
    batch.retire([batch.reported.index(gone)])  # its caller left
    assert gone not in batch.open and all(live is not gone for live in batch.rows)
    chunks = run(batch, chunks=chunks)
    del chunks[gone.index]
    check_alone(files, tok, names, ids, lengths, lives, chunks)
    assert batch.rows == [] and batch.cache is None


def test_columns_no_row_needs_are_cut():
    tok = serve_files.tokenizer()
    model = serve_files.model()
    attached = attach(model, lorahook.AdapterSet(geometry_of(model)))
    long = tok("one two three four five six seven eight nine ten")["input_ids"]
    batch, _ = make(model, tok, attached, [None], [Request(long, 3, 0.0)])
    batch.step()
    batch.admit([None], [Request(tok("hello")["input_ids"], 20, 0.0)])
    batch.step()
    assert batch.mask.shape[1] == len(long) + 2  # the short prompt is left-padded to the long row
    batch.step()
    batch.step()  # the long request finished: only the short one's columns stay
    assert len(batch.rows) == 1
    assert batch.mask.shape[1] == int(batch.mask.sum()) == batch.cache.get_seq_length() + 1


def test_caches_that_cannot_take_rows_keep_whole_batches():
    import transformers
    tok = serve_files.tokenizer()
    config = transformers.MistralConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, sliding_window=4)
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(config).eval()
    attached = attach(model, lorahook.AdapterSet(geometry_of(model)))
    ids = tok("the cat sat on the mat")["input_ids"]
    batch, _ = make(model, tok, attached, [None, None], [Request(ids, 2, 0.0), Request(ids, 6, 0.0)])
    batch.step()
    assert batch.can_join is False
    with pytest.raises(RuntimeError, match="cannot take rows"):
        batch.admit([None], [Request(ids, 2, 0.0)])
    chunks = run(batch)
    assert [len(c) for c in chunks] == [1, 5]  # after the first step: 1 and 5 tokens to go
    assert len(batch.rows) == 2


def test_stop_strings_seeds_and_top_p(files):
    model, tok, attached = loaded(files)
    ids = tok("the cat sat")["input_ids"]
    full = run(make(model, tok, attached, [None], [Request(ids, 10, 0.0)])[0])
    text = "".join(c[0] for c in full[0])
    words = text.split()
    assert len(words) >= 3
    stop = words[2]
    cut = run(make(model, tok, attached, [None], [Request(ids, 10, 0.0, stop=[stop])])[0])
    assert "".join(c[0] for c in cut[0]) == text[:text.find(stop)]
    assert cut[0][-1][1] == "stop"
    sampled = [run(make(model, tok, attached, ["beta"] * 2,
                        [Request(ids, 8, 1.3, 0.9, seed=7)] * 2)[0]) for _ in range(2)]
    assert sampled[0] == sampled[1]  # seeded: the same text every time, on every row
    assert sampled[0][0] == sampled[0][1]


class _Bytes:
    """A byte-level tokenizer: token t is the byte t, so a character may span tokens."""

    def decode(self, tokens, skip_special_tokens=True):
        return bytes(tokens).decode("utf-8", errors="replace")


class _NoModel:
    def forward(self, input_ids=None, past_key_values=None):
        raise AssertionError("not called")


def _feed(text, stop=(), max_tokens=1000):
    """Feed ``text``'s UTF-8 bytes to the engine token by token: the deltas and the finish reason."""
    batch = Batch(_NoModel(), _Bytes(), None, 0, [], True)
    live, = batch.admit([None], [Request([1], max_tokens, 0.0, stop=stop)])
    deltas, reason = [], None
    for byte in text.encode("utf-8"):
        delta, reason = batch._report(live, byte)
        deltas.append(delta)
        if reason is not None:
            break
    return deltas, reason


def test_text_is_decoded_a_window_at_a_time_and_never_splits_a_character():
    text = "naïve café — 日本語 🙂 ok"
    deltas, reason = _feed(text, max_tokens=len(text.encode()))
    assert "".join(deltas) == text and reason == "length"
    assert not any("\ufffd" in d for d in deltas)  # a partial character is held back


@pytest.mark.parametrize("stop", ["日本", "é —", "🙂 o", "ok"])
def test_a_stop_spanning_tokens_and_characters_ends_the_text_before_it(stop):
    text = "naïve café — 日本語 🙂 ok and more"
    deltas, reason = _feed(text, stop=[stop, "zzz-never"])
    assert reason == "stop" and "".join(deltas) == text[:text.index(stop)]
