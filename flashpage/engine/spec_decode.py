"""Speculative decoding by n-gram lookup (vLLM's ``{"method": "ngram"}``, "prompt lookup"),
by a small draft model (``{"model": PATH}``, method "draft_model": engine/draft_model.py),
by the checkpoint's own multi-token-prediction layer (``{"method": "mtp"}``: engine/mtp.py),
by an EAGLE head (``{"method": "eagle" | "eagle3", "model": PATH}``: engine/eagle.py),
or by Medusa heads (``{"method": "medusa", "model": PATH}``: engine/medusa.py).

Each step, a request in its decode phase looks for the last ``n`` tokens it holds
(``prompt_lookup_max`` down to ``prompt_lookup_min``) earlier in its own prompt and output;
the tokens that followed the latest earlier match become up to ``num_speculative_tokens``
drafts. The scheduler gives the request its last token and the drafts in one step (a
short chunk over its cached context: no new kernel), the model's logits at those positions
verify the drafts, and the step emits every accepted draft plus one token of the model's
own: 1 to k + 1 tokens for about the price of one decode step, since decode reads the
same weights and KV cache either way.

Verification keeps the output distribution the model's (rejection sampling with a draft
that is certain, as vLLM does for n-gram drafts): greedy rows accept a draft while it is
the argmax; sampled rows accept draft ``d`` with probability ``p(d)`` (``p`` after
temperature, top-k, top-p and min-p) and on rejection draw from ``p`` without ``d``. A
greedy request's tokens are those of plain decoding.

Requests whose sampling reads their tokens one at a time on the host (penalties, logit bias,
allowed token ids, min_tokens still holding back stop tokens) are not speculated; they decode
beside the others as before. A structured-outputs request is drafted as far as its pattern
allows, and each draft row is masked by the pattern's state after the drafts before it (the
sampled row after the last draft by the state after all of them). Logprobs come with every token, drafted
or not (the raw distribution's at the token's row, as the sampler's). The engine reads a
step back before scheduling the next while a request drafts (its drafts need the last
step's tokens); a request whose drafting keeps failing backs off for a while
(``SpecBackoff``), and with none drafting the engine schedules asynchronously again.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from flashpage.engine.sampler import Logprobs, Sampler, has_penalties, row_argmax
from flashpage.engine.sequence import Request

if TYPE_CHECKING:
    from flashpage.engine.scheduler import SchedulerOutput
    from flashpage.sampling_params import SamplingParams

SEED_MIX = 1_000_003
_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
         "backoff")
METHODS = ("ngram", "draft_model", "mtp", "eagle", "eagle3", "medusa")
_HEAD_FOLDERS = {"eagle": "EAGLE head's", "eagle3": "EAGLE head's", "medusa": "Medusa heads'"}
_INT_KEYS = ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's ``speculative_config``: n-gram drafts, a draft model's (``model``: a smaller
    model with the target's vocabulary; method "draft_model", inferred from it), or the
    target's multi-token-prediction layer's (method "mtp": GLM-4.5's), or an EAGLE head's
    (method "eagle" / "eagle3", ``model``: the head's folder), or Medusa heads' (method
    "medusa", ``model``: the heads' folder)."""

    method: str = "ngram"
    model: str | None = None
    num_speculative_tokens: int = 3
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    # ours (not vLLM's): a request whose drafts keep failing stops drafting for a while
    # (SpecBackoff), so the engine can schedule asynchronously again
    backoff: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method {self.method!r} is not supported; "
                             "use 'ngram' (prompt lookup), 'draft_model' (with a model), 'mtp' (the "
                             "checkpoint's multi-token-prediction layer), 'eagle' / 'eagle3' (with "
                             "the EAGLE head's folder as model) or 'medusa' (with the Medusa heads' "
                             "folder as model)")
        if self.method == "draft_model":
            check_draft_model(self.model)
        elif self.method in _HEAD_FOLDERS:
            if not isinstance(self.model, str) or not os.path.isfile(os.path.join(self.model, "config.json")):
                raise ValueError(f"speculative_config method {self.method!r} needs model: the "
                                 f"{_HEAD_FOLDERS[self.method]} folder (config.json and weights), got "
                                 f"{self.model!r}")
        elif self.model is not None:
            why = " (the MTP layer is the target checkpoint's own)" if self.method == "mtp" else ""
            raise ValueError(f"speculative_config model is for method 'draft_model' (or 'eagle' / "
                             f"'eagle3' / 'medusa'), not "
                             f"{self.method!r}{why}")
        if not isinstance(self.backoff, bool):
            raise ValueError(f"speculative_config backoff must be true or false, got {self.backoff!r}")
        for name in _INT_KEYS:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative_config {name} must be an integer >= 1, got {v!r}")
        if self.num_speculative_tokens > 16:
            raise ValueError("speculative_config num_speculative_tokens must be <= 16, got "
                             f"{self.num_speculative_tokens}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) is "
                             f"above prompt_lookup_max ({self.prompt_lookup_max})")

    @classmethod
    def parse(cls, spec: SpeculativeConfig | dict[str, object] | str | None) -> SpeculativeConfig | None:
        """A config from a dict or its JSON text (the CLI's ``--speculative-config``); None
        passes through. Unknown keys are named in a ValueError."""
        if spec is None or isinstance(spec, SpeculativeConfig):
            return spec
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(spec, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(spec).__name__}")
        unknown = sorted(set(spec) - set(_KEYS))
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; known: {list(_KEYS)}")
        if "method" not in spec:
            if "model" not in spec:
                raise ValueError("speculative_config needs a method (\"ngram\") or a draft model")
            spec = {**spec, "method": "draft_model"}  # as vLLM infers it from a model
        return cls(**spec)  # type: ignore[arg-type]


