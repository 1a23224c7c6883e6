"""logit_bias, min_tokens and prompt_logprobs through the engine (CPU, tiny random model
whose logits span ~15: a bias of 100 decides)."""

from __future__ import annotations

from flashpage import LLM, SamplingParams
from tests.conftest import random_prompts


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_logit_bias_and_min_tokens_end_to_end(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("head64_gqa")), dtype="float32", device="cpu")
    prompts = random_prompts(3, 4, 12, seed=31)
    base = _tokens(llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                                use_tqdm=False))
    # each prompt's first greedy token banned; token 7 forced; both in one batch with a plain one
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={base[0][0]: -100.0}),
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={7: 100}),
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)]
    got = _tokens(llm.generate(prompts, params, use_tqdm=False))
    assert base[0][0] not in got[0]
    assert got[1] == [7] * 6
    assert got[2] == base[2]  # a request without a bias beside them is untouched
    # min_tokens: the stop token (prompt 2's second greedy token) is not drawn before 4
    # outputs, so the greedy path changes there instead of stopping after 2
    stop = base[2][1]
    out = llm.generate([prompts[2]], SamplingParams(temperature=0, max_tokens=6, min_tokens=4,
                                                     stop_token_ids=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids[0] == base[2][0] and out.token_ids[1] != stop
    assert stop not in out.token_ids[:4] and len(out.token_ids) >= 4
    # a bias for a token past the vocabulary: that request's error, the others' results
    outs = llm.generate(prompts[:2], [SamplingParams(max_tokens=2, logit_bias={256: 1.0}),
                                      SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)],
                        use_tqdm=False)
    assert "logit_bias token id 256 is outside the vocabulary [0, 256)" in outs[0].error
    assert outs[1].error is None and _tokens(outs[1:]) == [base[1][:2]]
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_blocks


def test_prompt_logprobs_equal_transformers(tiny_checkpoint, monkeypatch):
    """SamplingParams.prompt_logprobs: token p's logprob given tokens < p (None for the
    first), its rank and the top-k, equal to transformers' log_softmax in fp32; across
    chunked prefill (40 tokens over a 32-token budget), for the same prompt twice (no prefix
    hit may skip positions) and with n = 2; a request without it gets None."""
    import torch
    import transformers

    path = tiny_checkpoint("head64_gqa")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompt = random_prompts(1, 40, 40, seed=41)[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    import flashpage.engine.model_runner as mr

    monkeypatch.setattr(mr, "PROMPT_LOGPROB_ROWS", 7)  # rows in several chunks
    llm = LLM(str(path), dtype="float32", device="cpu", max_num_batched_tokens=32)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    outs = llm.generate([prompt, prompt, prompt[:9]],
                        [params, SamplingParams(temperature=0, max_tokens=2, n=2, prompt_logprobs=0),
                         SamplingParams(temperature=0, max_tokens=2)], use_tqdm=False)
    for o, k in ((outs[0], 3), (outs[1], 0)):
        plp = o.prompt_logprobs
        assert plp is not None and len(plp) == len(prompt) and plp[0] is None
        for p in range(1, len(prompt)):
            e = plp[p]
            row = ref[p - 1]
            assert e.token_id == prompt[p]
            assert abs(e.logprob - float(row[prompt[p]])) < 1e-4, (p, e.logprob, float(row[prompt[p]]))
            assert e.rank == int((row > row[prompt[p]]).sum()) + 1
            assert [t for t, _ in e.top] == row.topk(k).indices.tolist() if k else e.top == []
    assert outs[2].prompt_logprobs is None
    # asked again: the prompt's blocks are cached now, and still every position is computed
    again = llm.generate([prompt], params, use_tqdm=False)[0].prompt_logprobs
    assert again is not None and len(again) == len(prompt) and again[0] is None
    for p, (a, b) in enumerate(zip(again[1:], outs[0].prompt_logprobs[1:], strict=True), 1):
        # batched apart, so fp32 sums in another order: held to the reference like the first
        assert a.token_id == b.token_id and a.rank == b.rank
        assert abs(a.logprob - float(ref[p - 1][prompt[p]])) < 1e-4
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_blocks


def test_truncate_prompt_tokens_keeps_the_last_tokens(tiny_checkpoint):
    """truncate_prompt_tokens (vLLM's): the prompt's last k tokens, as if only they were sent;
    shorter prompts untouched; a bad value named."""
    import pytest

    llm = LLM(str(tiny_checkpoint("head64_gqa")), dtype="float32", device="cpu")
    prompt = random_prompts(1, 30, 30, seed=71)[0]
    greedy = dict(temperature=0, max_tokens=4, ignore_eos=True)
    cut, tail = llm.generate([prompt, prompt[-10:]],
                             [SamplingParams(truncate_prompt_tokens=10, **greedy),
                              SamplingParams(**greedy)], use_tqdm=False)
    assert cut.prompt_token_ids == prompt[-10:] and cut.outputs[0].token_ids == tail.outputs[0].token_ids
    whole = llm.generate([prompt], SamplingParams(truncate_prompt_tokens=100, **greedy), use_tqdm=False)[0]
    assert whole.prompt_token_ids == prompt
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be an integer >= 1"):
        SamplingParams(truncate_prompt_tokens=0)
