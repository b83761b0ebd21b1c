"""Embedding LoRA, DoRA and saved modules in the compiled core, against float64 numpy."""
import pickle

import numpy as np
import pytest

import lorahook
from lorahook import AdapterSet, LoraAdapter, LoraLayer, SavedModule, apply_lora_embedding

V, H = 50, 12  # vocabulary, hidden size


def close(got, ref):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert np.abs(got - ref).max() <= 1e-5 * max(np.abs(ref).max(), 1e-1)


@pytest.fixture
def rng():
    return np.random.default_rng(7)


def embedding_adapter(rng, rank=3, scale=0.5):
    a, b = rng.standard_normal((rank, V)), rng.standard_normal((H, rank))
    return LoraAdapter({(None, "embed_tokens"): LoraLayer(a, b, scale, embedding=True)}), a, b


@pytest.mark.parametrize("n", [1, 5, 70, 200])  # one chunk, several chunks
def test_embedding_rows_equal_float64(rng, n):
    adapter, a, b = embedding_adapter(rng)
    ids = rng.integers(0, V, n)
    base = rng.standard_normal((n, H)).astype(np.float32)
    out = base.copy()
    apply_lora_embedding(adapter, None, "embed_tokens", ids.astype(np.int32), out)
    close(out, base + 0.5 * (b @ a[:, ids]).T)


@pytest.mark.parametrize("bad", [-1, V, 10**12])
def test_ids_out_of_range_are_refused_with_nothing_written(rng, bad):
    adapter, _, _ = embedding_adapter(rng)
    ids = np.array([1, 2, bad, 3], dtype=np.int64)
    out = rng.standard_normal((4, H)).astype(np.float32)
    before = out.copy()
    with pytest.raises(ValueError, match=rf"ids must be in \[0, {V}\)"):
        apply_lora_embedding(adapter, None, "embed_tokens", ids, out)
    assert np.array_equal(out, before)


def test_embedding_call_checks(rng):
    adapter, _, _ = embedding_adapter(rng)
    out = np.zeros((3, H), np.float32)
    with pytest.raises(TypeError, match="int32 or int64"):
        apply_lora_embedding(adapter, None, "embed_tokens", np.zeros(3, np.float32), out)
    with pytest.raises(ValueError, match="one id per output row"):
        apply_lora_embedding(adapter, None, "embed_tokens", np.zeros(4, np.int64), out)
    with pytest.raises(ValueError, match="embedding_dim 12"):
        apply_lora_embedding(adapter, None, "embed_tokens", np.zeros(3, np.int64),
                             np.zeros((3, H + 1), np.float32))
    with pytest.raises(ValueError, match="use apply_lora_embedding"):
        lorahook.apply_lora_rows(adapter, None, "embed_tokens", np.zeros((3, V), np.float32), out)
    with pytest.raises(TypeError, match="compiled core"):
        apply_lora_embedding(lorahook.NoopLoraHook(), None, "embed_tokens", np.zeros(3, np.int64), out)


def test_embeddings_mix_per_row_in_a_bound_batch_and_sequences(rng):
    aset = AdapterSet()
    refs = {}
    for name in ("x", "y"):
        adapter, a, b = embedding_adapter(rng)
        aset.add(name, adapter)
        refs[name] = (a, b)
    names = ["x", None, "y", "x"]
    ids = rng.integers(0, V, 4)
    base = rng.standard_normal((4, H)).astype(np.float32)
    out = base.copy()
    apply_lora_embedding(aset.bind(names), None, "embed_tokens", ids, out)
    for i, name in enumerate(names):
        if name is None:
            assert np.array_equal(out[i], base[i])
        else:
            a, b = refs[name]
            close(out[i], base[i] + 0.5 * b @ a[:, ids[i]])
    seq = rng.integers(0, V, (4, 3))  # four sequences of three tokens, sequence-major
    out = np.zeros((12, H), np.float32)
    apply_lora_embedding(aset.bind_sequences(names), None, "embed_tokens", seq.ravel(), out)
    for i, name in enumerate(names):
        for t in range(3):
            if name is None:
                assert not out[i * 3 + t].any()  # never written
            else:
                close(out[i * 3 + t], 0.5 * refs[name][1] @ refs[name][0][:, seq[i, t]])