def check_draft_model(model: object) -> None:
    """A ValueError unless ``model`` is a folder (or .gguf file) holding a model whose
    architecture we load, neither MLA nor MoE (reads its config.json only)."""
    from flashpage.models.loader import ModelLoadError, resolve_model

    if not isinstance(model, str) or not model:
        raise ValueError("speculative_config method 'draft_model' needs a model (the draft's "
                         f"path), got {model!r}")
    try:
        cfg = resolve_model(model).config
    except (ModelLoadError, ValueError) as e:
        raise ValueError(f"speculative_config model {model!r} cannot be loaded: {e}") from None
    if cfg.is_mla or cfg.n_routed_experts or cfg.num_experts_per_tok:
        raise ValueError(f"speculative_config model {model!r} is {cfg.architecture} with "
                         f"{'MLA attention' if cfg.is_mla else 'experts (MoE)'}: draft models must be "
                         "dense with MHA/GQA attention")


def find_ngram_drafts(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> np.ndarray:
    """The up-to-``k`` tokens that followed the latest earlier occurrence of ``tokens``'s
    last ``n`` tokens, for the largest ``n`` in ``[min_n, max_n]`` that occurs; empty if
    none does. ``tokens`` int64 [L].

    Every match of an n-gram ends where the last token occurred before, so one pass over the
    tokens finds the candidates (usually few) and the longer n-grams are checked at those
    alone: ~2 us at 2k tokens on a request with no match, which a step pays per decoding
    request (the first form compared every n at every position: 23 us)."""
    L = len(tokens)
    if L < 2:
        return tokens[:0]
    ends = np.flatnonzero(tokens[:L - 1] == tokens[L - 1])  # earlier positions of the last token
    if not len(ends):
        return tokens[:0]
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        cand = ends[ends >= n - 1]
        for j in range(1, n):
            if not len(cand):
                break
            cand = cand[tokens[cand - j] == tokens[L - 1 - j]]
        if len(cand):
            start = int(cand[-1]) + 1
            return tokens[start:start + k]
    return tokens[:0]


def speculable(req: Request) -> bool:
    """Whether ``req``'s next tokens may be drafted (see the module doc)."""
    p = req.sampling_params
    return (req.pooling is None and not p.logit_bias
            and not p.allowed_token_ids and not has_penalties(p) and not req.held_back_tokens()
            and not p.bad_words)


@dataclass
class SpecStats:
    """vLLM's spec-decode counters: steps with drafts, drafts proposed, drafts accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def as_dict(self) -> dict[str, float]:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "acceptance_rate": self.acceptance_rate,
                "mean_accepted_length": (1 + self.num_accepted_tokens / self.num_drafts
                                         if self.num_drafts else 0.0)}


@dataclass
class SpecBackoff:
    """Which requests draft: a request whose drafting stays unproductive (no draft found, or
    none of its drafts accepted) for ``patience`` of its drafting steps in a row stops for
    ``base`` engine steps, twice as long each time it stops again (up to ``cap``), and back
    to ``base`` once a step accepts a draft. A step checking drafts costs ~1.45x a decode
    step on the H200 at batch 1 (run 143) and drafting keeps the engine synchronous; a
    request that is not drafting lets it schedule asynchronously."""

    patience: int = 4
    base: int = 8
    cap: int = 256
    step: int = 0  # engine steps so far (tick)
    # request id -> [unproductive steps in a row, next pause, step drafting resumes]
    _state: dict[str, list[int]] = field(default_factory=dict)

    def tick(self) -> None:
        self.step += 1

    def drafting(self, rid: str) -> bool:
        st = self._state.get(rid)
        return st is None or st[2] <= self.step

    def record(self, rid: str, productive: bool) -> None:
        st = self._state.setdefault(rid, [0, self.base, 0])
        if productive:
            st[0], st[1] = 0, self.base
            return
        st[0] += 1
        if st[0] >= self.patience:
            st[0], st[2], st[1] = 0, self.step + st[1] + 1, min(2 * st[1], self.cap)

    def forget(self, rid: str) -> None:
        self._state.pop(rid, None)

    def keep_only(self, live: set[str]) -> None:
        """Forget every request but those of ``live`` (the running ones)."""
        for rid in [r for r in self._state if r not in live]:
            del self._state[rid]


@dataclass
class NgramProposer:
    """Drafts for the running requests, from each one's own tokens (kept as int64 arrays
    grown as tokens arrive, so a step copies only what is new)."""

    config: SpeculativeConfig
    max_model_len: int
    stats: SpecStats = field(default_factory=SpecStats)
    backoff: SpecBackoff | None = None  # None: from config.backoff
    _arrays: dict[str, tuple[np.ndarray, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.backoff is None and self.config.backoff:
            self.backoff = SpecBackoff()

    def wants_tokens(self, running: list[Request]) -> bool:
        """Whether a request in ``running`` will draft as soon as its tokens are known (it
        decodes, is speculable and is not backing off): the engine then reads the last step
        back before scheduling the next."""
        bo = self.backoff
        return any(r.num_output_tokens > 0 and (bo is None or bo.drafting(r.request_id))
                   and speculable(r) for r in running)

    def propose(self, running: list[Request]) -> None:
        """Set ``spec_token_ids`` of every request in ``running`` (empty where it cannot be
        drafted: mid-prompt, tokens not yet read back, not speculable, backing off, no
        match, or no room left)."""
        cfg, bo = self.config, self.backoff
        live = set()
        todo: list[tuple[Request, int]] = []
        for req in running:
            live.add(req.request_id)
            req.spec_token_ids = []
            n = req.num_tokens
            if req.num_computed_tokens != n - 1 or req.num_unresolved or not speculable(req):
                continue
            if bo is not None and not bo.drafting(req.request_id):
                continue
            # room: max_tokens outputs and max_model_len tokens after the step's last token
            room = min(cfg.num_speculative_tokens, self.max_model_len - n - 1,
                       (req.max_tokens if req.max_tokens is not None else 1 << 62)
                       - req.num_output_tokens - 1)
            if room >= 1:
                todo.append((req, room))
        for (req, _), drafts in zip(todo, self.draft_all(todo), strict=True):
            if req.guide is not None and drafts:  # only drafts its pattern allows
                drafts = self.fit_guide(req, drafts)
            req.spec_token_ids = drafts
            if bo is not None and not drafts:
                bo.record(req.request_id, False)
        for rid in [r for r in self._arrays if r not in live]:
            del self._arrays[rid]
        if bo is not None:  # (a proposer drafting through draft_all keeps no _arrays)
            bo.keep_only(live)

    def learn(self, checked: dict[str, Checked]) -> None:
        """A checking step read back: each request's drafting was productive if it had a
        draft accepted."""
        if self.backoff is not None:
            for rid, got in checked.items():
                self.backoff.record(rid, bool(got.accepted))

    def fit_guide(self, req: Request, drafts: list[int]) -> list[int]:
        """A structured-outputs request's drafts cut where its pattern refuses one."""
        assert req.guide is not None
        return drafts[:len(req.guide.states_along(drafts)) - 1]

    def fill(self, out: SchedulerOutput) -> None:
        """After scheduling, before the step runs: nothing for n-gram drafts, which are
        known when proposed (a draft model's are computed here: engine/draft_model.py)."""

    def draft_all(self, todo: list[tuple[Request, int]]) -> list[list[int]]:
        """The drafts of each (request, room) of ``todo``: ``draft`` of each (Medusa heads
        draft them all at once: engine/medusa.py)."""
        return [self.draft(req, room) for req, room in todo]

    def draft(self, req: Request, k: int) -> list[int]:
        """Up to ``k`` tokens guessed to follow ``req``'s tokens."""
        cfg = self.config
        return find_ngram_drafts(self._tokens(req), k, cfg.prompt_lookup_min,
                                 cfg.prompt_lookup_max).tolist()

    def _tokens(self, req: Request) -> np.ndarray:
        arr, filled = self._arrays.get(req.request_id, (np.empty(0, np.int64), 0))
        n = req.num_tokens
        if n > len(arr):
            grown = np.empty(max(2 * len(arr), n + 64), np.int64)
            grown[:filled] = arr[:filled]
            arr = grown
        if n > filled:
            arr[filled:n] = req.all_token_ids[filled:n]
        self._arrays[req.request_id] = (arr, n)
        return arr[:n]


