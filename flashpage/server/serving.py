"""/v1/completions and the steps every endpoint shares (chat: chat.py, embeddings:
embeddings.py): a validated request in, engine requests out, and their outputs back as one
JSON answer or as server-sent events.

A /v1/completions request with several prompts is one engine request per prompt; each
engine request carries its ``n`` choices, numbered ``prompt_index * n + i`` in the answer.
Every engine request is aborted when the answer is abandoned: the client closes its
stream, or drops the connection while a non-streamed answer is being generated.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from flashpage.engine.sampler import Logprobs
from flashpage.engine.sleep import EngineSleepingError
from flashpage.generation_config import GenerationDefaults
from flashpage.lora.request import LoRARequest
from flashpage.outputs import RequestOutput
from flashpage.pooling import PoolingParams
from flashpage.sampling_params import (
    SamplingParams,
    StructuredOutputsError,
    StructuredOutputsParams,
)
from flashpage.server.async_engine import AsyncEngine, EngineDeadError, RequestStream
from flashpage.server.metrics import ServerMetrics
from flashpage.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    bad_request,
)
from flashpage.server.render import (
    ChoiceState,
    completion_logprobs,
    echo_logprobs,
    prompt_logprobs,
    sse,
)
from flashpage.server.structured import structured_field, structured_outputs
from flashpage.server.tokenize import ServerTokenizer, template_kwargs
from flashpage.server.tool_choice import (
    conversation,
)
from flashpage.server.tools import get_parser

logger = logging.getLogger("flashpage.server")

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

# (choice index, its stream state, text delta, logprobs of the new tokens, finish reason, the
# request's output) -> one entry of a chunk's "choices"
ChoiceRenderer = Callable[[int, ChoiceState, str, list[Logprobs], str | None, RequestOutput],
                          dict[str, Any]]


class ServerState:
    """What the handlers share: the engine, the served name, limits, metrics, tokenizer."""

    def __init__(self, engine: AsyncEngine, served_model_name: str, api_key: str | None,
                 max_n: int, max_body_bytes: int, max_prompts: int, tool_parser: str | None = None,
                 auto_tool_choice: bool = False,
                 lora_modules: dict[str, LoRARequest] | None = None,
                 reasoning_parser: str | None = None) -> None:
        channels = None  # the reasoning parser the tool-call format reads after, if any
        if tool_parser is not None:
            channels = get_parser(tool_parser).channels  # an unknown name fails at start-up
        self.reasoning = None
        self.structured_in_reasoning = False  # structured outputs cover the thinking too
        if reasoning_parser is None and channels is not None:
            logger.info("--tool-call-parser %s reads %s's channels: reasoning parsed as %s",
                        tool_parser, channels, channels)
            reasoning_parser = channels  # (vLLM's harmony answers always split the analysis)
        if reasoning_parser is not None:
            from flashpage.server.reasoning import get_reasoning_parser

            self.reasoning = get_reasoning_parser(reasoning_parser)  # (an unknown one: now)
            if channels is not None and reasoning_parser != channels:
                raise ValueError(f"--tool-call-parser {tool_parser} reads {channels}'s output: "
                                 f"not with --reasoning-parser {reasoning_parser}")
        self.engine = engine
        # token ids that end a turn for the reasoning format beyond the model's eos (GPT-OSS:
        # <|return|> and <|call|>, in case its generation_config does not list them)
        self.stop_token_ids = _stop_ids(engine.tokenizer, self.reasoning)
        # harmony: where the prompt's last message starts (<|start|>'s id), for its tail
        self._tail_mark = _harmony_id(engine.tokenizer, self.reasoning, "<|start|>")
        self.tool_parser = tool_parser
        self.auto_tool_choice = auto_tool_choice
        self.model_name = served_model_name
        self.api_key = api_key.encode() if api_key else None
        self.max_n = max_n
        self.max_body_bytes = max_body_bytes
        self.max_prompts = max_prompts
        self.metrics: ServerMetrics = engine.metrics or ServerMetrics()
        engine.metrics = self.metrics
        self.tokenizer = ServerTokenizer(engine.tokenizer)
        self.created = int(time.time())
        # --lora-modules: a request's "model" naming one runs with that adapter
        self.lora_modules = dict(lora_modules or {})
        # stored Responses API answers (server/responses.py), made at the first one
        self._responses: Any = None
        # the last adapter id given out (runtime loads take the next: server/lora_admin.py)
        self.lora_ids = max((lr.lora_int_id for lr in self.lora_modules.values()), default=0)

    @property
    def responses(self) -> Any:
        """The Responses API's store (server/responses.ResponseStore)."""
        if self._responses is None:
            from flashpage.server.responses import ResponseStore

            self._responses = ResponseStore()
        return self._responses

    def tail_start(self, ids: list[int]) -> int:
        """Where the prompt's tail a reasoning parser reads begins: its last 8 tokens, or for
        harmony from its last <|start|> (a continued message's header may be further back)."""
        at = max(len(ids) - 8, 0)
        if self._tail_mark is not None and self._tail_mark in ids[:at]:
            at = len(ids) - 1 - ids[::-1].index(self._tail_mark)
        return at

    def served_names(self) -> list[str]:
        return [self.model_name, *self.lora_modules]

    def response_model(self, model: str | None) -> str:
        """The "model" of an answer: the adapter asked for, else the served model."""
        return model if model is not None and model in self.lora_modules else self.model_name