def test_half_embedding_rows_round_once(rng):
    ml = pytest.importorskip("ml_dtypes")
    adapter, a, b = embedding_adapter(rng)
    ids = rng.integers(0, V, 6)
    for dt in (np.float16, ml.bfloat16):
        base = rng.standard_normal((6, H)).astype(dt)
        out = base.copy()
        apply_lora_embedding(adapter.astype(np.float16 if dt is np.float16 else ml.bfloat16),
                             None, "embed_tokens", ids, out)
        ref = base.astype(np.float64) + 0.5 * (b @ a[:, ids]).T
        eps = np.finfo(np.float16).eps if dt is np.float16 else 2.0 ** -7
        assert np.abs(out.astype(np.float64) - ref).max() <= 2 * eps * np.abs(ref).max()


def dora_parts(rng, d_in=20, d_out=16, rank=3, scale=1.5):
    a, b = rng.standard_normal((rank, d_in)), rng.standard_normal((d_out, rank))
    w, bias = rng.standard_normal((d_out, d_in)), rng.standard_normal(d_out)
    m = 1 + rng.random(d_out)
    return a, b, w, bias, m, scale


def dora_reference(x, a, b, w, bias, m, scale):
    g = m / np.linalg.norm(w + scale * b @ a, axis=1)
    y = x @ w.T + bias
    return y, y + (g - 1) * (y - bias) + g * (scale * (x @ a.T) @ b.T)


@pytest.mark.parametrize("n", [1, 3, 40])  # row loop and batched
def test_dora_rows_equal_float64_in_float32_and_half(rng, n):
    a, b, w, bias, m, scale = dora_parts(rng)
    x = rng.standard_normal((n, 20))
    y, ref = dora_reference(x, a, b, w, bias, m, scale)
    adapter = LoraAdapter({(0, "q"): LoraLayer(a, b, scale, magnitude=m)})
    based = adapter.with_base({(0, "q"): (w, bias)})
    out = y.astype(np.float32)
    lorahook.apply_lora_rows(based, 0, "q", x.astype(np.float32), out)
    close(out, ref)
    # float16 rows: the formula in float64 on the rounded rows, then one rounding (apply_lora_rows' docstring)
    x16, y16 = x.astype(np.float16), y.astype(np.float16)
    out16 = y16.copy()
    lorahook.apply_lora_rows(based, 0, "q", x16, out16)
    g = m / np.linalg.norm(w + scale * b @ a, axis=1)
    yr, xr = y16.astype(np.float64), x16.astype(np.float64)
    ref16 = yr + (g - 1) * (yr - bias) + g * (scale * (xr @ a.T) @ b.T)
    ulp = np.spacing(np.abs(ref16).astype(np.float16)).astype(np.float64)
    assert (np.abs(out16.astype(np.float64) - ref16) <= ulp + 1e-5 * np.abs(ref16).max()).all()


def test_dora_mixes_with_plain_rows_and_refuses_fractional_scales(rng):
    a, b, w, bias, m, scale = dora_parts(rng)
    aset = AdapterSet(base_weights={(0, "q"): (w, bias)})
    aset.add("dora", LoraAdapter({(0, "q"): LoraLayer(a, b, scale, magnitude=m)}))
    pa, pb = rng.standard_normal((2, 20)), rng.standard_normal((16, 2))
    aset.add("plain", LoraAdapter({(0, "q"): LoraLayer(pa, pb, 0.5)}))
    x = rng.standard_normal((3, 20))
    y, ref = dora_reference(x, a, b, w, bias, m, scale)
    out = y.astype(np.float32)
    lorahook.apply_lora_rows(aset.bind(["plain", "dora", None]), 0, "q", x.astype(np.float32), out)
    close(out[0], y[0] + 0.5 * pb @ (pa @ x[0]))
    close(out[1], ref[1])
    assert np.array_equal(out[2], y[2].astype(np.float32))
    with pytest.raises(ValueError, match="take scale 0 or 1"):
        aset.bind(["dora", "plain"], scales=[0.5, 1.0])
    aset.bind(["dora", "plain"], scales=[0.0, 0.5])  # zero rows are simply left out


