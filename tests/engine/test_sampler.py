"""Sampler: each filter keeps exactly the tokens it should; seeds make draws repeatable.

Each test runs the torch path and the Gumbel-max kernel path (kernels/sampling.py): on
the GPU with the logits on it, on the CPU through Triton's interpreter (slow: fewer rows).
"""

from __future__ import annotations

import pytest
import torch

from flashpage.engine.sampler import Sampler
from flashpage.engine.sequence import Request
from flashpage.sampling_params import SamplingParams

KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(params=[False, True], ids=["torch", "kernel"])
def kernel(request) -> bool:
    return request.param


def _req(params: SamplingParams, rid: str = "r", out: list[int] | None = None,
         prompt: tuple[int, ...] = (1, 2, 3)) -> Request:
    r = Request(rid, list(prompt), params)
    for t in out or []:
        r.append_output_token(t)
    return r


def _run(logits: torch.Tensor, reqs: list[Request], kernel: bool,
         vocab: int | None = None) -> list[int]:
    s = Sampler(vocab or logits.shape[-1], use_kernel=kernel)
    return s(logits.to(KERNEL_DEVICE if kernel else "cpu"), reqs).token_ids


def _draws(logits: torch.Tensor, params: SamplingParams, kernel: bool) -> set[int]:
    # 100 rows leave each test below a 1e-7 chance of missing a token it expects.
    n = 100 if kernel else 400
    reqs = [_req(params, str(i)) for i in range(n)]
    return set(_run(logits.expand(n, -1).clone(), reqs, kernel))


LOGITS = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]])  # probs ~ .64 .23 .09 .03 .01 .004


def test_greedy_is_argmax(kernel):
    logits = torch.tensor([[0.0, 5.0, 1.0, 0, 0, 0], [9.0, 0, 0, 0, 0, 1]])
    reqs = [_req(SamplingParams(temperature=0)), _req(SamplingParams(temperature=0), "b")]
    assert _run(logits, reqs, kernel) == [1, 0]


def test_top_k_keeps_k_best(kernel):
    assert _draws(LOGITS, SamplingParams(temperature=5.0, top_k=2), kernel) == {0, 1}


def test_top_p_keeps_smallest_prefix_reaching_p(kernel):
    # probs at temperature 1: .636 .234 .086 ...: top_p=0.8 needs tokens 0 and 1.
    assert _draws(LOGITS, SamplingParams(temperature=1.0, top_p=0.8), kernel) == {0, 1}
    assert _draws(LOGITS, SamplingParams(temperature=1.0, top_p=0.5), kernel) == {0}


def test_min_p_drops_tokens_below_fraction_of_max(kernel):
    # p1/p0 = e^-1 = .37, p2/p0 = .14: min_p .2 keeps {0, 1}.
    assert _draws(LOGITS, SamplingParams(temperature=1.0, min_p=0.2), kernel) == {0, 1}


def test_high_temperature_reaches_all_tokens(kernel):
    assert _draws(LOGITS, SamplingParams(temperature=50.0), kernel) == set(range(6))


def test_seed_is_repeatable_and_batch_independent(kernel):
    logits = torch.randn(1, 1000)
    p = SamplingParams(temperature=1.0, seed=1234)
    alone = _run(logits.clone(), [_req(p)], kernel)[0]
    other = SamplingParams(temperature=1.0)
    batch = _run(torch.cat([torch.randn(3, 1000), logits]),
                 [_req(other, "a"), _req(other, "b"), _req(other, "c"), _req(p)], kernel)[3]
    assert alone == batch
    draws = {_run(logits.clone(), [_req(SamplingParams(temperature=1.0, seed=k))], kernel)[0]
             for k in range(30)}
    assert len(draws) > 5  # different seeds, different draws


def test_seeded_draws_ignore_filters_greedy_and_penalties_around_them(kernel):
    """A seeded request, with and without its own top-p, draws the same token alone and
    in a batch whose other rows take the filter path, greedy and penalties; its next
    position draws afresh."""
    torch.manual_seed(0)
    logits = torch.randn(1, 3000)
    others = [SamplingParams(temperature=0.7, top_k=20), SamplingParams(temperature=0),
              SamplingParams(temperature=1.0, presence_penalty=0.5),
              SamplingParams(temperature=0.9, min_p=0.05)]
    for mine in (SamplingParams(temperature=0.8, seed=77),
                 SamplingParams(temperature=0.8, seed=77, top_p=0.9)):
        alone = _run(logits.clone(), [_req(mine, out=[5, 6])], kernel)[0]
        reqs = [_req(o, str(i), out=[1]) for i, o in enumerate(others)]
        reqs.insert(2, _req(mine, out=[5, 6]))
        batch = torch.cat([torch.randn(2, 3000), logits, torch.randn(2, 3000)])
        assert _run(batch, reqs, kernel)[2] == alone
    later = {_run(logits.clone(), [_req(SamplingParams(temperature=5.0, seed=77),
                                        out=[5] * k)], kernel)[0] for k in range(10)}
    assert len(later) > 3  # each output position draws its own noise


