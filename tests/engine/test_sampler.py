"""Sampler: each filter keeps exactly the tokens it should; seeds make draws repeatable."""

from __future__ import annotations

import pytest
import torch

from flashpage.engine.sampler import Sampler
from flashpage.engine.sequence import Request
from flashpage.sampling_params import SamplingParams


def _req(params: SamplingParams, rid: str = "r", out: list[int] | None = None,
         prompt: tuple[int, ...] = (1, 2, 3)) -> Request:
    r = Request(rid, list(prompt), params)
    for t in out or []:
        r.append_output_token(t)
    return r


def _draws(logits: torch.Tensor, params: SamplingParams, n: int = 400) -> set[int]:
    s = Sampler(logits.shape[-1])
    reqs = [_req(params, str(i)) for i in range(n)]
    return set(s(logits.expand(n, -1).clone(), reqs).token_ids)


LOGITS = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]])  # probs ~ .64 .23 .09 .03 .01 .004


def test_greedy_is_argmax():
    s = Sampler(6)
    out = s(torch.tensor([[0.0, 5.0, 1.0, 0, 0, 0], [9.0, 0, 0, 0, 0, 1]]),
            [_req(SamplingParams(temperature=0)), _req(SamplingParams(temperature=0), "b")])
    assert out.token_ids == [1, 0]


def test_top_k_keeps_k_best():
    assert _draws(LOGITS, SamplingParams(temperature=5.0, top_k=2)) == {0, 1}


def test_top_p_keeps_smallest_prefix_reaching_p():
    # probs at temperature 1: .636 .234 .086 ...: top_p=0.8 needs tokens 0 and 1.
    assert _draws(LOGITS, SamplingParams(temperature=1.0, top_p=0.8)) == {0, 1}
    assert _draws(LOGITS, SamplingParams(temperature=1.0, top_p=0.5)) == {0}


def test_min_p_drops_tokens_below_fraction_of_max():
    # p1/p0 = e^-1 = .37, p2/p0 = .14: min_p .2 keeps {0, 1}.
    assert _draws(LOGITS, SamplingParams(temperature=1.0, min_p=0.2)) == {0, 1}


def test_high_temperature_reaches_all_tokens():
    assert _draws(LOGITS, SamplingParams(temperature=50.0), n=2000) == set(range(6))


def test_seed_is_repeatable_and_batch_independent():
    logits = torch.randn(1, 1000)
    s = Sampler(1000)
    p = SamplingParams(temperature=1.0, seed=1234)
    alone = s(logits.clone(), [_req(p)]).token_ids[0]
    other = SamplingParams(temperature=1.0)
    batch = s(torch.cat([torch.randn(3, 1000), logits]), [_req(other, "a"), _req(other, "b"),
                                                          _req(other, "c"), _req(p)]).token_ids[3]
    assert alone == batch
    draws = {s(logits.clone(), [_req(SamplingParams(temperature=1.0, seed=k))]).token_ids[0]
             for k in range(30)}
    assert len(draws) > 5  # different seeds, different draws


def test_logprobs_are_raw_log_softmax():
    logits = torch.randn(1, 50)
    out = Sampler(50)(logits.clone(), [_req(SamplingParams(temperature=0, logprobs=3))])
    lp = out.logprobs[0]
    ref = torch.log_softmax(logits[0], -1)
    assert lp.token_id == int(ref.argmax()) and abs(lp.logprob - float(ref.max())) < 1e-6
    assert lp.rank == 1 and [t for t, _ in lp.top] == ref.topk(3).indices.tolist()


def test_penalties_change_the_choice():
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    s = Sampler(3)
    r = _req(SamplingParams(temperature=0, presence_penalty=0.5), out=[0])
    assert s(logits.clone(), [r]).token_ids == [1]
    r = _req(SamplingParams(temperature=0, repetition_penalty=1.2), out=[0], prompt=(2,))
    assert s(logits.clone(), [r]).token_ids == [1]
    r = _req(SamplingParams(temperature=0, frequency_penalty=0.05), out=[0])
    assert s(logits.clone(), [r]).token_ids == [0]  # 2.0 - .05 still beats 1.9


def test_batched_penalties_equal_a_per_row_reference():
    """Rows with different penalties (and one without) processed together equal the
    penalties applied row by row, as vLLM defines them."""
    torch.manual_seed(0)
    vocab = 50
    specs = [
        (SamplingParams(repetition_penalty=1.3), [1, 2, 3, 3], [4, 4, 9]),
        (SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), [7, 8], [8, 8, 8, 11]),
        (SamplingParams(), [5], [6]),
        (SamplingParams(repetition_penalty=0.8, presence_penalty=-0.3), [0], []),
    ]
    reqs = [_req(p, str(i), out=o, prompt=tuple(pr)) for i, (p, pr, o) in enumerate(specs)]
    logits = torch.randn(len(reqs), vocab)
    want = logits.clone()
    for i, (p, prompt, out) in enumerate(specs):
        row = want[i]
        for t in set(prompt + out):
            row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
        for t in set(out):
            row[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    got = logits.clone()
    Sampler._apply_penalties(got, [0, 1, 3], reqs)
    torch.testing.assert_close(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_row_argmax_matches_torch_on_gpu():
    """The chunked argmax for few rows: same index as torch's, ties and padding included."""
    from flashpage.engine.sampler import row_argmax

    for n, v in ((1, 128256), (3, 32768), (7, 151936), (32, 50000)):
        x = torch.randn(n, v, device="cuda")
        x[0, v - 1] = 100.0  # in the padded last chunk
        if n > 1:
            x[1, 5] = x[1, v // 2] = 50.0  # a tie: the first index wins
        assert torch.equal(row_argmax(x), x.argmax(dim=-1)), (n, v)