def test_with_base_errors_and_nbytes(rng):
    a, b, w, bias, m, scale = dora_parts(rng)
    adapter = LoraAdapter({(0, "q"): LoraLayer(a, b, scale, magnitude=m)})
    assert adapter.needs_base == [(0, "q")]
    with pytest.raises(ValueError, match=r"must have shape \(d_out, d_in\) = \(16, 20\), got \(20, 16\)"):
        adapter.with_base({(0, "q"): w.T})
    with pytest.raises(KeyError, match="no base weight"):
        adapter.with_base({})
    # the callable is called as documented, with (layer_idx, module)
    asked = []
    based = adapter.with_base(lambda layer_idx, module: asked.append((layer_idx, module)) or (w, bias))
    assert asked == [(0, "q")]
    with pytest.raises(KeyError, match=r"no base weight for DoRA layer \(0, 'q'\)"):
        adapter.with_base(lambda layer_idx, module: None)
    # g, (1 - g) b and g*B^T are kept beside a, B^T and the magnitude
    assert based.nbytes == adapter.nbytes + 4 * (16 + 16 + 3 * 16)
    again = pickle.loads(pickle.dumps(based, protocol=5))
    x = rng.standard_normal((2, 20)).astype(np.float32)
    o1, o2 = np.zeros((2, 16), np.float32), np.zeros((2, 16), np.float32)
    lorahook.apply_lora_rows(based, 0, "q", x, o1)
    lorahook.apply_lora_rows(again, 0, "q", x, o2)
    assert np.array_equal(o1, o2)


def test_saved_modules_replace_their_rows(rng):
    w, bias = rng.standard_normal((3, H)), rng.standard_normal(3)
    table = rng.standard_normal((V, H))
    adapter = LoraAdapter({}, saved_modules={(None, "score"): SavedModule(w, bias),
                                             (None, "embed_tokens"): SavedModule(table, embedding=True)})
    aset = AdapterSet()
    aset.add("cls", adapter)
    x = rng.standard_normal((4, H)).astype(np.float32)
    base = rng.standard_normal((4, 3)).astype(np.float32)
    out = base.copy()
    lorahook.apply_lora_rows(aset.bind([None, "cls", None, "cls"]), None, "score", x, out)
    assert np.array_equal(out[[0, 2]], base[[0, 2]])
    close(out[[1, 3]], x[[1, 3]].astype(np.float64) @ w.T + bias)
    ids = rng.integers(0, V, 4)
    emb = rng.standard_normal((4, H)).astype(np.float32)
    out = emb.copy()
    apply_lora_embedding(aset.bind(["cls", None, None, "cls"]), None, "embed_tokens", ids, out)
    close(out[[0, 3]], table[ids[[0, 3]]])
    assert np.array_equal(out[[1, 2]], emb[[1, 2]])
    assert adapter.nbytes == 4 * (3 * H + 3 + V * H)
    with pytest.raises(ValueError, match="cannot be scaled"):
        adapter.scaled(0.5)


def test_model_level_geometry_and_validation(rng):
    config = lorahook.LlamaConfig.from_dict(dict(
        model_type="llama", hidden_size=H, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=20, vocab_size=V, id2label={"0": "a", "1": "b", "2": "c"}))
    assert config.modules(None) == ("lm_head", "embed_tokens", "score")
    assert config.projection_shape(None, "lm_head") == (H, V)
    assert config.projection_shape(None, "embed_tokens") == (V, H)
    assert config.projection_shape(None, "score") == (H, 3)
    with pytest.raises(lorahook.LoraValidationError, match="unknown"):
        config.projection_shape(None, "q_proj")
    adapter, _, _ = embedding_adapter(rng)
    adapter.validate_against(config)
    wrong = LoraAdapter({(None, "lm_head"): LoraLayer(rng.standard_normal((2, V)),
                                                      rng.standard_normal((H, 2)), embedding=True)})
    with pytest.raises(lorahook.LoraValidationError, match="embedding"):
        wrong.validate_against(config)
    no_vocab = lorahook.LlamaConfig(hidden_size=H, num_hidden_layers=2, num_attention_heads=2,
                                    intermediate_size=20)
    with pytest.raises(lorahook.LoraValidationError, match="no vocab_size"):
        adapter.validate_against(no_vocab)


