"""Tiny random Qwen3-VL checkpoints (transformers' Qwen3VLForConditionalGeneration saved as
fp32 safetensors, a Qwen2VLImageProcessor's preprocessor_config.json with Qwen3-VL's 16-pixel
patches and 0.5 mean / std, and tests/qwen2_vl_checkpoint.py's tiny tokenizer and Qwen chat
template), for the model and engine tests.

The tower: 16-pixel patches merged 2 x 2, images resized to multiples of 32 with at most
32 x 32 x 24 pixels (so at most 24 rows each); 3 blocks, a 4 x 4 learned position table
(interpolated to every grid), deepstack mergers after blocks 1 and 0 (listed out of order:
transformers adds them in the tower's block order). The text model: Qwen3 (q / k norms),
3 layers (the first 2 take deepstack features), M-RoPE sections [4, 2, 2] of its 8 rotated
pairs interleaved (t h w t h w t t: Qwen3-VL's [24, 20, 20] pattern, scaled down).

``moe``: Qwen3-VL-MoE (transformers' Qwen3VLMoeForConditionalGeneration) over the same
tower: 4 routed experts of 24, 2 a token, in layers 0 and 2; layer 1 a dense MLP of 96
(mlp_only_layers). transformers 5 saves the experts fused in its modules' layout
(gate_up_proj [E, 2I, H]); ``hub_experts`` rewrites them in the published checkpoints'
([E, H, 2I], down_proj [E, I, H])."""

from __future__ import annotations

from pathlib import Path

import torch

MAX_PIXELS = 32 * 32 * 24
_TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
             rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2],
                              "mrope_interleaved": True})
_VISION = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
               num_position_embeddings=16, deepstack_visual_indexes=[1, 0], patch_size=16)


_MOE = dict(intermediate_size=96, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
            decoder_sparse_step=1, mlp_only_layers=[1])


def build_tiny_qwen3_vl(path: Path, seed: int = 0, text: dict | None = None, moe: bool = False) -> Path:
    """Save a tiny Qwen3-VL checkpoint under ``path``; ``text``: text_config fields over
    ours (a wider head for the GPU's kernels); ``moe``: Qwen3-VL-MoE."""
    import transformers

    from tests.qwen2_vl_checkpoint import QWEN_CHAT_TEMPLATE, SPECIALS
    from tests.server.conftest import build_tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    build_tiny_tokenizer(path, vocab_size=240)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    tok.add_special_tokens({"additional_special_tokens": [*SPECIALS, "<|im_start|>", "<|im_end|>"]})
    tok.chat_template = QWEN_CHAT_TEMPLATE
    tok.save_pretrained(path)
    ids = dict(zip(["vision_start_token_id", "image_token_id", "vision_end_token_id", "video_token_id"],
                   tok.convert_tokens_to_ids(SPECIALS), strict=True))
    tc = {**_TEXT, **(_MOE if moe else {}), **(text or {})}
    config_cls = transformers.Qwen3VLMoeConfig if moe else transformers.Qwen3VLConfig
    config = config_cls(text_config=tc, vision_config={**_VISION, "out_hidden_size": tc["hidden_size"]}, **ids)
    torch.manual_seed(seed)
    model_cls = transformers.Qwen3VLMoeForConditionalGeneration if moe else transformers.Qwen3VLForConditionalGeneration
    model = model_cls(config).float()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5) if n.endswith("weight") else p.normal_(0, 0.1)
            else:
                p.normal_(0, 0.2 if "language_model" in n or "lm_head" in n else 0.1)
    model.save_pretrained(path, safe_serialization=True)
    transformers.Qwen2VLImageProcessorPil(
        patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
        size={"shortest_edge": 64 * 64, "longest_edge": MAX_PIXELS}).save_pretrained(path)
    return path


def hub_experts(tensors: dict[str, torch.Tensor]) -> None:
    """A checkpoint's fused expert tensors rewritten in place in the published Qwen3-VL-MoE
    files' layout (transformers 4.57's modules): gate_up_proj [E, H, 2I], down_proj [E, I, H]."""
    for name in list(tensors):
        if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            tensors[name] = tensors[name].transpose(1, 2).contiguous()


def hf_qwen3_vl(path: Path, dtype: torch.dtype = torch.float32):
    """transformers' model of the checkpoint at ``path`` (dense or MoE, as its config says)."""
    import json

    import transformers

    arch = json.loads((Path(path) / "config.json").read_text())["architectures"][0]
    model = getattr(transformers, arch).from_pretrained(path, dtype=dtype, attn_implementation="eager")
    model.generation_config.eos_token_id = None
    return model.eval()
