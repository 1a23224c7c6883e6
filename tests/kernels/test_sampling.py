"""Gumbel-max sampling kernel (kernels/sampling.py): its noise is the documented Philox
noise (against a torch Philox), does not depend on the batch or the chunking, is Gumbel
distributed; its tokens are argmax(x * log2(e) / T + noise) exactly, given that noise,
greedy rows are argmax (first index on ties), and draws follow softmax(x / T).

On the CPU the kernel runs in Triton's interpreter (fp32, fp16; ~15 ms per program, so
few rows); bf16, the real vocabulary and many draws run on the GPU."""

from __future__ import annotations

import math

import pytest
import torch
from sm90 import compile_sm90, run_compiled  # tests/kernels (on sys.path under pytest)

from flashpage.kernels import sampling as sampling_mod
from flashpage.kernels.sampling import (
    LOG2E,
    SamplingConfig,
    gumbel_noise_ref,
    philox_ref,
    sample_gumbel,
    sample_gumbel_ref,
)

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
gpu_only = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
DTYPES = [torch.bfloat16] if GPU else [torch.float32, torch.float16]
ONE_CHUNK_PER_GROUP = SamplingConfig(groups_per_chunk=1)  # many chunks at a small vocab
# lg2.approx on the GPU (absolute error < 2^-22 per log) against torch's log2.
NOISE_TOL = dict(rtol=1e-6, atol=1e-5) if GPU else dict(rtol=1e-6, atol=1e-6)
P_MIN = 1e-6  # statistical tests fail below this p-value


def _i64(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=DEVICE)


def _f32(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=DEVICE)


def _sample(x, vocab, temps, seeds, positions=None, config=SamplingConfig()):
    """Tokens and the noise the kernel used."""
    noise = torch.zeros(x.shape[0], vocab, dtype=torch.float32, device=DEVICE)
    tokens = sample_gumbel(x, vocab, temps, seeds, positions, noise_out=noise, config=config)
    return tokens, noise


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square goodness of fit, p-value from the regularized gamma."""
    counts, probs = counts.double().cpu(), probs.double().cpu()
    expected = probs * counts.sum()
    chi2 = ((counts - expected) ** 2 / expected).sum()
    dof = torch.tensor((len(counts) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, chi2 / 2))


@pytest.mark.parametrize("ctr,key,want", [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
])
def test_philox_ref_matches_random123_known_answers(ctr, key, want):
    """The torch Philox4x32-10 against Random123's known-answer vectors (kat_vectors)."""
    seed = key[0] | (key[1] << 32)
    seeds = torch.tensor([seed - (1 << 64) if seed >> 63 else seed], dtype=torch.int64)
    c = [torch.tensor([[w]], dtype=torch.int64) for w in ctr]
    assert [int(w) for w in philox_ref(seeds, *c)] == list(want)


def test_noise_is_the_documented_philox_noise():
    """Seeds over the whole int64 range, positions past 2^31, a vocab that is no multiple
    of the 1024-entry group: the kernel's noise equals the torch Philox reference."""
    vocab = 2 * 1024 + 300
    seeds = _i64(0, -3, (1 << 62) + 5, 12345)
    positions = _i64(0, 7, (1 << 31) + 3, 1)
    x = torch.zeros(4, vocab, device=DEVICE)
    _, noise = _sample(x, vocab, _f32(1.0, 0.5, 2.0, 1.0), seeds, positions)
    torch.testing.assert_close(noise, gumbel_noise_ref(seeds, positions, vocab), **NOISE_TOL)
    assert not torch.equal(noise[0], noise[3])  # other seed, other noise