@dataclass
class Checked:
    """One request's drafts after the model checked them: those accepted, the token drawn
    at the first rejected one (None when all passed: the step's ordinary sample at the last
    position is then the bonus token), how many ran, and (when the request asked for
    logprobs) the logprobs of each token those rows emit (the accepted drafts, then the
    drawn one)."""

    accepted: list[int]
    drawn: int | None
    num_drafts: int
    logprobs: list[Logprobs] | None = None


def guide_states(spec: list[tuple[Request, list[int]]]) -> dict[str, list[int]]:
    """Each structured-outputs request's pattern states along its drafts (GuideState.states_along:
    [now, after draft 1, ...]); the proposer cut its drafts where the pattern would refuse them,
    so there are len(drafts) + 1."""
    return {r.request_id: r.guide.states_along(ds) for r, ds in spec if r.guide is not None}


@torch.no_grad()
def verify_drafts(logits: torch.Tensor, spec: list[tuple[Request, list[int]]], vocab: int,
                  states: dict[str, list[int]] | None = None) -> list[Checked]:
    """Check each request's drafts against the model. ``logits`` [sum of drafts, >= vocab]:
    row ``j`` of a request's block is the model's next-token logits at its draft ``j``'s
    position. ``states``: ``guide_states(spec)``, given for structured-outputs requests.
    Logprobs, for the requests that ask, are the raw distribution's (as the sampler's)."""
    logits = logits[:, :vocab].float()
    dev = logits.device
    drafts = torch.tensor([d for _, ds in spec for d in ds], dtype=torch.long)
    rows = [(r, j) for r, ds in spec for j in range(len(ds))]
    guided = [i for i, (r, _) in enumerate(rows) if r.guide is not None]
    if guided:  # each row masked by its pattern's state after the drafts before it
        assert states is not None
        masks = []
        for i in guided:
            r, j = rows[i]
            gs = r.guide
            assert gs is not None
            masks.append(gs.guide.mask(states[r.request_id][j], gs.allow_eos, dev))
        index = torch.tensor(guided, dtype=torch.long, device=dev)
        logits = logits.index_copy(0, index, logits.index_select(0, index).masked_fill_(
            ~torch.stack(masks)[:, :vocab], float("-inf")))  # a copy: the caller's logits stay as they are
    greedy = torch.tensor([r.sampling_params.greedy for r, _ in rows], dtype=torch.bool)
    target = row_argmax(logits)
    accept = target.cpu() == drafts
    recovered = target
    if not bool(greedy.all()):
        probs = processed_probs(logits, [r.sampling_params for r, _ in rows], vocab)
        d_dev = drafts.to(dev)
        # q, the distribution each draft was drawn from: a draft model's where it sampled
        # (Request.spec_probs), else certain (one-hot: n-gram drafts, greedy drafting)
        q = torch.zeros_like(probs).scatter_(1, d_dev[:, None], 1.0)
        i = 0
        for r, ds in spec:
            if r.spec_probs is not None:
                q[i:i + len(ds)] = r.spec_probs[:len(ds), :vocab]
            i += len(ds)
        p_draft = probs.gather(1, d_dev[:, None])[:, 0]
        q_draft = q.gather(1, d_dev[:, None])[:, 0]
        uniform = torch.rand(len(rows), device=dev)
        noise = torch.empty_like(probs).exponential_()
        for i, (r, j) in enumerate(rows):
            seed = r.sampling_params.seed
            if seed is not None:  # its own stream, keyed by the output position drawn
                g = torch.Generator(device=dev)
                g.manual_seed((seed * SEED_MIX + r.num_output_tokens + j) % (1 << 63) ^ 0x5EC)
                uniform[i] = torch.rand((), generator=g, device=dev)
                noise[i].exponential_(generator=g)
        # accepted with probability min(1, p(d) / q(d)); rejected: drawn from max(p - q, 0)
        # (renormalizing is implicit in the race argmax(x / Exp(1))); a one-hot q makes
        # these p(d) and p without d
        rest = (probs - q).clamp_(min=0.0)
        sampled = row_argmax(rest / noise)
        accept = torch.where(greedy, accept, (uniform * q_draft < p_draft).cpu())
        recovered = torch.where(greedy.to(dev), target, sampled)
    kmax = max((r.sampling_params.logprobs or 0) for r, _ in spec) \
        if any(r.sampling_params.logprobs is not None for r, _ in spec) else None
    lps = _row_logprobs(logits, torch.where(accept.to(dev), drafts.to(dev), recovered), kmax) \
        if kmax is not None else None
    acc, rec = accept.tolist(), recovered.tolist()
    out: list[Checked] = []
    i = 0
    for r, ds in spec:
        a = 0
        while a < len(ds) and acc[i + a]:
            a += 1
        emitted = ds[:a] + ([rec[i + a]] if a < len(ds) else [])
        want = r.sampling_params.logprobs
        row_lps = None
        if lps is not None and want is not None:
            chosen, ranks, top_v, top_i = lps
            row_lps = [Logprobs(t, chosen[i + j], ranks[i + j],
                                list(zip(top_i[i + j][:want], top_v[i + j][:want], strict=True)))
                       for j, t in enumerate(emitted)]
        out.append(Checked(ds[:a], rec[i + a] if a < len(ds) else None, len(ds), row_lps))
        i += len(ds)
    return out