def _harmony_id(tokenizer: Any, fmt: Any, token: str) -> int | None:
    """The id of a harmony marker, where the format is harmony and the tokenizer has it."""
    if fmt is None or not fmt.harmony or tokenizer is None:
        return None
    value = tokenizer.get_vocab().get(token)
    return value if isinstance(value, int) else None


def _stop_ids(tokenizer: Any, fmt: Any) -> list[int]:
    """The harmony format's turn-ending tokens, where the tokenizer has them."""
    from flashpage.server.harmony import STOP_TOKENS

    ids = (_harmony_id(tokenizer, fmt, t) for t in STOP_TOKENS)
    return sorted(i for i in ids if i is not None)


# ---------------------------------------------------------------------------- /v1/completions
def prompt_items(state: ServerState, raw: Any, field: str) -> list[Any]:
    """A text, texts, token ids or lists of ids (OpenAI's prompt / input) -> the list of
    prompts; 400 naming ``field`` when there are none or more than the server takes."""
    one = isinstance(raw, str) or (raw and all(isinstance(t, int) for t in raw))
    items: list[Any] = [raw] if one else list(raw)
    if not items:
        raise bad_request(f"the {field} is empty", field)
    if len(items) > state.max_prompts:
        raise bad_request(f"at most {state.max_prompts} prompts per request, got {len(items)}", field)
    return items