def test_noise_depends_on_seed_and_position_only():
    """A row's noise and token are bit-identical alone, inside a batch (other rows,
    greedy rows, another place) and under another chunking; the position changes it."""
    vocab = 3000
    torch.manual_seed(0)
    x = torch.randn(4, vocab + 8, device=DEVICE)
    temps, seeds, positions = _f32(0.8, 0.0, 1.3, 0.8), _i64(99, 5, 17, 42), _i64(3, 0, 9, 3)
    tok_b, noise_b = _sample(x, vocab, temps, seeds, positions)
    for config in (SamplingConfig(), ONE_CHUNK_PER_GROUP, SamplingConfig(groups_per_chunk=2)):
        tok_a, noise_a = _sample(x[3:4], vocab, temps[3:], seeds[3:], positions[3:], config)
        assert torch.equal(noise_a[0], noise_b[3]) and tok_a[0] == tok_b[3]
    _, moved = _sample(x[3:4], vocab, temps[3:], seeds[3:], positions[3:] + 1)
    assert not torch.equal(moved[0], noise_b[3])
    _, no_pos = _sample(x[3:4], vocab, temps[3:], seeds[3:])
    assert not torch.equal(no_pos[0], noise_b[3])  # position 0 vs 3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab,width", [(1000, 1000), (3000, 3013), (4096, 4096)])
@pytest.mark.parametrize("config", [SamplingConfig(), ONE_CHUNK_PER_GROUP],
                         ids=["default", "chunk_per_group"])
def test_tokens_are_argmax_of_scores_on_the_same_noise(dtype, vocab, width, config):
    """Sampled rows (low, mid, high temperatures) and greedy rows (0 and < 0) against
    torch given the kernel's noise; logits past vocab are huge and must be ignored."""
    g = torch.Generator(device=DEVICE).manual_seed(vocab)
    n = 6
    x = (3 * torch.randn(n, width, generator=g, device=DEVICE)).to(dtype)
    if width > vocab:
        x[:, vocab:] = 1e4
    temps = _f32(0.6, 0.0, 1.0, 0.05, -1.0, 3.0)
    seeds = torch.randint(-(1 << 62), 1 << 62, (n,), generator=g, device=DEVICE)
    tokens, noise = _sample(x, vocab, temps, seeds, config=config)
    assert torch.equal(tokens, sample_gumbel_ref(x, vocab, temps, noise))
    greedy = temps <= 0
    assert torch.equal(tokens[greedy], x[greedy, :vocab].float().argmax(-1))
    assert (noise[greedy] == 0).all()  # greedy rows draw no noise
    assert (noise[~greedy] != 0).all()


@pytest.mark.parametrize("config", [SamplingConfig(), ONE_CHUNK_PER_GROUP],
                         ids=["default", "chunk_per_group"])
def test_ties_and_edges_take_the_first_index(config):
    """Greedy ties inside a lane, across lanes, across chunks; the last entry; a row of
    -inf; a sampled row where all but two entries are -inf."""
    vocab = 3000
    x = torch.randn(6, vocab + 5, device=DEVICE)
    x[0, [700, 5, 2999]] = 50.0  # ties in different groups: 5 wins
    x[1, [1500, 1501]] = 50.0  # neighbouring lanes
    x[2, vocab - 1] = 50.0  # last entry, in the partial last group
    x[2, vocab:] = 99.0  # past vocab: never read
    x[3] = float("-inf")  # all -inf: argmax says 0
    x[4] = float("-inf")
    x[4, [10, 2500]] = 0.0  # sampled among two
    x[5, [2047, 2048, 1023]] = 7.0  # group boundary: 1023 wins
    temps = _f32(0.0, 0.0, 0.0, 0.0, 1.0, 0.0)
    tokens, noise = _sample(x, vocab, temps, _i64(1, 2, 3, 4, 5, 6), config=config)
    assert tokens.tolist()[:4] == [5, 1500, vocab - 1, 0] and tokens[5] == 1023
    assert int(tokens[4]) in (10, 2500)
    assert torch.equal(tokens, sample_gumbel_ref(x, vocab, temps, noise))
    all_inf = torch.full((1, vocab), float("-inf"), device=DEVICE)
    assert sample_gumbel(all_inf, vocab, _f32(0.7), _i64(1), config=config).tolist() == [0]