def test_greedy_rows_in_a_mixed_batch_are_argmax_after_penalties(kernel):
    torch.manual_seed(1)
    logits = torch.randn(4, 500)
    logits[0, 7] = logits[0, 9] = 30.0  # a tie: the first index
    logits[2, 3] = 30.0
    reqs = [_req(SamplingParams(temperature=0)), _req(SamplingParams(temperature=1.0), "b"),
            _req(SamplingParams(temperature=0, presence_penalty=2.0), "c", out=[3]),
            _req(SamplingParams(top_k=1, temperature=1.0), "d")]
    got = _run(logits, reqs, kernel)
    penalized = logits[2].clone()
    penalized[3] -= 2.0
    assert got[0] == 7 and got[2] == int(penalized.argmax()) and got[3] == int(logits[3].argmax())


def test_kernel_path_unseeded_rows_draw_afresh_each_step_from_torch_generator():
    """Unseeded rows: one Philox key per step from torch's CPU generator (no device sync),
    so steps differ, rows of a step differ, and torch.manual_seed repeats a run."""
    logits = torch.zeros(8, 400)
    reqs = [_req(SamplingParams(temperature=1.0), str(i)) for i in range(8)]
    torch.manual_seed(5)
    first, second = _run(logits, reqs, True), _run(logits, reqs, True)
    assert first != second and len(set(first)) > 4
    torch.manual_seed(5)
    assert _run(logits, reqs, True) == first


def test_kernel_path_is_cuda_only_by_default_and_warm_up_runs():
    s = Sampler(50)
    assert not s._kernel_on(torch.zeros(1, 50))  # the CPU keeps the torch path
    assert Sampler(50, use_kernel=True)._kernel_on(torch.zeros(1, 50))
    s.warm_up("cpu")  # nothing to compile on the CPU path
    Sampler(50, use_kernel=True).warm_up(KERNEL_DEVICE)  # the fp32 variant


def test_logprobs_are_raw_log_softmax(kernel):
    logits = torch.randn(1, 50)
    dev = KERNEL_DEVICE if kernel else "cpu"
    out = Sampler(50, use_kernel=kernel)(logits.to(dev),
                                         [_req(SamplingParams(temperature=0, logprobs=3))])
    lp = out.logprobs[0]
    ref = torch.log_softmax(logits[0], -1)
    assert lp.token_id == int(ref.argmax()) and abs(lp.logprob - float(ref.max())) < 1e-6
    assert lp.rank == 1 and [t for t, _ in lp.top] == ref.topk(3).indices.tolist()


def test_penalties_change_the_choice(kernel):
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    r = _req(SamplingParams(temperature=0, presence_penalty=0.5), out=[0])
    assert _run(logits.clone(), [r], kernel) == [1]
    r = _req(SamplingParams(temperature=0, repetition_penalty=1.2), out=[0], prompt=(2,))
    assert _run(logits.clone(), [r], kernel) == [1]
    r = _req(SamplingParams(temperature=0, frequency_penalty=0.05), out=[0])
    assert _run(logits.clone(), [r], kernel) == [0]  # 2.0 - .05 still beats 1.9


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_sampler_on_llama_vocab_gpu():
    """bf16 logits [256, 128256 + padding] as the model gives them: greedy rows are
    argmax, a seeded row (plain and with top-p) draws the same token alone and in the
    batch, and the default Sampler on CUDA takes the kernel path."""
    vocab, n = 128256, 256
    torch.manual_seed(2)
    logits = (3 * torch.randn(n, vocab + 8, device="cuda")).to(torch.bfloat16)
    logits[:, vocab:] = 1e4
    kinds = [SamplingParams(temperature=0), SamplingParams(temperature=0.6),
             SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=1.0, top_k=50)]
    reqs = [_req(kinds[i % 4], str(i)) for i in range(n)]
    mine = [SamplingParams(temperature=0.6, seed=4242), SamplingParams(temperature=0.7, seed=9, top_p=0.8)]
    reqs[10], reqs[201] = _req(mine[0], "m0", out=[1, 2]), _req(mine[1], "m1", out=[3])
    s = Sampler(vocab)
    assert s._kernel_on(logits)
    got = s(logits, reqs).token_ids
    assert [got[i] for i in range(0, n, 4)] == logits[::4, :vocab].argmax(-1).tolist()
    assert all(t < vocab for t in got)
    assert s(logits[10:11].clone(), [_req(mine[0], "m0", out=[1, 2])]).token_ids[0] == got[10]
    assert s(logits[201:202].clone(), [_req(mine[1], "m1", out=[3])]).token_ids[0] == got[201]