async def completions(state: ServerState, request: Request, req: CompletionRequest,
                      arrival: float) -> Response:
    check_priority(state, req.priority)
    embeds: list[Any] = []  # vLLM's prompt_embeds, before the prompts (server/prompt_embeds.py)
    if req.prompt_embeds is not None:
        from flashpage.server.prompt_embeds import check_embeds_request, decode_prompt_embeds

        check_embeds_request(req.echo, req.use_beam_search)
        embeds = decode_prompt_embeds(req.prompt_embeds, state.max_prompts)
    items = prompt_items(state, req.prompt, "prompt") if req.prompt is not None else []
    max_tokens = req.max_tokens if req.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS
    params = sampling_params(state, req, max_tokens, req.logprobs)
    if req.echo and req.logprobs is not None:  # the echoed prompt's tokens get logprobs too
        params.prompt_logprobs = max(req.logprobs, params.prompt_logprobs or 0)
    prompts: list[Any] = []  # token ids, or a tensor of embeddings
    for e in embeds:
        if e.dim() == 2 and e.shape[0]:  # (a wrong or empty shape: the engine's message)
            check_length(state, e.shape[0], max_tokens)
        prompts.append(e)
    for i, item in enumerate(items):
        if isinstance(item, str):
            if not item:
                raise bad_request("the prompt is empty", "prompt")
            ids = await state.tokenizer.encode(item)
        else:
            ids = list(item)
        keep = req.truncate_prompt_tokens
        if keep is not None and len(ids) > keep:
            ids = items[i] = ids[-keep:]  # cut from the front (echo shows what was kept)
        check_length(state, len(ids), max_tokens)
        prompts.append(ids)
    tok, want_lp = state.tokenizer, req.logprobs is not None
    echoes = [""] * len(prompts)  # echo: each prompt as sent, or its ids decoded
    if req.echo:
        echoes = [item if isinstance(item, str) else
                  (await tok.decode(ids) if tok.has_tokenizer else "")
                  for item, ids in zip(items, prompts, strict=True)]
    if req.use_beam_search:  # the n best beams (server/beam.py), shaped as generated choices
        from flashpage.server.beam import beam_outputs, beam_params

        beams = beam_params(req, params.max_tokens or max_tokens)
        streams: list[RequestStream] = []

        def finals_of() -> Awaitable[list[RequestOutput]]:
            return beam_outputs(state, prompts, beams, arrival, req.logprobs, model=req.model,
                                priority=req.priority)
    else:
        streams = await start(state, "cmpl", prompts, params, arrival, structured_field(req),
                              "prompt_embeds" if embeds and not items else "prompt",
                              model=req.model, priority=req.priority, cache_salt=req.cache_salt)

        def finals_of() -> Awaitable[list[RequestOutput]]:
            return collect(streams)
    rid = f"cmpl-{uuid.uuid4().hex}"
    n_prompt = sum(len(p) for p in prompts)

    def render(p: int, st: ChoiceState, delta: str, lps: list[Logprobs],
               out: RequestOutput) -> tuple[str, dict[str, Any] | None]:
        """A choice's text and logprobs so far, the echoed prompt first on its first call."""
        head = None
        if req.echo and not st.echo_sent:
            st.echo_sent = True
            if want_lp:
                head = echo_logprobs(tok, prompts[p], out.prompt_logprobs, ChoiceState())
            st.text_offset = len(echoes[p])
            delta = echoes[p] + delta
        body = completion_logprobs(tok, lps, st, want_lp)
        if head is not None and body is not None:
            body = {k: head[k] + body[k] for k in body}
        return delta, body

    if req.stream:
        def choice(idx: int, st: ChoiceState, delta: str, lps: list[Logprobs],
                   finish: str | None, out: RequestOutput) -> dict[str, Any]:
            text, lp = render(idx // params.n, st, delta, lps, out)
            return {"index": idx, "text": text, "logprobs": lp, "finish_reason": finish}

        return stream_response(state, streams, params.n, rid, "text_completion", n_prompt,
                               bool(req.stream_options and req.stream_options.include_usage),
                               choice, model=req.model)

    async def answer() -> Response:
        finals = await finals_of()
        choices, completion_tokens = [], 0
        for p, out in enumerate(finals):
            for o in out.outputs:
                completion_tokens += len(o.token_ids)
                text, lp = render(p, ChoiceState(), o.text, o.logprobs or [], out)
                entry: dict[str, Any] = {"index": p * params.n + o.index, "text": text,
                                         "logprobs": lp, "finish_reason": o.finish_reason}
                if req.prompt_logprobs is not None:
                    entry["prompt_logprobs"] = prompt_logprobs(tok, prompts[p], out.prompt_logprobs)
                choices.append(entry)
        choices.sort(key=lambda c: int(c["index"]))  # type: ignore[call-overload]
        return JSONResponse({"id": rid, "object": "text_completion", "created": int(time.time()),
                             "model": state.response_model(req.model), "choices": choices,
                             "usage": usage(n_prompt, completion_tokens)})

    return await unless_disconnected(request, answer())


# ---------------------------------------------------------------------------- /tokenize
async def tokenize(state: ServerState, req: TokenizeRequest) -> Response:
    """vLLM's /tokenize: the ids a prompt (or a chat, through the template) becomes, as the
    generation endpoints would feed them to the model."""
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("send exactly one of prompt and messages", "prompt")
    if req.messages is not None:
        if not req.messages:
            raise bad_request("messages is empty", "messages")
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        ids = await state.tokenizer.apply_chat_template(conversation(req.messages), tools,
                                                        **template_kwargs(req))
    else:
        ids = await state.tokenizer.encode(req.prompt or "", req.add_special_tokens)
    return JSONResponse({"count": len(ids), "max_model_len": state.engine.max_model_len,
                         "tokens": ids})


async def detokenize(state: ServerState, req: DetokenizeRequest) -> Response:
    """vLLM's /detokenize: token ids (each in the vocabulary) -> text, special tokens kept."""
    vocab = state.engine.vocab_size
    for i, t in enumerate(req.tokens):
        if not 0 <= t < vocab:
            raise bad_request(f"token id {t} at position {i} is outside the vocabulary [0, {vocab})",
                              "tokens")
    return JSONResponse({"prompt": await state.tokenizer.decode(req.tokens)})


# ---------------------------------------------------------------------------- shared steps
def sampling_params(state: ServerState, req: CompletionRequest | ChatCompletionRequest,
                    max_tokens: int | None, logprobs: int | None,
                    structured: StructuredOutputsParams | None = None) -> SamplingParams:
    """``structured``: the output's shape when the server sets it (a forced tool choice);
    else the request's own structured-outputs fields."""
    if req.n > state.max_n:
        raise bad_request(f"n must be at most {state.max_n}, got {req.n}", "n")
    vocab = state.engine.vocab_size
    if logprobs is not None and logprobs > vocab:
        raise bad_request(f"logprobs must be at most the vocabulary size {vocab}", "logprobs")
    # the model's generation_config.json: defaults for what the request leaves unset, and
    # max_new_tokens as a cap (flashpage/generation_config.py)
    defaults = getattr(state.engine.engine, "generation_defaults", None) or GenerationDefaults()
    if defaults.max_tokens is not None and max_tokens is not None:
        max_tokens = min(max_tokens, defaults.max_tokens)
    kw: dict[str, Any] = dict(
        n=req.n, max_tokens=max_tokens, logprobs=logprobs, stop=req.stop, seed=req.seed,
        ignore_eos=bool(req.ignore_eos),
        include_stop_str_in_output=bool(req.include_stop_str_in_output),
        skip_special_tokens=req.skip_special_tokens is not False)
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "min_tokens", "prompt_logprobs",
                 "truncate_prompt_tokens", "bad_words"):
        value = getattr(req, name)
        if value is None:
            value = defaults.sampling.get(name)
        if value is not None:
            kw[name] = value
    if req.logit_bias:
        kw["logit_bias"] = _logit_bias(req.logit_bias, vocab)
    if req.allowed_token_ids is not None:
        if any(not 0 <= t < vocab for t in req.allowed_token_ids):
            raise bad_request(f"allowed_token_ids must be token ids in [0, {vocab})", "allowed_token_ids")
        kw["allowed_token_ids"] = list(req.allowed_token_ids)
    kw["structured_outputs"] = structured if structured is not None else structured_outputs(req)
    try:
        return SamplingParams(**kw)
    except ValueError as e:  # SamplingParams names the field first
        raise bad_request(str(e), str(e).split(" ", 1)[0]) from None