# --------------------------------------------------------------------------- files and the CLI

from peft_dirs import write_dir  # noqa: E402

P = "base_model.model."


def variant_dir(tmp_path, rng, **config):
    """A PEFT directory with a DoRA layer, an embedding LoRA and a saved score head."""
    t = {f"{P}model.layers.0.self_attn.q_proj.lora_A.weight": rng.standard_normal((2, H)).astype(np.float32),
         f"{P}model.layers.0.self_attn.q_proj.lora_B.weight": rng.standard_normal((H, 2)).astype(np.float32),
         f"{P}model.layers.0.self_attn.q_proj.lora_magnitude_vector": (1 + rng.random(H)).astype(np.float32),
         f"{P}score.weight": rng.standard_normal((3, H)).astype(np.float32)}
    cfg = dict(peft_type="LORA", r=2, lora_alpha=4, use_dora=True, modules_to_save=["score"],
               target_modules=["q_proj"])
    cfg.update(config)
    return write_dir(tmp_path / "v", t, cfg)


def test_files_with_dora_and_saved_modules_load_and_show(tmp_path, rng, capsys):
    d = variant_dir(tmp_path, rng)
    adapter = LoraAdapter.from_peft(d)
    assert adapter.has_dora and set(adapter.saved_modules) == {(None, "score")}
    assert adapter.module_paths[(None, "score")] == "score"
    from lorahook.cli import main
    assert main(["info", str(d)]) == 0
    out = capsys.readouterr().out
    assert "use_dora" in out and "saved       score (linear, 12 -> 3" in out
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "llama", "hidden_size": 12, "num_hidden_layers": 2, '
                      '"num_attention_heads": 2, "intermediate_size": 20, "vocab_size": 50, '
                      '"id2label": {"0": "a", "1": "b", "2": "c"}}')
    assert main(["validate", str(d), "--model", str(config)]) == 0
    assert "1 model-level modules" in capsys.readouterr().out
    config.write_text(config.read_text().replace('"2": "c"', '"2": "c", "3": "d"'))
    assert main(["validate", str(d), "--model", str(config)]) == 1
    assert "score" in capsys.readouterr().err


@pytest.mark.parametrize("config, tensors, words", [
    ({"use_dora": False}, {}, "use_dora=false"),
    ({"modules_to_save": ["score", "model.norm"]},
     {f"{P}model.norm.weight": np.ones(H, np.float32)}, "cannot be placed"),
    ({"modules_to_save": ["score", "lm_head"]},
     {f"{P}lm_head.weight": np.ones(V, np.float32)}, "only linear and embedding modules"),
    ({"lora_bias": True}, {}, "use_dora with lora_bias"),
    ({}, {f"{P}model.layers.1.self_attn.q_proj.lora_A.weight": np.ones((2, H, 3, 3), np.float32),
          f"{P}model.layers.1.self_attn.q_proj.lora_B.weight": np.ones((H, 2, 1, 1), np.float32)},
     "LoRA on a convolution"),
])
def test_refusals_name_what_they_refuse(tmp_path, rng, config, tensors, words):
    d = variant_dir(tmp_path, rng, **config)
    if tensors:
        from safetensors.numpy import load_file, save_file
        all_tensors = load_file(str(d / "adapter_model.safetensors"))
        all_tensors.update(tensors)
        save_file(all_tensors, str(d / "adapter_model.safetensors"))
    with pytest.raises(lorahook.LoraFormatError, match=words):
        LoraAdapter.from_peft(d)


