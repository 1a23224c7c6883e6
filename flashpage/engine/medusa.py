"""Speculative decoding with Medusa heads (vLLM's ``{"method": "medusa", "model": PATH,
"num_speculative_tokens": k}``; the heads: models/medusa.py).

Head h maps the target's final hidden state at position p (after the final norm: what its
lm_head reads) to logits for token p + 2 + h. A request holding T tokens, T - 1 of them
computed, was last computed at position T - 2, the step that sampled token T - 1 (or that
accepted the drafts before it: position T - 2 is then the last accepted draft's, or the
last token's, all of whose inputs are accepted tokens). Its drafts for tokens T .. T + k - 1
are the argmaxes of heads 0 .. k - 1 at h_{T-2}: a chain of k = num_speculative_tokens
(at most the checkpoint's num_heads), no tree, from one hidden state, with no forward of a
draft model and no K/V cache of its own.

The target's model runner keeps each step's final hidden states (``DecoderStack.hidden_out``,
models/mtp.keep_final_hidden, as for MTP and EAGLE-1: a static buffer its CUDA graphs write
too) and where each request's tokens sit in them (``ModelRunner.last_layout``). Drafts are
known before scheduling, as n-gram drafts are: ``MedusaProposer.draft_all`` (called from
NgramProposer.propose, before the scheduler runs and before the target's next step writes the
buffer again) gathers h_{T-2} of each drafting request from the last step's rows and runs the
heads over them in one batch (k small GEMMs, eager: the heads take no graphs of their own).
While a request drafts the engine reads each step back before scheduling the next
(NgramProposer.wants_tokens), so T - 2 is in the last step; a request that was not in it
(preempted, not scheduled, back from an async step) drafts nothing this step.

Drafts are certain (argmax, no distribution): the verifier checks them as n-gram drafts
(spec_decode.verify_drafts: greedy acceptance, or rejection sampling against a one-hot q),
so the output distribution is the target's; a greedy request's tokens are plain decoding's.
Drafting rules (who drafts, back-off, structured outputs cut by the pattern) are
NgramProposer's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from flashpage.config import ModelConfig
from flashpage.engine.spec_decode import NgramProposer, SpeculativeConfig

if TYPE_CHECKING:
    from flashpage.engine.model_runner import ModelRunner
    from flashpage.engine.sequence import Request
    from flashpage.models.medusa import MedusaHeads


@dataclass
class MedusaProposer(NgramProposer):
    """Drafts from Medusa heads over the target's last step's final hidden states (module
    doc)."""

    heads: MedusaHeads | None = None
    target: ModelRunner | None = None
    hidden_states: torch.Tensor | None = None  # the target's DecoderStack.hidden_out
    skipped: int = 0  # drafting requests whose h_{T-2} was not in the last step (tests)
    head_calls: int = 0  # batched head forwards run (tests)

    def draft_all(self, todo: list[tuple[Request, int]]) -> list[list[int]]:
        heads, target, states = self.heads, self.target, self.hidden_states
        assert heads is not None and target is not None and states is not None
        where = {req.request_id: (t, start, n) for req, t, start, n in target.last_layout}
        rows: list[int] = []
        found: list[int] = []  # indices into todo
        for i, (req, _) in enumerate(todo):
            p = req.num_tokens - 2
            got = where.get(req.request_id)
            if got is None or not got[1] <= p < got[1] + got[2]:
                self.skipped += 1
                continue
            rows.append(got[0] + p - got[1])
            found.append(i)
        out: list[list[int]] = [[] for _ in todo]
        if not rows:
            return out
        self.head_calls += 1
        with torch.inference_mode():
            x = states[torch.tensor(rows, dtype=torch.long, device=states.device)]  # [m, H]
            picked = heads(x).argmax(dim=-1).T.tolist()  # [m, k]: one host sync a step
        for i, ds in zip(found, picked, strict=True):
            out[i] = ds[:todo[i][1]]
        return out


def load_medusa_heads(config: SpeculativeConfig, target_config: ModelConfig, model: torch.nn.Module,
                      dtype: torch.dtype, device: torch.device, rows: int
                      ) -> tuple[MedusaHeads, torch.Tensor]:
    """The first ``num_speculative_tokens`` Medusa heads of ``config``, and the buffer of
    ``rows`` rows the target's forwards keep their final hidden states in (set before any
    CUDA graph is captured, so the graphs write it); a ConfigError names what does not fit."""
    from flashpage.models.medusa import load_medusa, read_medusa_spec
    from flashpage.models.mtp import keep_final_hidden

    assert config.model is not None
    k = config.num_speculative_tokens
    spec = read_medusa_spec(config.model, target_config, k)
    heads = load_medusa(spec, k, dtype, device)
    states = keep_final_hidden(model, rows, dtype, device, method="medusa")
    return heads, states


def build_medusa_proposer(config: SpeculativeConfig, heads: MedusaHeads, target: ModelRunner,
                          hidden_states: torch.Tensor, max_model_len: int) -> MedusaProposer:
    """The proposer over loaded heads; the target's runner set to keep each step's layout."""
    target.keep_layout = True
    return MedusaProposer(config, max_model_len, heads=heads, target=target,
                          hidden_states=hidden_states)


__all__ = ["MedusaProposer", "build_medusa_proposer", "load_medusa_heads"]