def test_noise_is_gumbel():
    """The noise, turned back into natural units, against the Gumbel CDF exp(-exp(-g))
    (Kolmogorov-Smirnov, 160k values from 4 seeds), and its largest value is finite."""
    vocab = 40960
    x = torch.zeros(4, vocab, device=DEVICE)
    _, noise = _sample(x, vocab, _f32(1, 1, 1, 1), _i64(1, 2, 3, 4), _i64(0, 0, 0, 9))
    g = ((noise.double() - math.log2(math.log(2))) * math.log(2)).flatten().sort().values
    m = g.numel()
    cdf = torch.exp(-torch.exp(-g))
    ranks = torch.arange(1, m + 1, dtype=torch.float64, device=DEVICE)
    d = max(float((ranks / m - cdf).max()), float((cdf - (ranks - 1) / m).max()))
    assert d < math.sqrt(-math.log(P_MIN / 2) / (2 * m)), d  # KS at p = 1e-6
    assert abs(float(g.mean()) - 0.5772156649) < 0.02 and bool(torch.isfinite(g).all())
    assert float(noise.max()) <= 32.5  # from the smallest E2: 33 - log2(log2 e) = 32.47


def test_draws_of_blocks_of_the_noise_follow_softmax():
    """Eight logits at T = 0.7 against every block of 8 consecutive noise values of the
    kernel (16k draws, neighbours in a block from different Philox words): Pearson's
    chi-square against softmax(x / T)."""
    logits8 = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0], device=DEVICE)
    t, vocab = 0.7, 8 * 4096
    x = torch.zeros(4, vocab, device=DEVICE)
    _, noise = _sample(x, vocab, _f32(1, 1, 1, 1), _i64(11, 12, 13, 14))
    scale = torch.tensor(LOG2E, dtype=torch.float32, device=DEVICE) / t
    draws = (logits8 * scale + noise.view(-1, 8)).argmax(-1)
    counts = torch.bincount(draws, minlength=8)
    assert _chi2_pvalue(counts, torch.softmax(logits8 / t, -1)) > P_MIN, counts.tolist()
    # The test has power: a distribution at another temperature fails it.
    assert _chi2_pvalue(counts, torch.softmax(logits8 / (1.1 * t), -1)) < P_MIN


def test_kernel_draws_follow_softmax_small():
    """End to end through the kernel, rows of the same 8 logits with different seeds (few
    rows on the CPU: the interpreter is slow; the GPU test below draws a million)."""
    n = 240
    logits8 = torch.tensor([1.0, 0.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.0], device=DEVICE)
    temps = torch.full((n,), 1.5, device=DEVICE)
    tokens = sample_gumbel(logits8.expand(n, 8), 8, temps,
                           torch.arange(n, device=DEVICE) * 7919 + 1)
    counts = torch.bincount(tokens, minlength=8)
    assert _chi2_pvalue(counts, torch.softmax(logits8 / 1.5, -1)) > P_MIN, counts.tolist()


def test_bad_arguments_raise():
    x = torch.zeros(2, 10, device=DEVICE)
    with pytest.raises(ValueError, match="vocab"):
        sample_gumbel(x, 11, _f32(1, 1), _i64(1, 2))
    with pytest.raises(ValueError, match="seeds"):
        sample_gumbel(x, 10, _f32(1, 1), _f32(1, 2))
    with pytest.raises(ValueError, match="temperatures"):
        sample_gumbel(x, 10, _f32(1), _i64(1, 2))
    with pytest.raises(ValueError, match="noise_out"):
        sample_gumbel(x, 10, _f32(1, 1), _i64(1, 2), noise_out=torch.zeros(2, 11))


def _compile_sampling_ptx() -> dict[str, str]:
    """The partials kernel for bf16 logits compiled for sm_90 with the launcher's options
    (run with the interpreter off, by run_compiled)."""
    k = compile_sm90(sampling_mod._gumbel_max_partials,
                     dict(W=sampling_mod.NOISE_WIDTH, N_ROUNDS=10, HAS_POS=True,
                          WRITE_NOISE=False, FAST_LOG=True),
                     dict(logits_ptr="*bf16", temps_ptr="*fp32", seeds_ptr="*i64",
                          pos_ptr="*i64", part_val_ptr="*fp32", part_idx_ptr="*i32",
                          noise_ptr="*fp32"),
                     num_warps=SamplingConfig().num_warps, num_stages=3,
                     **sampling_mod.CUDA_OPTIONS)
    return {"ptx": k.asm["ptx"]}