def test_save_peft_writes_what_it_holds(tmp_path, rng):
    d = variant_dir(tmp_path, rng)
    adapter = LoraAdapter.from_peft(d)
    out = adapter.save_peft(tmp_path / "out")
    import json
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["use_dora"] is True and config["modules_to_save"] == ["score"]
    again = LoraAdapter.from_peft(out)
    for key, layer in adapter.layers.items():
        assert np.array_equal(again.layers[key].magnitude, layer.magnitude)
        assert np.array_equal(again.layers[key].a, layer.a)
    assert np.array_equal(again.saved_modules[(None, "score")].weight,
                          adapter.saved_modules[(None, "score")].weight)


@pytest.mark.parametrize("n", [3, 40])  # the row loop and the batched path
def test_saved_modules_and_dora_on_half_rows(rng, n):
    ml = pytest.importorskip("ml_dtypes")
    w, bias = rng.standard_normal((5, H)), rng.standard_normal(5)
    a, b, wd, bd, m, scale = dora_parts(rng, d_in=H, d_out=5)
    saved = LoraAdapter({}, saved_modules={(None, "score"): SavedModule(w, bias)})
    dora = LoraAdapter({(None, "score"): LoraLayer(a, b, scale, magnitude=m)}).with_base(
        {(None, "score"): (wd, bd)})
    x = rng.standard_normal((n, H))
    for dt, eps in ((np.float16, 2.0 ** -11), (ml.bfloat16, 2.0 ** -8)):
        xh = x.astype(dt)
        x64 = xh.astype(np.float64)
        out = rng.standard_normal((n, 5)).astype(dt)
        lorahook.apply_lora_rows(saved, None, "score", xh, out)
        ref = x64 @ w.T + bias
        assert np.abs(out.astype(np.float64) - ref).max() <= 4 * eps * np.abs(ref).max()
        y = (x64 @ wd.T + bd).astype(dt)
        out = y.copy()
        lorahook.apply_lora_rows(dora, None, "score", xh, out)
        g = m / np.linalg.norm(wd + scale * b @ a, axis=1)
        y64 = y.astype(np.float64)
        ref = y64 + (g - 1) * (y64 - bd) + g * (scale * (x64 @ a.T) @ b.T)
        assert np.abs(out.astype(np.float64) - ref).max() <= 4 * eps * np.abs(ref).max()


def test_a_bare_file_with_embedding_lora_and_its_saved_base_weight(tmp_path, rng):
    from safetensors.numpy import save_file
    a, b = rng.standard_normal((2, V)).astype(np.float32), rng.standard_normal((H, 2)).astype(np.float32)
    save_file({f"{P}model.embed_tokens.lora_embedding_A": a,
               f"{P}model.embed_tokens.lora_embedding_B": b,
               f"{P}model.embed_tokens.base_layer.weight": np.ones((V, H), np.float32)},
              str(tmp_path / "bare.safetensors"))
    with pytest.warns(UserWarning, match="base_layer.weight.*not applied"):
        adapter = LoraAdapter.from_safetensors(tmp_path / "bare.safetensors", alpha=4)
    ids = np.array([3, 0, V - 1])
    out = np.zeros((3, H), np.float32)
    apply_lora_embedding(adapter, None, "embed_tokens", ids, out)
    close(out, (2.0 * b.astype(np.float64) @ a[:, ids]).T)


def test_layer_variants_refused_by_name(rng):
    a, b = rng.standard_normal((2, 8)), rng.standard_normal((6, 2))
    with pytest.raises(ValueError, match=r"magnitude must have shape \(6,\)"):
        LoraLayer(a, b, magnitude=np.ones(5))
    with pytest.raises(ValueError, match="DoRA on an embedding"):
        LoraLayer(a, b, magnitude=np.ones(6), embedding=True)
    with pytest.raises(ValueError, match="lora_bias"):
        LoraLayer(a, b, bias=np.ones(6), magnitude=np.ones(6))
    with pytest.raises(ValueError, match="no bias"):
        LoraLayer(a, b, bias=np.ones(6), embedding=True)