def _logit_bias(bias: dict[str, float], vocab: int) -> dict[int, float]:
    """OpenAI's {"token id": bias} -> {token id: bias}; 400 naming a key that is not a token
    id of this model or a bias outside [-100, 100]."""
    out = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()) or not int(key) < vocab:
            raise bad_request(f"logit_bias keys must be token ids in [0, {vocab}), got {key!r}",
                              "logit_bias")
        if not -100.0 <= value <= 100.0:
            raise bad_request(f"logit_bias of token {key} must be in [-100, 100], got {value}",
                              "logit_bias")
        out[int(key)] = float(value)
    return out


def check_priority(state: ServerState, priority: int) -> None:
    """400 naming ``priority`` for one the engine does not take: non-zero needs
    ``--scheduling-policy priority`` (vLLM answers the same)."""
    try:
        state.engine.check_priority(priority)
    except ValueError as e:
        raise bad_request(str(e), "priority") from None


def check_length(state: ServerState, n_prompt: int, max_tokens: int | None) -> int:
    """The max_tokens to use; 400 (stating both numbers) when it does not fit the context.
    No max_tokens (chat): the rest of the context, as vLLM does."""
    limit = state.engine.max_model_len
    if n_prompt == 0:
        raise bad_request("the prompt is empty", "prompt")
    if max_tokens is None:
        if n_prompt >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens; the prompt has "
                f"{n_prompt} tokens, which leaves no room for output.", "messages")
        return limit - n_prompt
    if n_prompt + max_tokens > limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens; the prompt has "
            f"{n_prompt} tokens and max_tokens asks for {max_tokens} ({n_prompt + max_tokens} "
            "in all). Shorten the prompt or lower max_tokens.", "max_tokens")
    return max_tokens


