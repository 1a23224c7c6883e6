"""Tiny random Idefics3 and SmolVLM checkpoints (transformers' Idefics3ForConditionalGeneration
/ SmolVLMForConditionalGeneration saved as fp32 safetensors, the image processor's
preprocessor_config.json and a processor_config.json beside them, a byte-level BPE tokenizer
(SmolLM2's kind, "\\n\\n" one token) with the processor's special tokens and SmolVLM's chat
template (SmolVLM2's, which writes <video> for a video part, with a video processor)), shared
by the engine, server and inspect tests.

The tower: SigLIP, 16 x 16 tiles in 2 x 2 patches (an 8 x 8 grid), 2 layers, pixel-shuffled
by 2 to 16 rows a tile; the longest edge resized to 48, so an image is one tile (a square
whose side rounds to 16) or a grid of up to 3 x 3 tiles and the global one. The text model
a tiny Llama. ``splitting`` False: every image one tile."""

from __future__ import annotations

import json
from pathlib import Path

import torch

TILE, PATCH = 16, 2
ROWS = 16  # per tile: (16 / 2 / 2)^2
# SmolVLM's chat template (its processor's DEFAULT_CHAT_TEMPLATE): it loops over content parts
SMOLVLM_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}{% if message['content'] is string %}"
    "{{': ' + message['content']}}{% else %}{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}"
    "{{': '}}{% endif %}{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}{% endif %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
SPECIAL = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>", "<|im_start|>",
           *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7))]
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
               image_size=TILE, patch_size=PATCH)
_TEXT = dict(model_type="llama", vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5,
             bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False, rope_theta=10000.0)


def build_tokenizer(path: Path, video: bool = False) -> None:
    """A byte-level BPE (GPT-2's byte alphabet) whose merges include "\\n\\n", with the
    processor's special tokens added (``video``: SmolVLM2's <video> too, and its chat
    template: SmolVLMProcessor's DEFAULT_CHAT_TEMPLATE, whose video part is <video>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from tests.byte_tokenizer import SPECIALS, _corpus

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus() + ["a cat\n\nsat on the mat\n\n"] * 8, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>")
    fast.add_special_tokens({"additional_special_tokens": SPECIAL + ["<video>"] * video})
    fast.chat_template = SMOLVLM_CHAT_TEMPLATE
    if video:
        from transformers.models.smolvlm.processing_smolvlm import DEFAULT_CHAT_TEMPLATE

        fast.chat_template = DEFAULT_CHAT_TEMPLATE
    fast.save_pretrained(path)


def hf_image_processor(smolvlm: bool = False, tile: int = TILE, **kw):
    """transformers' PIL image processor: tiles of ``tile``, the longest edge 3 of them."""
    import transformers

    cls = transformers.SmolVLMImageProcessorPil if smolvlm else transformers.Idefics3ImageProcessorPil
    return cls(**{"size": {"longest_edge": 3 * tile}, "max_image_size": {"longest_edge": tile}, **kw})


def hf_processor(path: Path, smolvlm: bool = False, **kw):
    """transformers' Idefics3Processor on the folder's tokenizer (SmolVLMProcessor writes an
    image's tokens the same way; its __init__ wants num2words, for videos)."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(path)
    return transformers.Idefics3Processor(image_processor=hf_image_processor(smolvlm, **kw), tokenizer=tok,
                                          image_seq_len=ROWS)


def build_tiny_idefics3(path: Path, seed: int = 0, smolvlm: bool = False, splitting: bool = True,
                        text: dict | None = None, vision: dict | None = None, video: dict | None = None,
                        **overrides) -> Path:
    """Save a tiny Idefics3 (``smolvlm``: SmolVLM) checkpoint under ``path``; ``text`` /
    ``vision``: text_config / vision_config fields over ours; ``video`` (SmolVLM2): a <video>
    token and these video_preprocessor_config.json fields; ``overrides``: the wrapper's."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    build_tokenizer(path, video is not None)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    image_token = int(tok.convert_tokens_to_ids("<image>"))
    cls, model_cls = ((transformers.SmolVLMConfig, transformers.SmolVLMForConditionalGeneration) if smolvlm
                      else (transformers.Idefics3Config, transformers.Idefics3ForConditionalGeneration))
    vc = {**_VISION, **(vision or {})}
    overrides = {"scale_factor": 2, **overrides}
    config = cls(text_config={**_TEXT, **(text or {})}, vision_config=vc, image_token_id=image_token, **overrides)
    rows = (vc["image_size"] // vc["patch_size"] // overrides["scale_factor"]) ** 2
    torch.manual_seed(seed)
    model = model_cls(config).float()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5) if n.endswith(".weight") else p.normal_(0, 0.1)
            elif "text_model" in n or "connector" in n or "lm_head" in n or "embedding" in n:
                p.normal_(0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    hf_image_processor(smolvlm, vc["image_size"], do_image_splitting=splitting).save_pretrained(path)
    if video is not None:
        (path / "video_preprocessor_config.json").write_text(json.dumps(
            {"video_processor_type": "SmolVLMVideoProcessor", "max_image_size": {"longest_edge": vc["image_size"]},
             **video}) + "\n")
    (path / "processor_config.json").write_text(
        json.dumps({"image_seq_len": rows, "processor_class": "SmolVLMProcessor" if smolvlm else "Idefics3Processor"})
        + "\n")
    return path


def hf_idefics3(path: Path, dtype=torch.float32, device: str = "cpu"):
    import transformers

    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    model = getattr(transformers, arch).from_pretrained(path, dtype=dtype, attn_implementation="eager").to(device)
    model.generation_config.eos_token_id = None
    return model.eval()


def hf_greedy(model, inputs: dict, max_new_tokens: int) -> list[int]:
    """transformers' greedy generate on a processor's ``inputs`` (one prompt), EOS
    ignored: the new tokens."""
    dev = model.device
    kw = {k: v.to(dev) for k, v in inputs.items() if k in ("input_ids", "attention_mask")}
    if "pixel_values" in inputs:
        kw["pixel_values"] = inputs["pixel_values"].to(dev, model.dtype)
        kw["pixel_attention_mask"] = inputs["pixel_attention_mask"].to(dev)
    with torch.no_grad():
        out = model.generate(**kw, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=0)
    return out[0, kw["input_ids"].shape[1]:].tolist()