def test_sampler_kernel_env(monkeypatch):
    """FLASHPAGE_SAMPLER_KERNEL: 1 forces the kernel (the interpreter on the CPU), 0 the
    torch path; unset, the CPU takes the torch path; an explicit use_kernel wins."""
    from flashpage.engine.sampler import Sampler

    x = torch.zeros(1, 8)
    monkeypatch.delenv("FLASHPAGE_SAMPLER_KERNEL", raising=False)
    assert not Sampler(8)._kernel_on(x)
    monkeypatch.setenv("FLASHPAGE_SAMPLER_KERNEL", "1")
    assert Sampler(8)._kernel_on(x) and not Sampler(8, use_kernel=False)._kernel_on(x)
    monkeypatch.setenv("FLASHPAGE_SAMPLER_KERNEL", "0")
    assert not Sampler(8)._kernel_on(x)


def test_logit_bias_moves_and_bans_tokens(kernel):
    """+100 makes token 5 the greedy choice; -100 on the argmax hands it to the runner-up;
    logprobs stay those of the raw logits (vLLM's default)."""
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]] * 3)
    reqs = [_req(SamplingParams(temperature=0, logit_bias={5: 100.0}), "a"),
            _req(SamplingParams(temperature=0, logit_bias={0: -100.0}, logprobs=0), "b"),
            _req(SamplingParams(temperature=0), "c")]
    out = Sampler(6, use_kernel=kernel)(logits.to(KERNEL_DEVICE if kernel else "cpu"), reqs)
    assert out.token_ids == [5, 1, 0]
    raw = torch.log_softmax(logits[1], -1)
    assert out.logprobs[1].logprob == pytest.approx(float(raw[1]), abs=1e-5)
    # sampled rows: a -100 token never drawn
    assert 0 not in _draws(LOGITS, SamplingParams(temperature=1.0, logit_bias={0: -100.0}), kernel)


def test_min_tokens_holds_stop_tokens_and_eos_back(kernel):
    """vLLM's min_tokens: until a request has that many outputs its stop token ids and eos
    are not sampled (not merely not stopped on); from then on they are, and ignore_eos leaves
    eos alone. Eos here is token 0, the argmax; stop token 1 the runner-up."""
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]])

    def pick(params: SamplingParams, outputs: int) -> int:
        r = Request("r", [1, 2, 3], params, eos_token_id=0)
        for _ in range(outputs):
            r.append_output_token(4)
        return _run(logits, [r], kernel)[0]

    held = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1])
    assert pick(held, 0) == 2 and pick(held, 1) == 2  # eos and the stop token held back
    assert pick(held, 2) == 0  # min_tokens reached: eos again
    assert pick(SamplingParams(temperature=0, min_tokens=2, ignore_eos=True, stop_token_ids=[1]), 0) == 0
    # a stop token id past the vocabulary is skipped (it cannot be drawn); eos still held back
    assert pick(SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[10**6]), 0) == 1
    assert 0 not in _draws(LOGITS, SamplingParams(temperature=1.0, min_tokens=1,
                                                   stop_token_ids=[0]), kernel)


@pytest.mark.parametrize("bias, needle", [
    ({-1: 1.0}, "keys"), ({True: 1.0}, "keys"), ({"5": 1.0}, "keys"),
    ({5: 101.0}, "[-100, 100]"), ({5: float("nan")}, "[-100, 100]"), ([5], "dict"),
])
def test_logit_bias_validation(bias, needle):
    with pytest.raises(ValueError, match="logit_bias") as e:
        SamplingParams(logit_bias=bias)
    assert needle in str(e.value)


def test_allowed_token_ids_restrict_the_draw(kernel):
    """allowed_token_ids: greedy takes the best allowed token, sampling draws only allowed
    ones, other rows are untouched, and logit_bias applies on top."""
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]] * 3)
    reqs = [_req(SamplingParams(temperature=0, allowed_token_ids=[3, 5]), "a"),
            _req(SamplingParams(temperature=0), "b"),
            _req(SamplingParams(temperature=0, allowed_token_ids=[3, 5], logit_bias={5: 10.0}), "c")]
    assert _run(logits, reqs, kernel) == [3, 0, 5]
    assert _draws(LOGITS, SamplingParams(temperature=5.0, allowed_token_ids=[2, 4]), kernel) == {2, 4}
    with pytest.raises(ValueError, match="allowed_token_ids must be a non-empty list"):
        SamplingParams(allowed_token_ids=[])
