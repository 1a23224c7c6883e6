"""Prompt embeddings across families whose embedding step differs (models/common.
DecoderStack.from_inputs_embeds): each takes what transformers' model takes as
inputs_embeds (its get_input_embeddings() output) and gives transformers'
generate(inputs_embeds=...) tokens, for the model's own embeddings of token ids (then also
the token prompt's tokens) and for random rows. Gemma 1/2/3: transformers 5 scales inside
the embedding module, so inputs_embeds are not scaled again; Granite multiplies them by
embedding_multiplier; BLOOM norms them; OPT-350m's are 32 wide, projected in; GPT-2 adds
its position embeddings; DeepSeek-V2 (MLA) and Mixtral (MoE) take them as Llama does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flashpage import LLM, SamplingParams
from tests.conftest import build_tiny_mla_checkpoint, build_tiny_moe_checkpoint, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _build(name: str, path: Path) -> Path:
    if name.startswith("gemma"):
        from tests.models.test_gemma import build_tiny_gemma

        return build_tiny_gemma(path, name)
    if name == "granite":
        from tests.models.test_more_families import build_tiny_variant

        return build_tiny_variant(path, name)
    if name == "bloom":
        from tests.models.test_alibi_families import build_tiny

        return build_tiny(path, name)
    if name == "opt_350m":
        from tests.models.test_opt import build_tiny as build_opt

        return build_opt(path, name)
    if name == "gpt2":
        from tests.models.test_gpt2_bigcode import build_tiny as build_gpt2

        return build_gpt2(path, name)
    if name == "deepseek_v2":
        return build_tiny_mla_checkpoint(path, name)
    assert name == "mixtral"
    return build_tiny_moe_checkpoint(path, name)


NAMES = ["gemma", "gemma2", "gemma3", "granite", "bloom", "opt_350m", "gpt2", "deepseek_v2", "mixtral"]


@pytest.mark.parametrize("name", NAMES)
def test_family_takes_transformers_inputs_embeds(tmp_path, name):
    import transformers

    path = _build(name, tmp_path / name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                           attn_implementation="eager")
    hf.generation_config.eos_token_id = None
    prompts = random_prompts(2, 6, 20, vocab=min(256, hf.config.vocab_size), seed=21)
    with torch.no_grad():
        own = [hf.get_input_embeddings()(torch.tensor(p)).detach().clone() for p in prompts]
        scale = float(torch.cat(own).std())
        g = torch.Generator().manual_seed(22)
        rand = [torch.randn(n, own[0].shape[1], generator=g) * scale for n in (5, 14)]
        expected = []
        for e in own + rand:
            out = hf.generate(inputs_embeds=e[None], attention_mask=torch.ones(1, e.shape[0], dtype=torch.long),
                              max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
            expected.append(out[0].tolist())
    llm = LLM(str(path), dtype="float32", device="cpu", block_size=8, attention_backend="torch_native",
              enable_prompt_embeds=True)
    outs = llm.generate([*prompts, *({"prompt_embeds": e} for e in own + rand)], GREEDY, use_tqdm=False)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    got = [o.outputs[0].token_ids for o in outs]
    assert got[2:] == expected
    assert got[2:4] == got[:2]  # the model's own embeddings of the ids: the token prompt's tokens


def test_gemma3_groups_share_identical_embeds_prompts(tmp_path):
    """KV cache groups (Gemma 3's windowed and full layers, kv_cache/hybrid.py): the second
    identical embeds prompt hits in every group, tokens unchanged; a token prompt of the
    same ids does not."""
    import transformers

    path = _build("gemma3", tmp_path / "gemma3")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = random_prompts(1, 45, 45, seed=23)[0]
    with torch.no_grad():
        e = hf.get_input_embeddings()(torch.tensor(ids)).detach().clone()
    llm = LLM(str(path), dtype="float32", device="cpu", block_size=8, attention_backend="torch_native",
              enable_prompt_embeds=True)
    assert llm.engine.kv_layout is not None
    kv = llm.engine.kv_manager
    first = llm.generate([{"prompt_embeds": e}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    hits = kv.prefix_hits
    assert llm.generate([ids], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == first
    assert kv.prefix_hits == hits
    assert llm.generate([{"prompt_embeds": e.clone()}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == first
    assert kv.prefix_hits > hits
    assert kv.stats().blocks_used == 0