def sampling_table(params: list[SamplingParams], vocab: int, device: torch.device) -> torch.Tensor:
    """[n, 4] fp32 on ``device``: each row's (temperature, top-k, top-p, min-p) as
    ``processed_probs`` applies them (temperature 1 for greedy rows, top-k 0 = ``vocab``)."""
    return torch.tensor([[1.0 if p.greedy else p.temperature,
                          float(p.top_k if p.top_k > 0 else vocab), p.top_p, p.min_p]
                         for p in params], dtype=torch.float32).to(device)


def processed_probs(logits: torch.Tensor, params: list[SamplingParams], vocab: int,
                    table: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's next-token distribution as its request samples it: softmax after
    temperature (1 for greedy rows), top-k, top-p and min-p. ``logits`` fp32 [n, vocab];
    ``table``: ``sampling_table(params, ...)`` made before (one copy to the device for
    several calls over the same rows)."""
    if table is None:
        table = sampling_table(params, vocab, logits.device)
    x = logits / table[:, 0:1]
    if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0 for p in params):
        x = Sampler._filter(x, table[:, 1:2].long(), table[:, 2:3], table[:, 3:4])
    return torch.softmax(x, dim=-1)


def _row_logprobs(logits: torch.Tensor, tokens: torch.Tensor, kmax: int
                  ) -> tuple[list[float], list[int], list[list[float]], list[list[int]]]:
    """Each row's raw logprob of ``tokens[row]``, its rank, and the top ``kmax`` (values,
    ids), on the host."""
    raw = torch.log_softmax(logits, dim=-1)
    chosen = raw.gather(1, tokens[:, None])
    ranks = (raw > chosen).sum(dim=1) + 1
    if kmax:
        top_v, top_i = raw.topk(kmax, dim=-1)
        return chosen[:, 0].tolist(), ranks.tolist(), top_v.tolist(), top_i.tolist()
    n = len(tokens)
    return chosen[:, 0].tolist(), ranks.tolist(), [[]] * n, [[]] * n


def unpack_checked(requests: list[Request], tokens: list[int], checked: dict[str, Checked],
                   stats: SpecStats) -> tuple[list[int], dict[str, list[int]], dict[str, int]]:
    """A speculative step read back: each request's last token (the one drawn at its first
    rejected draft, else the step's sample), the accepted drafts of those that ran drafts,
    and how many outputs each of those had resolved before them; the counters updated."""
    tokens = list(tokens)
    drafted: dict[str, list[int]] = {}
    starts: dict[str, int] = {}
    for i, req in enumerate(requests):
        got = checked.get(req.request_id)
        if got is None:
            continue
        drafted[req.request_id] = got.accepted
        starts[req.request_id] = req.num_resolved_outputs
        if got.drawn is not None:
            tokens[i] = got.drawn
        stats.num_drafts += 1
        stats.num_draft_tokens += got.num_drafts
        stats.num_accepted_tokens += len(got.accepted)
    return tokens, drafted, starts
