"""POST /v1/chat/completions: messages through the chat template (with the request's tools,
server/tool_choice.py), generated, and the answer read back as content and tool calls,
streamed or whole."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from flashpage.engine.sampler import Logprobs
from flashpage.outputs import RequestOutput
from flashpage.server.async_engine import RequestStream
from flashpage.server.protocol import ChatCompletionRequest, bad_request
from flashpage.server.reasoning import Splitter, make_splitter, structured_reasoning
from flashpage.server.render import ChoiceState, chat_logprobs, prompt_logprobs
from flashpage.server.serving import (
    ServerState,
    check_length,
    check_priority,
    collect,
    sampling_params,
    start,
    stream_response,
    unless_disconnected,
    usage,
)
from flashpage.server.structured import structured_field
from flashpage.server.tokenize import template_kwargs
from flashpage.server.tool_choice import (
    assistant_message,
    conversation,
    finish_reason,
    tool_request,
)
from flashpage.server.tool_stream import ToolStream
from flashpage.server.tools import ToolCall


async def chat(state: ServerState, request: Request, req: ChatCompletionRequest,
               arrival: float) -> Response:
    check_priority(state, req.priority)
    try:  # an encoder's, or a sequence classifier's: no generation
        state.engine.engine.check_task("generate")
    except ValueError as e:
        raise bad_request(str(e), "messages") from None
    tools = tool_request(req, state.tool_parser, state.auto_tool_choice)
    conv = conversation(req.messages)
    images = await _images(state, req, conv)  # image parts: server/images.py
    encoder = getattr(state.engine.engine, "mm_encoder", None)
    expand = getattr(encoder, "expand_videos", None)
    if images is not None and "video" in images and expand is not None:
        # InternVL: each <video> written out as its frames' text, then tokenized with the rest
        ids = await state.tokenizer.apply_chat_template_expanded(
            conv, lambda text: expand(text, images), tools.template_tools, **template_kwargs(req))
    else:
        ids = await state.tokenizer.apply_chat_template(conv, tools.template_tools,
                                                        **template_kwargs(req))
    if req.truncate_prompt_tokens is not None:
        ids = ids[-req.truncate_prompt_tokens:]  # the conversation's oldest tokens go first
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    # each image's placeholder becomes its rows (models/llava.py expand_image_tokens,
    # models/qwen2_vl.py expand_pads; a Pixtral tower's count by the image's size:
    # models/pixtral.py image_rows)
    rows = (getattr(encoder, "image_rows", None) or encoder.num_rows) if encoder is not None else None
    pics = images.get("image", []) if images is not None else []
    grows = sum(rows(im) - 1 for im in pics) \
        if images is not None and rows is not None and not hasattr(encoder, "rows_of") else 0
    # counts that depend on the prompt's other images (LLaVA-OneVision's: one tile each of
    # several; models/llava_onevision.py rows_of), or a placeholder that becomes more than its
    # rows (InternVL's <img> and </img> around them: models/internvl.py rows_of)
    if images is not None and (rows_of := getattr(encoder, "rows_of", None)) is not None:
        grows = sum(r - 1 for r in rows_of(pics))
    n_prompt = len(ids) + grows  # what the engine runs (and usage counts, as vLLM's)
    # an expansion that adds more than rows (Gemma 3's newlines and <end_of_image>, its
    # pan-and-scan text): its own count from the ids (models/gemma3_vision.py prompt_length)
    if images is not None and (length := getattr(encoder, "prompt_length", None)) is not None:
        n_prompt = length(ids, pics)
    if images is not None and ("video" in images or "audio" in images):
        # a video's rows (and Qwen3-VL's timestamps), an audio's: the encoder's own expansion
        n_prompt = await _expanded_length(encoder, ids, images)
    max_tokens = check_length(state, n_prompt, max_tokens)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    want_lp = bool(req.logprobs)
    params = sampling_params(state, req, max_tokens, (req.top_logprobs or 0) if want_lp else None,
                             tools.structured)
    fmt = state.reasoning
    if (tools.parser is not None and tools.parser.keeps_special_tokens
            or fmt is not None and fmt.keeps_special_tokens):
        params.skip_special_tokens = False  # the calls' (or channels') markers are special tokens
    if state.stop_token_ids:  # the format's turn ends (GPT-OSS: <|return|>, <|call|>)
        params.stop_token_ids = sorted({*(params.stop_token_ids or []), *state.stop_token_ids})
    tok = state.tokenizer
    # a reasoning model's thinking apart from its answer (server/reasoning.py)
    # (include_reasoning false: still split, the reasoning then left out)
    prompt_tail = (await tok.decode(ids[state.tail_start(ids):])
                   if fmt is not None and tok.has_tokenizer else "")
    if (fmt is not None and params.structured_outputs is not None
            and not state.structured_in_reasoning):  # the shape after the thinking
        try:
            params.structured_outputs.reasoning = structured_reasoning(fmt, prompt_tail)
        except ValueError as e:
            field = "tool_choice" if tools.structured is not None else structured_field(req)
            raise bad_request(str(e), field or "structured_outputs") from None
    if req.use_beam_search:  # the n best beams (server/beam.py), shaped as generated choices
        from flashpage.server.beam import beam_outputs, beam_params

        if images is not None:
            raise bad_request("use_beam_search with images is not supported", "use_beam_search")
        if tools.structured is not None:
            raise bad_request("a forced tool choice is not supported with use_beam_search",
                              "tool_choice")
        beams = beam_params(req, params.max_tokens or max_tokens)
        streams: list[RequestStream] = []

        def finals_of() -> Awaitable[list[RequestOutput]]:
            return beam_outputs(state, [ids], beams, arrival,
                                (req.top_logprobs or 0) if want_lp else None, model=req.model,
                                priority=req.priority)
    else:
        streams = await start(state, "chatcmpl", [ids], params, arrival,
                              "tools" if tools.structured is not None else structured_field(req),
                              model=req.model, priority=req.priority, cache_salt=req.cache_salt,
                              multi_modal_data=images)

        def finals_of() -> Awaitable[list[RequestOutput]]:
            return collect(streams)
    rid = f"chatcmpl-{uuid.uuid4().hex}"

    def splitter() -> Splitter | None:
        return make_splitter(fmt, prompt_tail) if fmt is not None else None

    if req.stream:
        calls_in: dict[int, ToolStream] = {}  # choice -> its text through the tool parser
        thinking: dict[int, Splitter | None] = {}  # choice -> its reasoning splitter

        def choice(idx: int, st: ChoiceState, delta: str, lps: list[Logprobs],
                   finish: str | None, out: RequestOutput) -> dict[str, Any]:
            rs = thinking.setdefault(idx, splitter())
            reasoning = ""
            if rs is not None:  # the thinking goes out as reasoning, the rest as content
                reasoning, delta = rs.feed(delta) if finish is None else rs.finish(delta)
            d: dict[str, Any] = {"content": delta}
            if tools.parser is not None:  # content up to a call, then the calls as they come
                ts = calls_in.setdefault(idx, ToolStream(tools.parser))
                calls: list[ToolCall] = []
                if finish is None:
                    text, deltas = ts.feed(delta)
                else:
                    rest, deltas, calls = ts.finish(delta)
                    text = rest or ""
                d = {"content": text or (None if deltas or calls else "")}
                if deltas:
                    d["tool_calls"] = deltas
                finish = finish_reason(finish, calls)
            if reasoning and req.include_reasoning:
                d = {"reasoning": reasoning, "reasoning_content": reasoning,
                     **{k: v for k, v in d.items() if v or k != "content"}}
            if not st.role_sent:  # the first chunk of each choice names the role
                st.role_sent = True
                d = {"role": "assistant", **d}
            return {"index": idx, "delta": d, "logprobs": chat_logprobs(tok, lps, want_lp),
                    "finish_reason": finish}

        return stream_response(state, streams, params.n, rid, "chat.completion.chunk", n_prompt,
                               bool(req.stream_options and req.stream_options.include_usage),
                               choice, model=req.model)

    async def answer() -> Response:
        out = (await finals_of())[0]
        choices: list[dict[str, Any]] = []
        for o in out.outputs:
            rs, reasoning, text = splitter(), None, o.text
            if rs is not None:
                reasoning, text = rs.split(o.text)
            content, calls = tools.parser.extract(text) if tools.parser is not None else (text, [])
            message = assistant_message(content, calls)
            if rs is not None and req.include_reasoning:
                message["reasoning"] = message["reasoning_content"] = reasoning
            choices.append({"index": o.index, "message": message,
                            "logprobs": chat_logprobs(tok, o.logprobs or [], want_lp),
                            "finish_reason": finish_reason(o.finish_reason, calls)})
        if req.prompt_logprobs is not None:
            for c in choices:
                c["prompt_logprobs"] = prompt_logprobs(tok, ids, out.prompt_logprobs)
        completion_tokens = sum(len(o.token_ids) for o in out.outputs)
        return JSONResponse({"id": rid, "object": "chat.completion", "created": int(time.time()),
                             "model": state.response_model(req.model), "choices": choices,
                             "usage": usage(n_prompt, completion_tokens)})

    return await unless_disconnected(request, answer())


async def _expanded_length(encoder: Any, ids: list[int], data: dict[str, Any]) -> int:
    """The prompt's length with its images' and videos' placeholders expanded: the encoder's
    own expansion (``prepare``, on a worker thread: the items are preprocessed already), so
    the usage and the length check count what the engine runs; a 400 naming a bad count."""
    def length() -> int:
        try:
            return len(encoder.prepare(list(ids), data)[0])
        except ValueError as e:
            raise bad_request(str(e), "messages") from None

    return await asyncio.get_running_loop().run_in_executor(None, length)


async def _images(state: ServerState, req: ChatCompletionRequest,
                  conv: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The request's images, videos or audios as the engine's multi_modal_data (their
    placeholders put into ``conv`` in place), or None without any; a 400 for a model that
    takes no images (videos, audio), a URL that cannot be read (engine/media.py), bytes that
    are no image / video / audio (server/images.py, engine/video_io.py, engine/audio_io.py),
    or mm_processor_kwargs the processor does not read or above the server's bounds."""
    from flashpage.engine.multimodal import as_text_parts, placeholder_ids, template_reads_parts
    from flashpage.server.images import (
        audio_parts,
        image_urls,
        read_audios,
        read_images,
        read_videos,
        video_urls,
        with_placeholders,
    )

    urls, vurls, aparts = image_urls(req.messages), video_urls(req.messages), audio_parts(req.messages)
    engine = state.engine.engine
    encoder = getattr(engine, "mm_encoder", None)
    vision = None  # vLLM's per-request processor settings: the images resized under them
    if req.mm_processor_kwargs is not None:
        from flashpage.config import request_mm_processing

        try:
            vision = request_mm_processing(engine.model_config, req.mm_processor_kwargs,
                                           (["image"] if urls else []) + (["video"] if vurls else []))
        except ValueError as e:
            raise bad_request(str(e), "mm_processor_kwargs") from None
    if not urls and not vurls and not aparts:
        tok = engine.tokenizer
        if encoder is not None and tok is not None and template_reads_parts(tok.chat_template):
            conv[:] = as_text_parts(conv)  # an image model's template reads parts (llava-hf's)
        return None
    mc = getattr(engine, "model_config", None)
    name = getattr(mc, "multimodal_architecture", "") or getattr(mc, "architecture", "this model")
    takes_audio = getattr(encoder, "modality", "image") == "audio"
    if encoder is None or (aparts and not takes_audio):
        what = "image_url" if urls else "video_url" if vurls else aparts[0].type
        kind = "audio" if what in ("audio_url", "input_audio") else what[:5]
        raise bad_request(f"{what} content parts given, but this model ({name}) takes no "
                          f"{kind} input (docs/features.md lists the families that do)", "messages")
    if takes_audio and (urls or vurls):
        raise bad_request(f"{'image_url' if urls else 'video_url'} content parts given, but this model "
                          f"({name}) takes audio alone", "messages")
    policy = engine.config.media_policy
    tok = engine.tokenizer
    template = getattr(tok, "chat_template", None)
    if aparts:  # Qwen2-Audio: each part its template's audio part (server/images.py)
        audios = await read_audios(encoder, aparts, policy)
        conv[:] = with_placeholders(conv, req.messages, template if isinstance(template, str) else None, "",
                                    audio_placeholder=encoder.placeholder_text)
        return {"audio": audios}
    video_ids = getattr(encoder, "video_placeholder_ids", None)
    video_text = getattr(encoder, "video_placeholder_text", None)  # InternVL's <video>
    if vurls and video_ids is None and video_text is None:
        raise bad_request(f"video_url content parts given, but this model ({name}) takes no video "
                          "input (Qwen2-VL / Qwen2.5-VL / Qwen3-VL, LLaVA-OneVision, InternVL, SmolVLM2 and GLM-4.1V do)",
                          "messages")
    pixels = await read_images(encoder, urls, policy, vision) if urls else []
    videos = await read_videos(encoder, vurls, policy, vision) if vurls else []
    placeholder = tok.decode(placeholder_ids(encoder)) if tok is not None else "<image>"
    video_placeholder = tok.decode(video_ids) if tok is not None and video_ids is not None else video_text
    conv[:] = with_placeholders(conv, req.messages, template if isinstance(template, str) else None,
                                placeholder, video_placeholder)
    data: dict[str, Any] = {"image": pixels} if pixels else {}
    if videos:
        data["video"] = videos
        sample = getattr(encoder, "sample_videos", None)
        if sample is not None:  # SmolVLM2's do_sample_frames, before the frames' text is written
            try:
                data = sample(data, req.mm_processor_kwargs)
            except ValueError as e:
                raise bad_request(str(e), "messages") from None
    return data