def test_sm90_ptx_scores_round_like_torch_and_logs_are_one_instruction():
    """On the GPU the scores are a rounded product and a rounded sum (mul.rn, add.rn: no
    fma, so sample_gumbel_ref is exact), 1 / T an IEEE division, the logs lg2.approx, and
    nothing spills to local memory."""
    ptx = run_compiled("test_sampling", "_compile_sampling_ptx")["ptx"]
    assert "mul.rn.f32" in ptx and "add.rn.f32" in ptx and "div.rn.f32" in ptx
    assert "lg2.approx" in ptx and "__nv_logf" not in ptx and "__nv_log2f" not in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("n", [1, 256])
def test_llama_vocab_bf16_on_gpu(n):
    """bf16 logits of the Llama-3 vocabulary (128256, padded rows): tokens against torch
    on the kernel's noise, greedy rows against argmax, noise against the torch Philox."""
    vocab, width = 128256, 128264
    g = torch.Generator(device="cuda").manual_seed(n)
    x = (4 * torch.randn(n, width, generator=g, device="cuda")).to(torch.bfloat16)
    x[:, vocab:] = 1e4
    temps = torch.rand(n, generator=g, device="cuda") * 1.5 + 0.05
    temps[1::4] = 0.0
    seeds = torch.randint(-(1 << 62), 1 << 62, (n,), generator=g, device="cuda")
    positions = torch.randint(0, 1 << 20, (n,), generator=g, device="cuda")
    tokens, noise = _sample(x, vocab, temps, seeds, positions)
    assert torch.equal(tokens, sample_gumbel_ref(x, vocab, temps, noise))
    greedy = temps <= 0
    assert torch.equal(tokens[greedy], x[greedy, :vocab].argmax(-1))
    rows = torch.arange(0, n, 4, device="cuda")[:16]
    torch.testing.assert_close(noise[rows], gumbel_noise_ref(seeds[rows], positions[rows], vocab),
                               **NOISE_TOL)
    # Without noise_out (the kernel the engine runs): the same tokens.
    assert torch.equal(sample_gumbel(x, vocab, temps, seeds, positions), tokens)


@pytest.mark.gpu
@gpu_only
def test_million_draws_follow_softmax_on_gpu():
    """2^20 rows of the same 8 bf16 logits, different seeds, T = 0.6: Pearson's
    chi-square against softmax(x / T) (and it rejects T = 0.63)."""
    n = 1 << 20
    logits8 = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -4.0], device="cuda")
    x = logits8.to(torch.bfloat16).expand(n, 8)
    tokens = sample_gumbel(x, 8, torch.full((n,), 0.6, device="cuda"),
                           torch.arange(n, device="cuda") * 2654435761 + 12345)
    counts = torch.bincount(tokens, minlength=8)
    assert _chi2_pvalue(counts, torch.softmax(logits8 / 0.6, -1)) > P_MIN, counts.tolist()
    assert _chi2_pvalue(counts, torch.softmax(logits8 / 0.63, -1)) < P_MIN


@pytest.mark.gpu
@gpu_only
def test_draws_over_the_llama_vocab_follow_softmax_on_gpu():
    """4096 rows of one bf16 128256-entry row of logits (T = 0.8): the frequencies of its
    16 likeliest tokens (set to 12, 12.25, ... 15.75) and of the rest (a 17-bin
    chi-square, every bin expecting > 5 draws)."""
    vocab, n = 128256, 4096
    g = torch.Generator(device="cuda").manual_seed(3)
    row = (2 * torch.randn(vocab, generator=g, device="cuda")).clamp(max=8).to(torch.bfloat16)
    top = torch.randperm(vocab, generator=g, device="cuda")[:16]
    row[top] = (12 + 0.25 * torch.arange(16, device="cuda")).to(torch.bfloat16)
    probs = torch.softmax(row.float() / 0.8, -1)
    tokens = sample_gumbel(row.expand(n, vocab), vocab, torch.full((n,), 0.8, device="cuda"),
                           torch.arange(n, device="cuda") + 77)
    bins = torch.full((vocab,), 16, dtype=torch.long, device="cuda")
    bins[top] = torch.arange(16, device="cuda")
    counts = torch.bincount(bins[tokens], minlength=17)
    expected = torch.cat([probs[top], (1 - probs[top].sum()).view(1)])
    assert float(expected.min()) * n > 5
    assert _chi2_pvalue(counts, expected) > P_MIN, counts.tolist()
