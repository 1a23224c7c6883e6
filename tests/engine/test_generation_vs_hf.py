"""Greedy generation is token-for-token that of transformers (fp32, CPU)."""

from __future__ import annotations

import pytest

from flashpage import LLM, SamplingParams
from tests.conftest import (
    TINY_MODELS,
    assert_staggered_matches_hf,
    hf_greedy,
    random_prompts,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_greedy_matches_transformers(tiny_checkpoint, name):
    path = tiny_checkpoint(name)
    prompts = random_prompts(3, 5, 40, seed=1)
    expected = hf_greedy(path, prompts, GREEDY.max_tokens)
    llm = LLM(str(path), dtype="float32", device="cpu", block_size=8)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert llm.engine.kv_manager.stats().blocks_used == 0


def test_staggered_batch_with_chunking_preemption_and_prefix_hits(tiny_checkpoint):
    """10 prompts (4 sharing a 32-token prefix) arrive over several steps into a cache
    too small for all of them; chunked prefill, preemption and prefix hits all happen,
    and every output still equals transformers'."""
    assert_staggered_matches_hf(tiny_checkpoint("llama31_gqa"))


def test_sharded_checkpoint_loads(tiny_checkpoint, tmp_path):
    """A checkpoint saved in several shards with an index gives the same tokens."""
    import transformers

    src = tiny_checkpoint("llama2_mha")
    model = transformers.AutoModelForCausalLM.from_pretrained(src)
    model.save_pretrained(tmp_path, max_shard_size="60KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    prompts = random_prompts(2, 5, 20, seed=2)
    one = LLM(str(src), dtype="float32", device="cpu").generate(prompts, GREEDY, use_tqdm=False)
    many = LLM(str(tmp_path), dtype="float32", device="cpu").generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in one] == [o.outputs[0].token_ids for o in many]


def test_n_samples_share_the_prompt_blocks(tiny_checkpoint):
    """n > 1: the samples differ (seeded), and all but the first find the prompt's full
    blocks in the prefix cache instead of computing them again."""
    llm = LLM(str(tiny_checkpoint("llama2_mha")), dtype="float32", device="cpu", block_size=4)
    prompt = random_prompts(1, 41, 41, seed=5)[0]  # 10 full blocks + 1 token
    params = SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=3, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    kv = llm.engine.kv_manager.stats()
    assert kv.prefix_hits >= 3 * 40  # three samples reuse the 40 tokens of full blocks
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]


def test_reset_prefix_cache_between_runs(tiny_checkpoint):
    """LLM.reset_prefix_cache: the next run of the same prompt finds nothing cached (same
    tokens); refused, forgetting nothing, while a request is unfinished."""
    llm = LLM(str(tiny_checkpoint("llama2_mha")), dtype="float32", device="cpu", block_size=4)
    kv = llm.engine.kv_manager
    prompt = random_prompts(1, 41, 41, seed=6)[0]  # 10 full blocks + 1 token
    first = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    hits = kv.prefix_hits
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == first
    assert kv.prefix_hits - hits == 40
    assert llm.reset_prefix_cache()
    hits = kv.prefix_hits
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == first
    assert kv.prefix_hits == hits
    llm.engine.add_request("pending", prompt, GREEDY)
    llm.engine.step()
    assert not llm.reset_prefix_cache()
    llm.engine.abort_request("pending")
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert llm.reset_prefix_cache() and kv.stats().blocks_used == 0


def test_long_prefill_token_threshold_keeps_transformers_tokens(tiny_checkpoint):
    """Prompts fed 8 tokens a step each (vLLM's long_prefill_token_threshold, from the CLI
    too) give the same tokens; a negative threshold is refused naming the field."""
    from flashpage.cli import build_parser
    from flashpage.config import EngineConfig

    path = tiny_checkpoint("llama31_gqa")
    prompts = random_prompts(3, 20, 40, seed=8)
    llm = LLM(str(path), dtype="float32", device="cpu", block_size=4,
              long_prefill_token_threshold=8)
    assert llm.engine.scheduler.chunk_cap == 8
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == hf_greedy(path, prompts, GREEDY.max_tokens)
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be an integer >= 0"):
        EngineConfig(long_prefill_token_threshold=-3)
    args = build_parser().parse_args(["generate", "hi", "--long-prefill-token-threshold", "64"])
    assert args.long_prefill_token_threshold == 64


def test_cache_salt_keeps_prefixes_apart(tiny_checkpoint):
    """vLLM's prompt dicts with a cache_salt: the same prompt hits the cache under the same
    salt only; text prompts in a dict too; a bad dict or an empty salt fails that prompt
    alone, naming what is wrong."""
    llm = LLM(str(tiny_checkpoint("llama2_mha")), dtype="float32", device="cpu", block_size=4)
    kv = llm.engine.kv_manager
    prompt = random_prompts(1, 41, 41, seed=9)[0]  # 10 full blocks + 1 token

    def run(p):
        hits = kv.prefix_hits
        out = llm.generate([p], GREEDY, use_tqdm=False)[0]
        return out.outputs[0].token_ids, kv.prefix_hits - hits

    first, hits = run({"prompt_token_ids": prompt, "cache_salt": "alice"})
    assert hits == 0
    assert run({"prompt_token_ids": prompt, "cache_salt": "bob"}) == (first, 0)
    assert run(prompt) == (first, 0)  # unsalted: nothing of alice's or bob's
    assert run({"prompt_token_ids": prompt, "cache_salt": "alice"}) == (first, 40)
    assert run({"prompt_token_ids": prompt}) == (first, 40)  # the unsalted run's blocks
    text = llm.generate([{"prompt": "hello there", "cache_salt": "alice"}], GREEDY, use_tqdm=False)[0]
    assert "no tokenizer" in text.error  # read as text (this tiny model has no tokenizer)
    bad = llm.generate([{"prompt_token_ids": prompt, "cache_salt": ""},
                        {"prompt_token_ids": prompt, "salt": "x"}, prompt], GREEDY, use_tqdm=False)
    assert "cache_salt must be a non-empty string" in bad[0].error
    assert "a prompt dict takes one of 'prompt'" in bad[1].error
    assert bad[2].error is None and bad[2].outputs[0].token_ids == first
    assert kv.stats().blocks_used == 0
