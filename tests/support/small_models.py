"""Small random transformers models shared by the oracle tests (built offline)."""
import pytest


def small_qwen35_model():
    """``(model, config)``: a random ``Qwen3_5ForCausalLM`` (3 Gated DeltaNet + 1 full-attention
    layer, hidden 64, vocab 128), float32, in eval mode, the same weights on every call."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=256,
        layer_types=["linear_attention", "linear_attention", "linear_attention",
                     "full_attention"])
    torch.manual_seed(0)
    return transformers.Qwen3_5ForCausalLM(cfg).float().eval(), cfg