async def start(state: ServerState, prefix: str, prompts: list[list[int]],
                params: SamplingParams | PoolingParams, arrival: float,
                structured_param: str | None = None, prompt_param: str = "prompt", *,
                model: str | None = None, priority: int = 0,
                cache_salt: str | None = None,
                multi_modal_data: Any = None) -> list[RequestStream]:
    """Add one engine request per prompt (under the LoRA adapter ``model`` names, if it
    names one; with ``priority``, checked by ``check_priority``; with ``cache_salt``, its
    prefix-cache blocks shared only within that salt); if one is refused, abort
    the others (400, naming ``prompt_param``, or ``structured_param`` when the engine could
    not compile the structured-outputs spec)."""
    streams: list[RequestStream] = []
    lora = state.lora_modules.get(model) if model is not None else None
    base = f"{prefix}-{uuid.uuid4().hex}"
    try:
        if isinstance(params, SamplingParams):  # a structured-outputs spec: compiled off the engine thread
            await state.engine.compile_guide(params)
        for i, ids in enumerate(prompts):
            streams.append(await state.engine.add_request(f"{base}-{i}", ids, params, arrival, lora,
                                                          priority, cache_salt, multi_modal_data))
    except BaseException as e:
        for s in streams:
            s.abort()
        if isinstance(e, (EngineDeadError, EngineSleepingError)):  # asleep: says how to wake it
            raise APIError(503, str(e), "server_error") from None
        if isinstance(e, StructuredOutputsError):
            raise bad_request(str(e), structured_param or "structured_outputs") from None
        if isinstance(e, ValueError):
            raise bad_request(str(e), prompt_param) from None
        raise
    return streams


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several streams as they come; one stream: no tasks.
    Leaving early aborts every stream."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    q: asyncio.Queue[tuple[int, RequestOutput | Exception | None]] = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                q.put_nowait((i, out))
            q.put_nowait((i, None))
        except Exception as e:
            q.put_nowait((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await q.get()
            if item is None:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()


async def collect(streams: list[RequestStream]) -> list[RequestOutput]:
    """The final output of each stream, in prompt order."""
    finals: list[RequestOutput | None] = [None] * len(streams)
    try:
        async for i, out in merged(streams):
            finals[i] = out
    except EngineDeadError as e:
        raise APIError(503, str(e), "server_error") from None
    return [f for f in finals if f is not None]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def stream_response(state: ServerState, streams: list[RequestStream], n: int, rid: str,
                    obj: str, prompt_tokens: int, include_usage: bool,
                    render: ChoiceRenderer, model: str | None = None) -> StreamingResponse:
    """Server-sent events: a chunk per choice per step that gave it tokens, its finish
    reason on its last chunk, the usage chunk if asked, then ``data: [DONE]``."""
    states = [ChoiceState() for _ in range(len(streams) * n)]
    created = int(time.time())

    def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
        c: dict[str, Any] = {"id": rid, "object": obj, "created": created,
                             "model": state.response_model(model), "choices": choices}
        if include_usage:
            c["usage"] = None
        return c

    async def events() -> AsyncIterator[str]:
        try:
            async for p, out in merged(streams):
                for o in out.outputs:
                    idx = p * n + o.index
                    st = states[idx]
                    delta, new_tokens, finish = st.advance(out.new_text[o.index], o)
                    if delta is None:
                        continue
                    lps = o.logprobs[len(o.logprobs) - new_tokens:] if o.logprobs and new_tokens \
                        else []
                    yield sse(chunk([render(idx, st, delta, lps, finish, out)]))
            if include_usage:
                last = chunk([])
                last["usage"] = usage(prompt_tokens, sum(s.tokens for s in states))
                yield sse(last)
        except EngineDeadError as e:
            yield sse(APIError(503, str(e), "server_error").body())
        except Exception:  # a bug: say so in the stream rather than cutting it
            logger.exception("streaming %s failed", rid)
            yield sse(APIError(500, "internal server error", "server_error").body())
        finally:
            for s in streams:
                s.abort()
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def unless_disconnected(request: Request, answer: Awaitable[Response]) -> Response:
    """Await ``answer``, but cancel it (aborting its requests) if the client goes away."""
    task = asyncio.ensure_future(answer)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.wait({task})  # let it unwind (its streams abort) without raising here
    return Response(status_code=499)  # nobody is there to read it
