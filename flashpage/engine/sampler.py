"""Turn each request's logits into its next token.

Order of processing, as in vLLM: the structured-output mask (a guided request's row keeps
only the tokens its pattern allows next; vLLM applies its grammar bitmask first too),
allowed_token_ids (all others at -inf), logit bias (and
min_tokens: stop tokens and eos at -inf until a request has that many outputs) -> penalties (repetition, presence, frequency) ->
temperature -> top-k -> top-p -> min-p -> sample. Sampling uses the exponential race
(argmax of p / Exp(1) noise), which needs no cumulative sum and is exact. A request
with a seed draws its noise from a generator seeded by (seed, output position), so its
tokens do not depend on what else is in the batch, nor on preemption.

On CUDA the race runs as the Gumbel-max kernel of ``kernels/sampling.py``: one read of
the logits as the model gives them (bf16), the noise made in registers from Philox keyed
by the request's seed with its output position as counter (unseeded rows: one key drawn
per step from torch's CPU generator, the row as counter). Rows with top-k / top-p / min-p
are filtered first by the sort below, then sampled by the same kernel with the same
noise, so a seeded request draws the same tokens whatever else is in the batch. The
kernel's noise is not torch's: a seed gives other tokens on CUDA than on the CPU path.

Logprobs are those of the model's raw distribution (log_softmax of the logits before
any processing), as vLLM returns by default.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any

import torch

from flashpage import envs
from flashpage.engine.sequence import Request
from flashpage.pooling import PooledBatch
from flashpage.sampling_params import SamplingParams

_SEED_MIX = 1_000_003


@dataclass
class Logprobs:
    """The chosen token's logprob and rank, and the top-k alternatives (token, logprob)."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[Logprobs | None]


class PendingSample:
    """A step's sampled tokens (and logprob tensors), still on the device.

    ``tokens`` [n] stays on the device for the next step to read its inputs from; the
    host copies are started at once (pinned, non-blocking) with an event behind them, so
    ``result()`` waits for this step only, never for a step launched after it.
    """

    def __init__(self, tokens: torch.Tensor, params: list[SamplingParams],
                 lp: tuple[torch.Tensor, ...] | None) -> None:
        self.tokens = tokens
        self._params = params
        self._host = [_to_host(t) for t in (tokens, *(lp or ()))]
        self._has_lp = lp is not None
        # speculative decoding: request id -> its drafts as checked (spec_decode.Checked), for
        # the requests whose drafts ran this step
        self.drafted: dict[str, Any] | None = None
        # the outputs of the pooling requests whose prompts ended this step (flashpage/pooling.py)
        self.pooled: PooledBatch | None = None
        self._event: torch.cuda.Event | None = None
        if tokens.is_cuda:
            self._event = torch.cuda.Event()
            self._event.record()
        self._result: SamplerOutput | None = None

    def result(self) -> SamplerOutput:
        if self._result is None:
            if self._event is not None:
                self._event.synchronize()
            token_list = self._host[0].tolist()
            lps: list[Logprobs | None] = [None] * len(token_list)
            if self._has_lp:
                chosen, ranks, *top = (h.tolist() for h in self._host[1:])
                vals_l, ids_l = (top[0], top[1]) if top else (None, None)
                for i, p in enumerate(self._params):
                    if p.logprobs is None:
                        continue
                    k = p.logprobs
                    pairs = list(zip(ids_l[i][:k], vals_l[i][:k], strict=True)) \
                        if k and ids_l and vals_l else []
                    lps[i] = Logprobs(token_list[i], chosen[i], ranks[i], pairs)
            self._result = SamplerOutput(token_list, lps)
        return self._result


