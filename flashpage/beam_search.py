"""Beam search over the engine's ordinary requests (vLLM's ``LLM.beam_search`` and the
server's ``use_beam_search``).

No new engine machinery: each step, every live beam of every prompt runs as a one-token
request over its whole token sequence, asking for the ``2 * beam_width`` likeliest next
tokens (the model's own distribution, as logprobs report it: temperature does not change
which beams are kept). The prefix cache serves each beam's full blocks, so a step computes
about one block per beam, and beams that share a prefix share its blocks.

Each beam's candidates extend it by one token, its log-probability added to the beam's sum;
of all a prompt's candidates the ``beam_width`` best by score live on, and a candidate that
ends in an end-of-sequence token is set aside as finished (``"stop"``) unless ``ignore_eos``.
After ``max_tokens`` steps (or when no beam is left, or a beam reaches the model's context)
the live beams join the finished ones (``"length"``) and the ``beam_width`` best by score
are the answer, best first. Score (vLLM's): ``cum_logprob / length ** length_penalty``, the
length counting the prompt's tokens and the generated ones but a final end-of-sequence token.

``BeamSearch`` is the bookkeeping alone: ``requests()`` what to run this step, ``advance()``
with their outputs; ``LLM.beam_search`` drives it with the engine, the server with its async
engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from flashpage.engine.sampler import Logprobs
from flashpage.outputs import RequestOutput
from flashpage.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class BeamSearchSequence:
    """One beam: ``tokens`` the prompt's then the generated ones; ``logprobs`` one entry per
    generated token (its log-probability, rank and the step's top alternatives)."""

    tokens: list[int]
    logprobs: list[Logprobs] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (an end-of-sequence token) | "length"
    stop_reason: int | None = None  # the end-of-sequence token that ended it


@dataclass
class BeamSearchOutput:
    """A prompt's answer: up to ``beam_width`` sequences, best first; ``error`` set (and no
    sequences) when the prompt could not run."""

    sequences: list[BeamSearchSequence]
    error: str | None = None


def beam_score(seq: BeamSearchSequence, eos_token_ids: Sequence[int], length_penalty: float) -> float:
    n = len(seq.tokens) - (1 if seq.tokens and seq.tokens[-1] in eos_token_ids else 0)
    return seq.cum_logprob / (max(n, 1) ** length_penalty)


@dataclass
class _Instance:
    prompt_len: int
    beams: list[BeamSearchSequence]
    finished: list[BeamSearchSequence] = field(default_factory=list)
    error: str | None = None


class BeamSearch:
    """The beams of several prompts. Each step: ``requests()`` -> run them (one-token requests
    with ``step_params``, outputs in the same order) -> ``advance(outputs)``; until ``done``,
    then ``results(decode)``."""

    def __init__(self, prompts: Sequence[Sequence[int]], params: BeamSearchParams,
                 eos_token_ids: Sequence[int], max_model_len: int) -> None:
        self.params = params
        self.eos = tuple(eos_token_ids)
        self.max_model_len = max_model_len
        self.instances = [_Instance(len(p), [BeamSearchSequence(list(p))]) for p in prompts]
        self.steps = 0
        self.step_params = SamplingParams(n=1, temperature=0.0, max_tokens=1, ignore_eos=True,
                                          logprobs=2 * params.beam_width, detokenize=False)
        self._pending: list[tuple[int, BeamSearchSequence]] = []

    @property
    def done(self) -> bool:
        return self.steps >= self.params.max_tokens or not any(i.beams for i in self.instances)

    def requests(self) -> list[tuple[int, list[int]]]:
        """(prompt index, token ids) of every live beam: this step's requests. A beam that
        fills the model's context finishes here ("length")."""
        self._pending = []
        for k, inst in enumerate(self.instances):
            live = []
            for beam in inst.beams:
                if len(beam.tokens) >= self.max_model_len and self.steps > 0:
                    beam.finish_reason = "length"
                    inst.finished.append(beam)
                else:
                    live.append(beam)
            inst.beams = live
            self._pending += [(k, b) for b in live]
        return [(k, b.tokens) for k, b in self._pending]

    def advance(self, outputs: Sequence[RequestOutput]) -> None:
        """The outputs of ``requests()``'s requests, in its order."""
        if len(outputs) != len(self._pending):
            raise ValueError(f"{len(outputs)} outputs for {len(self._pending)} beams")
        width = self.params.beam_width
        candidates: dict[int, list[BeamSearchSequence]] = {}
        for (k, beam), out in zip(self._pending, outputs, strict=True):
            inst = self.instances[k]
            if out.error is not None or not out.outputs or not out.outputs[0].logprobs:
                inst.error = inst.error or out.error or "the step returned no logprobs"
                continue
            lp = out.outputs[0].logprobs[0]
            assert lp is not None  # asked for: step_params.logprobs
            for rank, (tok, logprob) in enumerate(lp.top[:2 * width], start=1):
                seq = BeamSearchSequence(beam.tokens + [tok],
                                         beam.logprobs + [Logprobs(tok, logprob, rank, lp.top)],
                                         beam.cum_logprob + logprob)
                if tok in self.eos and not self.params.ignore_eos:
                    seq.finish_reason, seq.stop_reason = "stop", tok
                    inst.finished.append(seq)
                else:
                    candidates.setdefault(k, []).append(seq)
        for k, inst in enumerate(self.instances):
            if inst.error is not None:
                inst.beams, inst.finished = [], []
                continue
            cands = candidates.get(k, [])
            cands.sort(key=self._score, reverse=True)
            inst.beams = cands[:width]
        self._pending = []
        self.steps += 1

    def _score(self, seq: BeamSearchSequence) -> float:
        # under ignore_eos an end-of-sequence token is a token like the others (vLLM still
        # leaves a final one out of the length)
        return beam_score(seq, () if self.params.ignore_eos else self.eos, self.params.length_penalty)

    def generated(self, prompt_index: int, seq: BeamSearchSequence) -> list[int]:
        """The ids a sequence's text is decoded from: its generated tokens, less a final
        end-of-sequence token unless include_stop_str_in_output."""
        gen = seq.tokens[self.instances[prompt_index].prompt_len:]
        if seq.stop_reason is not None and not self.params.include_stop_str_in_output:
            gen = gen[:-1]
        return gen

    def results(self, decode: Callable[[list[int]], str] | None = None) -> list[BeamSearchOutput]:
        """Each prompt's best ``beam_width`` sequences, best first; ``decode``: generated ids
        -> text (an end-of-sequence token decoded only with include_stop_str_in_output)."""
        outs = []
        for k, inst in enumerate(self.instances):
            if inst.error is not None:
                outs.append(BeamSearchOutput([], inst.error))
                continue
            for beam in inst.beams:
                beam.finish_reason = beam.finish_reason or "length"
            best = sorted(inst.finished + inst.beams, key=self._score,
                          reverse=True)[:self.params.beam_width]
            if decode is not None:
                for seq in best:
                    seq.text = decode(self.generated(k, seq))
            outs.append(BeamSearchOutput(best))
        return outs


def run_beam_search(search: BeamSearch,
                    run: Callable[[list[tuple[int, list[int]]]], list[RequestOutput]]) -> None:
    """Drive ``search`` to the end with ``run`` (this step's requests -> their outputs)."""
    while not search.done:
        reqs = search.requests()
        if not reqs:
            break
        search.advance(run(reqs))
