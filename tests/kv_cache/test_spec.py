from __future__ import annotations

import pytest

from flashpage.config import ModelConfig
from flashpage.kv_cache.spec import KVCacheSpec


def test_gqa_spec_shapes_and_bytes():
    cfg = ModelConfig.from_hf({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 8,
        "num_key_value_heads": 2,
    })
    spec = KVCacheSpec.from_model_config(cfg, 16, "bfloat16")
    assert spec.layer_shapes(10) == [(10, 16, 2, 8), (10, 16, 2, 8)]
    assert spec.bytes_per_block == 2 * 2 * 8 * 16 * 2 * 3
    assert spec.num_blocks_for(spec.bytes_per_block * 7 + 1) == 7


def test_mla_spec_is_one_latent_tensor():
    spec = KVCacheSpec(block_size=64, num_layers=2, dtype_bytes=2, latent_dim=512 + 64)
    assert spec.is_mla and spec.layer_shapes(3) == [(3, 64, 576)]
    assert spec.bytes_per_block == 576 * 64 * 2 * 2


def test_spec_validates():
    with pytest.raises(ValueError, match="power of two"):
        KVCacheSpec(block_size=24, num_layers=1, dtype_bytes=2, num_kv_heads=1, head_dim=8)
    with pytest.raises(ValueError, match="either latent_dim"):
        KVCacheSpec(block_size=16, num_layers=1, dtype_bytes=2)