def _to_host(t: torch.Tensor) -> torch.Tensor:
    if not t.is_cuda:
        return t.clone()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def _to_device(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """A host tensor on ``dev``: on CUDA through pinned memory, not waiting for the stream."""
    return t.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else t


def _biases(r: Request, vocab: int) -> dict[int, float] | None:
    """``r``'s additive logit biases for its next token: its ``logit_bias`` (token ids checked
    against the vocabulary when the request was added), and -inf on the tokens min_tokens
    holds back (Request.held_back_tokens; a stop token id past the vocabulary, which cannot
    be sampled anyway, is left out); None if there are none."""
    out = dict(r.sampling_params.logit_bias or {})
    for t in r.held_back_tokens():
        if t < vocab:
            out[t] = float("-inf")
    if r.bad_word_ids:  # a bad word's last token, where the output ends in the rest of it
        outs = r.output_token_ids
        for ids in r.bad_word_ids:
            head = len(ids) - 1
            if head == 0 or (len(outs) >= head and outs[len(outs) - head:] == ids[:-1]):
                out[ids[-1]] = float("-inf")
    return out or None


def has_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def needs_known_tokens(p: SamplingParams) -> bool:
    """Penalties, structured outputs and bad words: sampling reads the request's earlier
    tokens on the host (the penalties' counts; the guide's state, advanced by each token read
    back; the end of the output a bad word may continue), so async scheduling must read each
    step back before the next one is sampled."""
    return has_penalties(p) or p.structured_outputs is not None or bool(p.bad_words)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim of x [n, V] -> [n] (first index among equal maxima).

    On the GPU one row is one thread block: a batch of a few rows over a 128k vocabulary
    took ~27 us. Few rows are split into 256 chunks first (max per chunk, then over the
    chunks), which spreads the work over the whole GPU.
    """
    n, v = x.shape
    if not x.is_cuda or n > 32 or v < 32768:
        return x.argmax(dim=-1)
    chunk = -(-v // 256)
    if chunk * 256 != v:
        x = torch.nn.functional.pad(x, (0, chunk * 256 - v), value=float("-inf"))
    vals, idx = x.view(n, 256, chunk).max(dim=-1)
    best = vals.argmax(dim=-1)
    return best * chunk + idx.gather(1, best[:, None])[:, 0]


def needs_filter(p: SamplingParams) -> bool:
    """top-k / top-p / min-p: the sort-based filter runs before sampling (greedy rows
    never need it: each filter keeps the top token)."""
    return not p.greedy and (p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0)


def _philox_key(seed: int) -> int:
    """A request's seed (any Python int) as a signed 64-bit Philox key."""
    k = seed & 0xFFFF_FFFF_FFFF_FFFF
    return k - (1 << 64) if k >> 63 else k


def _kernel_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _exponential(t: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Fill ``t`` in place with Exp(1) noise as -log(U), U uniform in [0, 1): the
    distribution of ``Tensor.exponential_``, ~4.7x faster on the CPU (32 x 49152: 6.5 ms
    against 30 on this project's 2-core machine). U = 0 gives +inf: that token's
    p / noise is 0, never the argmax."""
    return t.uniform_(generator=generator).log_().neg_()


class Sampler:
    def __init__(self, vocab_size: int, use_kernel: bool | None = None) -> None:
        """use_kernel: sample with the Gumbel-max kernel (kernels/sampling.py). None:
        FLASHPAGE_SAMPLER_KERNEL decides, by default on CUDA when Triton imports; True:
        always (on the CPU through Triton's interpreter, for tests); False: never (the
        torch path)."""
        self.vocab_size = vocab_size
        self.use_kernel = use_kernel

    def _kernel_on(self, logits: torch.Tensor) -> bool:
        if self.use_kernel is not None:
            return self.use_kernel
        forced = envs.sampler_kernel()
        if forced is not None:
            return forced
        return logits.is_cuda and _kernel_available()

    def warm_up(self, device: torch.device | str) -> None:
        """Compile the kernel's fp32 variant (logits after penalties or a top-k/top-p
        filter) now; the model's dtype compiles with the engine's first sampled step."""
        if not self._kernel_on(torch.empty(0, device=device)):
            return
        from flashpage.kernels.sampling import sample_gumbel

        x = torch.zeros(2, self.vocab_size, dtype=torch.float32, device=device)
        ints = torch.zeros(2, dtype=torch.int64, device=device)
        sample_gumbel(x, self.vocab_size, torch.tensor([0.5, 0.0], device=device), ints, ints)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """logits [n, >=V] (any float dtype) for ``requests`` in the same order."""
        return self.launch(logits, requests).result()

    @torch.no_grad()
    def launch(self, logits: torch.Tensor, requests: list[Request]) -> PendingSample:
        """Sample without waiting for the device: the tokens and logprobs come back
        through ``PendingSample.result()``."""
        logits = logits[:, : self.vocab_size]
        params = [r.sampling_params for r in requests]
        want_logprobs = any(p.logprobs is not None for p in params)
        raw_logprobs = torch.log_softmax(logits.float(), dim=-1) if want_logprobs else None

        vocab = logits.shape[1]
        guided = [i for i, r in enumerate(requests) if r.guide is not None]
        allowed = {i: p.allowed_token_ids for i, p in enumerate(params) if p.allowed_token_ids}
        biases = {i: b for i, (r, p) in enumerate(zip(requests, params, strict=True))
                  if (p.min_tokens or p.logit_bias or r.bad_word_ids) and (b := _biases(r, vocab))}
        pen_rows = [i for i, p in enumerate(params) if has_penalties(p)]
        if guided or allowed or biases or pen_rows:  # a copy: the logits may be a CUDA graph's output
            logits = logits.to(torch.float32, copy=True)
        if guided:
            self._apply_guides(logits, guided, requests)
        if allowed:
            self._apply_allowed(logits, allowed)
        if biases:
            self._apply_biases(logits, biases)
        if pen_rows:
            self._apply_penalties(logits, pen_rows, requests)

        greedy = [p.greedy for p in params]
        if self._kernel_on(logits):  # the logits in the model's dtype, read once
            tokens = self._sample_kernel(logits, requests, params, greedy)
        elif all(greedy):
            tokens = row_argmax(logits.float())
        else:
            tokens = self._sample(logits.float(), requests, params, greedy)
        if raw_logprobs is None:
            return PendingSample(tokens, params, None)
        return PendingSample(tokens, params, self._logprobs(raw_logprobs, tokens, params))

    @staticmethod
    def _apply_guides(logits: torch.Tensor, rows: list[int], requests: list[Request]) -> None:
        """Guided rows: every token their pattern does not allow next to -inf. Each mask
        [V] is cached on the device per guide state, so a step copies only the row ids."""
        dev = logits.device
        masks = torch.stack([requests[i].guide.mask(dev) for i in rows])  # type: ignore[union-attr]
        index = _to_device(torch.tensor(rows, dtype=torch.long), dev)
        sub = logits.index_select(0, index).masked_fill_(~masks[:, : logits.shape[1]], float("-inf"))
        logits.index_copy_(0, index, sub)

    @staticmethod
    def _apply_allowed(logits: torch.Tensor, allowed: dict[int, list[int]]) -> None:
        """Rows of ``allowed``: every logit but those of their allowed tokens to -inf (one
        host-to-device copy for the batch)."""
        dev = logits.device
        rows = _to_device(torch.tensor(list(allowed), dtype=torch.long), dev)
        pairs = _to_device(torch.tensor([(j, t) for j, ids in enumerate(allowed.values()) for t in ids],
                                        dtype=torch.long), dev)
        keep = torch.zeros(len(allowed), logits.shape[1], dtype=torch.bool, device=dev)
        keep[pairs[:, 0], pairs[:, 1]] = True
        sub = logits.index_select(0, rows).masked_fill_(~keep, float("-inf"))
        logits.index_copy_(0, rows, sub)

    @staticmethod
    def _apply_biases(logits: torch.Tensor, biases: dict[int, dict[int, float]]) -> None:
        """logits[row, token] += bias for every entry, in one host-to-device copy."""
        rows = [i for i, b in biases.items() for _ in b]
        toks = [t for b in biases.values() for t in b]
        vals = [v for b in biases.values() for v in b.values()]
        idx = _to_device(torch.tensor([rows, toks], dtype=torch.long), logits.device)
        values = _to_device(torch.tensor(vals, dtype=torch.float32), logits.device)
        logits.index_put_((idx[0], idx[1]), values, accumulate=True)

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, rows: list[int], requests: list[Request]) -> None:
        """Repetition (over prompt + output), presence and frequency (over output) penalties
        of ``rows``, for all of them at once: one host-to-device copy, no per-request sync."""
        dev, vocab = logits.device, logits.shape[1]
        reqs = [requests[i] for i in rows]
        width = max(max(len(r.all_token_ids) for r in reqs), 1)
        # ids [m, width]: each row's prompt + output ids, padded with vocab (a dummy column);
        # out_start[m]: where its output begins.
        ids = torch.full((len(reqs), width), vocab, dtype=torch.long)
        knobs = torch.empty((len(reqs), 4), dtype=torch.float32)
        for j, r in enumerate(reqs):
            # an embeds prompt's ids are placeholders (engine/prompt_embeds.py): its
            # repetition penalty sees only its outputs
            skip = r.num_prompt_tokens if r.prompt_embeds is not None else 0
            ids[j, skip: len(r.all_token_ids)] = torch.tensor(r.all_token_ids[skip:], dtype=torch.long)
            p = r.sampling_params
            knobs[j] = torch.tensor([p.repetition_penalty, p.presence_penalty,
                                     p.frequency_penalty, r.num_prompt_tokens])
        ids, knobs = ids.to(dev), knobs.to(dev)
        rep, pres, freq = knobs[:, 0:1], knobs[:, 1:2], knobs[:, 2:3]
        is_output = torch.arange(width, device=dev)[None, :] >= knobs[:, 3:4]
        seen = torch.zeros((len(reqs), vocab + 1), dtype=torch.bool, device=dev)
        seen.scatter_(1, ids, True)
        counts = torch.zeros((len(reqs), vocab + 1), dtype=logits.dtype, device=dev)
        counts.scatter_add_(1, ids, is_output.to(logits.dtype))
        seen, counts = seen[:, :vocab], counts[:, :vocab]
        index = torch.tensor(rows, device=dev)
        sub = logits.index_select(0, index)
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        sub = sub - freq * counts - pres * (counts > 0).to(sub.dtype)
        logits.index_copy_(0, index, sub)

    def _sample_kernel(self, logits: torch.Tensor, requests: list[Request],
                       params: list[SamplingParams], greedy: list[bool]) -> torch.Tensor:
        """All rows in one Gumbel-max launch; rows with filters again after the sort."""
        from flashpage.kernels.sampling import sample_gumbel

        n, vocab, dev = logits.shape[0], logits.shape[1], logits.device
        filtered = [i for i, p in enumerate(params) if needs_filter(p)]
        step_key: int | None = None
        keys, positions, temps = [], [], []
        for i, (r, p, g) in enumerate(zip(requests, params, greedy, strict=True)):
            if p.seed is not None:  # its own stream: independent of the batch around it
                keys.append(_philox_key(p.seed))
                positions.append(r.num_output_tokens)
            else:
                if step_key is None and not g:  # fresh noise each step, no device sync
                    step_key = int(torch.randint(0, 1 << 62, ()))
                keys.append(step_key or 0)
                positions.append(i)
            temps.append(0.0 if g else p.temperature)
        for i in filtered:  # sampled below; argmax here costs no noise
            temps[i] = 0.0
        # Keys, positions and temperatures in one host-to-device copy, each part 16-byte
        # aligned (Triton specializes pointers on it: an odd batch would compile anew).
        pad = n % 2
        host = torch.frombuffer(bytearray(
            array("q", keys + [0] * pad + positions + [0] * pad).tobytes()
            + array("f", temps).tobytes()), dtype=torch.uint8)
        buf = host.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else host.clone()
        ints = buf[: 16 * (n + pad)].view(torch.int64)
        seeds, pos = ints[:n], ints[n + pad: 2 * n + pad]
        temps_d = buf[16 * (n + pad):].view(torch.float32)
        tokens = sample_gumbel(logits, vocab, temps_d, seeds, pos)
        if not filtered:
            return tokens
        sub = [params[i] for i in filtered]
        table = torch.tensor([[p.temperature, float(p.top_k if p.top_k > 0 else vocab), p.top_p,
                               p.min_p, float(i)] for i, p in zip(filtered, sub, strict=True)],
                             dtype=torch.float32)
        table = _to_device(table, dev)
        rows = table[:, 4].long()
        x = logits.index_select(0, rows).float() / table[:, 0:1]
        x = self._filter(x, table[:, 1:2].long(), table[:, 2:3], table[:, 3:4])
        ones = torch.ones(len(filtered), dtype=torch.float32, device=dev)
        picked = sample_gumbel(x, vocab, ones, seeds.index_select(0, rows),
                               pos.index_select(0, rows))
        return tokens.index_copy(0, rows, picked)

    def _sample(self, logits: torch.Tensor, requests: list[Request],
                params: list[SamplingParams], greedy: list[bool]) -> torch.Tensor:
        n, vocab, dev = logits.shape[0], logits.shape[1], logits.device
        # Every row's parameters in one host-to-device copy (each copy from the host
        # waits for the stream, so six small tensors cost six waits).
        table = torch.tensor(
            [[1.0 if g else p.temperature, float(p.top_k if p.top_k > 0 else vocab),
              p.top_p, p.min_p, float(g)] for p, g in zip(params, greedy, strict=True)],
            dtype=torch.float32)
        table = _to_device(table, dev)
        temps, top_k, top_p, min_p = table[:, 0:1], table[:, 1:2].long(), table[:, 2:3], table[:, 3:4]
        argmax = row_argmax(logits) if any(greedy) else None
        x = logits / temps
        if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0 for p in params):
            x = self._filter(x, top_k, top_p, min_p)
        probs = torch.softmax(x, dim=-1)
        noise = _exponential(torch.empty_like(probs))
        for i, (r, p) in enumerate(zip(requests, params, strict=True)):
            if p.seed is not None:  # its own stream: independent of the batch around it
                g = torch.Generator(device=dev)
                g.manual_seed((p.seed * _SEED_MIX + r.num_output_tokens) % (1 << 63))
                _exponential(noise[i], g)
        sampled = row_argmax(probs / noise)
        if argmax is None:
            return sampled.view(n)
        return torch.where(table[:, 4] > 0, argmax, sampled).view(n)

    @staticmethod
    def _filter(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor) -> torch.Tensor:
        """x [n, V]; top_k [n, 1] (V = off), top_p and min_p [n, 1] -> x with the
        filtered-out tokens at -inf."""
        sorted_x, order = x.sort(dim=-1, descending=True)
        ranks = torch.arange(x.shape[1], device=x.device)[None, :]
        remove = ranks >= top_k
        sorted_probs = torch.softmax(sorted_x.masked_fill(remove, float("-inf")), dim=-1)
        # Keep the smallest prefix whose mass reaches p (always keeps the top token).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        remove |= mass_before >= top_p
        remove |= sorted_probs < min_p * sorted_probs[:, :1]
        sorted_x = sorted_x.masked_fill(remove, float("-inf"))
        return torch.empty_like(x).scatter_(1, order, sorted_x)

    @staticmethod
    def _logprobs(raw: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]
                  ) -> tuple[torch.Tensor, ...]:
        """For all rows together, on the device: the chosen token's logprob [n] and rank
        [n], and the top-k values and ids [n, kmax] when some row asked for alternatives."""
        chosen = raw.gather(1, tokens[:, None])
        ranks = (raw > chosen).sum(dim=1) + 1
        kmax = max((p.logprobs or 0) for p in params)
        if not kmax:
            return chosen[:, 0], ranks
        top_vals, top_ids = raw.topk(kmax, dim=-1)
        return chosen[:, 0], ranks, top_vals, top_ids
