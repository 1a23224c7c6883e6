"""``use_beam_search`` on /v1/completions and /v1/chat/completions (vLLM's): ``n`` beams,
the request's ``n`` choices its ``n`` likeliest continuations, best first
(flashpage/beam_search.py). Each step's beams run as one-token engine requests; the answer
is shaped as a generated one, so the endpoints render it as usual.

Not streamed (the best beams are known only at the end) and without what a beam cannot
honour: stop strings, structured outputs, logit_bias, allowed_token_ids, bad_words,
prompt_logprobs, echo: each a 400 naming the field. Sampling knobs (temperature, top_p, penalties, ...) do
not change which beams are kept; they are accepted and have no effect, as in vLLM.
"""

from __future__ import annotations

from flashpage.beam_search import BeamSearch
from flashpage.engine.sampler import Logprobs
from flashpage.outputs import CompletionOutput, RequestOutput
from flashpage.sampling_params import BeamSearchParams
from flashpage.server.protocol import ChatCompletionRequest, CompletionRequest, bad_request
from flashpage.server.serving import ServerState, collect, start
from flashpage.server.structured import structured_field


def beam_params(req: CompletionRequest | ChatCompletionRequest, max_tokens: int) -> BeamSearchParams:
    """The request's beam search, or a 400 naming the field it cannot take (``n`` against
    the server's limit and the rest of the sampling fields: checked by sampling_params
    first)."""
    if req.stream:
        raise bad_request("use_beam_search answers at once: it cannot stream (send stream: false)",
                          "stream")
    for name in ("stop", "logit_bias", "allowed_token_ids", "bad_words", "prompt_logprobs", "echo"):
        if getattr(req, name, None):
            raise bad_request(f"{name} is not supported with use_beam_search", name)
    field = structured_field(req)
    if field is not None:
        raise bad_request("structured outputs are not supported with use_beam_search", field)
    try:
        return BeamSearchParams(
            beam_width=req.n, max_tokens=max_tokens, ignore_eos=bool(req.ignore_eos),
            temperature=req.temperature or 0.0,
            length_penalty=req.length_penalty if req.length_penalty is not None else 1.0,
            include_stop_str_in_output=bool(req.include_stop_str_in_output))
    except ValueError as e:
        raise bad_request(str(e).replace("beam_width", "n (the beam width)"),
                          "n" if "beam_width" in str(e) else "length_penalty") from None


async def beam_outputs(state: ServerState, prompts: list[list[int]], params: BeamSearchParams,
                       arrival: float, top_logprobs: int | None, *, model: str | None,
                       priority: int) -> list[RequestOutput]:
    """Each prompt's beams as a finished RequestOutput with ``params.beam_width`` outputs
    (index = rank); ``top_logprobs``: alternatives kept per token (None: no logprobs)."""
    engine = state.engine
    search = BeamSearch(prompts, params, engine.engine.eos_token_ids, engine.max_model_len)
    while not search.done:
        reqs = search.requests()
        if not reqs:
            break
        streams = await start(state, "beam", [ids for _, ids in reqs], search.step_params, arrival,
                              model=model, priority=priority)
        search.advance(await collect(streams))
    tok = state.tokenizer
    outs = []
    for k, (ids, res) in enumerate(zip(prompts, search.results(), strict=True)):
        if res.error is not None:
            raise bad_request(res.error, "prompt")
        comps = []
        for i, seq in enumerate(res.sequences):
            gen = search.generated(k, seq)
            text = await tok.decode(gen, skip_special_tokens=True) if tok.has_tokenizer else ""
            lps = None
            if top_logprobs is not None:
                lps = [Logprobs(lp.token_id, lp.logprob, lp.rank, lp.top[:top_logprobs])
                       for lp in seq.logprobs]
            comps.append(CompletionOutput(i, text, seq.tokens[len(ids):], seq.finish_reason,
                                          seq.stop_reason, lps, seq.cum_logprob))
        outs.append(RequestOutput(f"beam-{k}", None, ids, comps, finished=True))
    return outs
