"""Beam search (flashpage/beam_search.py, LLM.beam_search): the bookkeeping against an
exhaustive search on a toy model, and the engine's beams against transformers' log-probs."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from flashpage import LLM, BeamSearchParams, SamplingParams
from flashpage.beam_search import BeamSearch, BeamSearchSequence, beam_score, run_beam_search
from flashpage.engine.sampler import Logprobs
from flashpage.outputs import CompletionOutput, RequestOutput

EOS = 0


def _toy_logprobs(tokens: list[int], vocab: int) -> list[float]:
    """A fixed next-token distribution that depends on the last two tokens."""
    g = torch.Generator().manual_seed(1 + 31 * tokens[-1] + 7 * (tokens[-2] if len(tokens) > 1 else 0))
    return torch.log_softmax(torch.randn(vocab, generator=g) * 2, 0).tolist()


def _toy_run(vocab: int):
    def run(reqs: list[tuple[int, list[int]]]) -> list[RequestOutput]:
        outs = []
        for i, (_, toks) in enumerate(reqs):
            lps = _toy_logprobs(toks, vocab)
            top = sorted(enumerate(lps), key=lambda t: -t[1])
            lp = Logprobs(top[0][0], top[0][1], 1, top[:20])
            outs.append(RequestOutput(str(i), None, toks, [CompletionOutput(0, "", [top[0][0]], "length",
                                                                           logprobs=[lp])]))
        return outs

    return run


def _exhaustive(prompt: list[int], vocab: int, max_tokens: int, ignore_eos: bool,
                length_penalty: float) -> list[tuple[float, list[int]]]:
    """Every continuation beam search can end with: max_tokens long, or shorter and ending in
    EOS (the only place EOS may be, unless ignored), scored as beam_score does."""
    seqs = []
    for n in range(1, max_tokens + 1):
        for gen in itertools.product(range(vocab), repeat=n):
            if not ignore_eos and (EOS in gen[:-1] or (n < max_tokens and gen[-1] != EOS)):
                continue
            if ignore_eos and n < max_tokens:
                continue
            toks, cum = list(prompt), 0.0
            for t in gen:
                cum += _toy_logprobs(toks, vocab)[t]
                toks.append(t)
            seq = BeamSearchSequence(toks, cum_logprob=cum)
            seqs.append((beam_score(seq, () if ignore_eos else (EOS,), length_penalty), list(gen)))
    return sorted(seqs, reverse=True)


@pytest.mark.parametrize("ignore_eos", [False, True])
@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 2.0])
def test_wide_enough_beams_are_an_exhaustive_search(ignore_eos, length_penalty):
    """With more beams than continuations (vocab 3, 3 tokens: 27) nothing is pruned, so the
    answer is the exhaustive search's best, in its order, each with its true log-prob."""
    vocab, max_tokens, width = 3, 3, 10
    prompts = [[1, 2], [2]]
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=ignore_eos,
                              length_penalty=length_penalty)
    search = BeamSearch(prompts, params, eos_token_ids=(EOS,), max_model_len=64)
    run_beam_search(search, _toy_run(vocab))
    for prompt, out in zip(prompts, search.results(lambda ids: ",".join(map(str, ids))), strict=True):
        want = _exhaustive(prompt, vocab, max_tokens, ignore_eos, length_penalty)[:width]
        got = [s.tokens[len(prompt):] for s in out.sequences]
        assert got == [g for _, g in want]
        for seq, (score, gen) in zip(out.sequences, want, strict=True):
            assert math.isclose(beam_score(seq, () if ignore_eos else (EOS,), length_penalty), score,
                                rel_tol=1e-9)
            assert len(seq.logprobs) == len(gen)
            assert math.isclose(seq.cum_logprob, sum(lp.logprob for lp in seq.logprobs))
            ended = gen[-1] == EOS and not ignore_eos
            assert seq.finish_reason == ("stop" if ended else "length")
            assert seq.stop_reason == (EOS if ended else None)
            assert seq.text == ",".join(map(str, gen[:-1] if ended else gen))


def test_narrow_beams_keep_the_best_width_each_step():
    """Width 2 over vocab 5: after every step the live beams are the best 2 extensions by
    score (checked step by step against a direct computation)."""
    vocab = 5
    params = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
    search = BeamSearch([[3]], params, eos_token_ids=(EOS,), max_model_len=64)
    run = _toy_run(vocab)
    while not search.done:
        beams = [b.tokens for b in search.instances[0].beams]
        cands = []
        for toks in beams:
            for t, lp in enumerate(_toy_logprobs(toks, vocab)):
                prev = next(b.cum_logprob for b in search.instances[0].beams if b.tokens == toks)
                cands.append((prev + lp, toks + [t]))
        search.advance(run(search.requests()))
        want = [t for _, t in sorted(cands, key=lambda c: c[0], reverse=True)[:2]]
        assert [b.tokens for b in search.instances[0].beams] == want


def test_beam_search_params_are_checked():
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="beam_width must be at most 10"):
        BeamSearchParams(beam_width=11, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=True)
    with pytest.raises(ValueError, match="temperature"):
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=-1)


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    path = tiny_checkpoint("llama2_mha")
    return LLM(str(path), device="cpu", dtype="float32", num_gpu_blocks=64,
               attention_backend="torch_native"), path


def test_one_beam_without_eos_is_greedy_decoding(llm):
    engine, _ = llm
    prompts = [[5, 17, 33, 9], [100, 3, 3, 41, 250, 7]]
    greedy = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                             use_tqdm=False)
    beams = engine.beam_search([{"prompt_token_ids": p} for p in prompts],
                               BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True))
    assert [b.sequences[0].tokens[len(p):] for p, b in zip(prompts, beams, strict=True)] == \
        [g.outputs[0].token_ids for g in greedy]


def test_beams_carry_transformers_log_probs(llm):
    """Each returned beam's cum_logprob is transformers' log-probability of its tokens (fp32);
    beams are distinct and best first; a batch gives each prompt's answer alone; the prompt
    that cannot run errs alone; no KV block is left behind."""
    import transformers

    engine, path = llm
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompts = [[5, 17, 33, 9], [100, 3, 3, 41, 250, 7, 8]]
    params = BeamSearchParams(beam_width=3, max_tokens=5, length_penalty=1.0)
    outs = engine.beam_search([*prompts, [3] * 600], params)  # the last: too long
    assert outs[2].error is not None and not outs[2].sequences
    eos = engine.engine.eos_token_ids
    for p, out in zip(prompts, outs[:2], strict=True):
        assert out.error is None and len(out.sequences) == 3
        assert len({tuple(s.tokens) for s in out.sequences}) == 3
        scores = [beam_score(s, eos, 1.0) for s in out.sequences]
        assert scores == sorted(scores, reverse=True)
        for s in out.sequences:
            assert s.tokens[:len(p)] == p
            with torch.no_grad():
                logits = hf(torch.tensor([s.tokens])).logits[0].float()
            lp = torch.log_softmax(logits, -1)
            want = sum(lp[i - 1, s.tokens[i]].item() for i in range(len(p), len(s.tokens)))
            assert s.cum_logprob == pytest.approx(want, abs=1e-3)
        alone = engine.beam_search({"prompt_token_ids": p}, params)[0]
        assert [s.tokens for s in alone.sequences] == [s.tokens for s in out.sequences]
    assert engine.engine.kv_manager.num_free_blocks == engine.engine.num_blocks
