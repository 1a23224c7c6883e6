"""Request bodies of the OpenAI API as flashpage accepts them (pydantic), and the errors.

Field names are OpenAI's (plus vLLM's extras top_k, min_p, ignore_eos, ...). Unknown
fields are ignored, as OpenAI-compatible servers do. Numbers are strict: ``true`` is not
an integer, ``"1"`` is not a number, NaN and infinities are refused. Bounds that depend
on the model (max_tokens vs the context, logprobs vs the vocabulary, n vs the server's
limit) are checked by the handlers, which know the model.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError, model_validator
from pydantic_core import PydanticCustomError

Int = Annotated[int, Strict()]
Float = Annotated[float, Strict(), Field(allow_inf_nan=False)]
Str = Annotated[str, Strict()]
Bool = Annotated[bool, Strict()]
TokenIds = list[Int]

# Sampling seeds and top_k end up in torch tensors / generators: keep them in int64.
_I64 = 2**63 - 1
# the priority scheduling policy's (vLLM's) field on every request that runs on the engine:
# lower first; non-zero needs that policy (the handlers' check_priority)
Priority = Annotated[Int, Field(ge=-_I64 - 1, le=_I64)]


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, None)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class StreamOptions(_Body):
    include_usage: Bool = False


JSONValue = Str | dict[str, Any] | Bool  # a JSON schema: an object, its text, or true / false


class JSONSchemaFormat(_Body):
    """OpenAI's response_format.json_schema: the schema under ``schema`` (``strict`` and the
    name are accepted; the output always follows the schema)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: Str | None = None
    description: Str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: Bool | None = None


class ResponseFormat(_Body):
    """OpenAI's response_format: text (no constraint), json_object or json_schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsBody(_Body):
    """vLLM's (>= 0.10) structured_outputs: exactly one of json, regex, choice, json_object."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    json_: JSONValue | None = Field(default=None, alias="json")
    regex: Str | None = None
    choice: list[Str] | None = None
    grammar: Str | None = None
    json_object: Bool | None = None
    disable_any_whitespace: Bool = False
    whitespace_pattern: Str | None = None


class _SamplingFields(_Body):
    model: Str | None = None
    max_tokens: Int | None = Field(default=None, ge=1)
    temperature: Float | None = Field(default=None, ge=0.0)
    top_p: Float | None = Field(default=None, gt=0.0, le=1.0)
    n: Int = Field(default=1, ge=1)
    stop: Str | list[Str] | None = None
    seed: Int | None = Field(default=None, ge=-_I64 - 1, le=_I64)
    presence_penalty: Float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: Float | None = Field(default=None, ge=-2.0, le=2.0)
    stream: Bool | None = False
    stream_options: StreamOptions | None = None
    # token id (as a string, OpenAI's JSON keys) -> bias in [-100, 100] added to its logit
    logit_bias: dict[Str, Float] | None = None
    user: Any = None
    # vLLM's extras
    top_k: Int | None = Field(default=None, ge=-1, le=2**31 - 1)
    min_p: Float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: Float | None = Field(default=None, gt=0.0)
    ignore_eos: Bool | None = False
    min_tokens: Int | None = Field(default=None, ge=0)
    prompt_logprobs: Int | None = Field(default=None, ge=0, le=20)
    truncate_prompt_tokens: Int | None = Field(default=None, ge=1)
    allowed_token_ids: list[Int] | None = Field(default=None, min_length=1)
    bad_words: list[Str] | None = None
    include_stop_str_in_output: Bool | None = False
    skip_special_tokens: Bool | None = True
    priority: Priority = 0
    # vLLM's: prefix-cache blocks shared only among requests of the same salt
    cache_salt: Str | None = Field(default=None, min_length=1)
    # beam search (vLLM's): n beams, the n likeliest continuations (server/beam.py)
    use_beam_search: Bool | None = False
    length_penalty: Float | None = None
    # structured outputs: OpenAI's response_format, vLLM's guided_* (< 0.10) and
    # structured_outputs (>= 0.10); at most one of them
    response_format: ResponseFormat | None = None
    guided_json: JSONValue | None = None
    guided_regex: Str | None = None
    guided_choice: list[Str] | None = None
    guided_grammar: Str | None = None
    guided_whitespace_pattern: Str | None = None
    structured_outputs: StructuredOutputsBody | None = None


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. ``prompt``: text, texts, token ids, or lists of token ids;
    ``prompt_embeds`` (vLLM's): base64 of torch.save'd tensors, one or a list
    (server/prompt_embeds.py), run before the prompts when both are given."""

    prompt: Str | list[Str] | TokenIds | list[TokenIds] | None = None
    prompt_embeds: Str | list[Str] | None = None
    logprobs: Int | None = Field(default=None, ge=0, le=20)
    echo: Bool | None = False

    @model_validator(mode="after")
    def _some_prompt(self) -> CompletionRequest:
        if self.prompt is None and self.prompt_embeds is None:
            raise ValueError("one of prompt and prompt_embeds is required")
        return self


class TextPart(_Body):
    type: Literal["text"]
    text: Str


class ImageURL(_Body):
    url: Str
    detail: Str | None = None  # OpenAI's; LLaVA-1.5 sees one fixed size whatever it says


class ImagePart(_Body):
    """An image (server/images.py: data URLs only), for a model that takes images."""

    type: Literal["image_url"]
    image_url: ImageURL


class VideoURL(_Body):
    url: Str


class VideoPart(_Body):
    """A video file (server/images.py, engine/video_io.py), for a model that takes videos."""

    type: Literal["video_url"]
    video_url: VideoURL


class AudioURL(_Body):
    url: Str


class AudioURLPart(_Body):
    """An audio file by URL (server/images.py, engine/audio_io.py), for a model that takes
    audio (vLLM's audio_url part)."""

    type: Literal["audio_url"]
    audio_url: AudioURL


class InputAudio(_Body):
    data: Str  # the file's bytes, base64
    format: Str | None = None  # OpenAI's "wav" / "mp3": a hint, the bytes say what they are


class InputAudioPart(_Body):
    """An audio file inline (OpenAI's input_audio part), for a model that takes audio."""

    type: Literal["input_audio"]
    input_audio: InputAudio


class FunctionCall(_Body):
    name: Str
    arguments: Str  # a JSON object, as text (OpenAI's)


class ToolCallBody(_Body):
    """An assistant message's earlier tool call, sent back in the conversation."""

    id: Str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Str
    content: Str | list[TextPart | ImagePart | VideoPart | AudioURLPart | InputAudioPart] | None = None
    name: Str | None = None
    tool_calls: list[ToolCallBody] | None = None  # an assistant's calls
    tool_call_id: Str | None = None  # a tool message: the call it answers
    # an assistant's earlier thinking, as answers give it back (vLLM's two names)
    reasoning: Str | None = None
    reasoning_content: Str | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_parts_only(cls, data: Any) -> Any:
        """A content part other than text, image_url, video_url, audio_url and input_audio
        (file, ...) refused by its own type: no model served reads one. (The others:
        server/images.py; a model that takes no images / videos / audio refuses them there.)"""
        content = data.get("content") if isinstance(data, dict) else None
        for i, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "video":
                raise PydanticCustomError(
                    "content_part", "content.{i} has type 'video': the server reads a video as a "
                    "file, {\"type\": \"video_url\", \"video_url\": {\"url\": ...}} (its frames are "
                    "taken offline: LLM.chat's \"video\" parts, multi_modal_data[\"video\"])",
                    {"i": i})
            if isinstance(kind, str) and kind not in ("text", "image_url", "video_url", "audio_url",
                                                      "input_audio"):
                raise PydanticCustomError(
                    "content_part", "content.{i} has type '{kind}': only text, image_url, "
                    "video_url, audio_url and input_audio parts are supported (this server takes "
                    "no file input)", {"i": i, "kind": kind})
        return data

    def text(self) -> str:
        """The message's text parts, joined (its images: server/images.py)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if isinstance(p, TextPart))


class FunctionDef(_Body):
    name: Str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: Str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: Bool | None = None


class ToolDef(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: Str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    # tool calls (server/tools.py, server/tool_choice.py): OpenAI's
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: Bool | None = True
    max_completion_tokens: Int | None = Field(default=None, ge=1)
    # vLLM's: what the chat template is given (e.g. {"enable_thinking": false} for Qwen3,
    # {"thinking": true} for DeepSeek-V3.1), whether it opens the assistant's turn, or
    # continues the last (assistant) message instead
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False
    # vLLM's: with a reasoning parser, leave the reasoning out of the answer
    include_reasoning: Bool = True
    # OpenAI's: how hard a reasoning model thinks, given to the chat template as
    # ``reasoning_effort`` (GPT-OSS's template writes it in the system message)
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    logprobs: Bool | None = False
    top_logprobs: Int | None = Field(default=None, ge=0, le=20)
    # vLLM's: the image processor's settings for this request's images over the server's
    # --mm-processor-kwargs (Qwen2-VL's {"max_pixels": ...}; config.request_mm_processing)
    mm_processor_kwargs: dict[str, Any] | None = None


class EmbeddingRequest(_Body):
    """POST /v1/embeddings (OpenAI's): ``input`` a text, texts, token ids, or lists of ids."""

    model: Str | None = None
    input: Str | list[Str] | TokenIds | list[TokenIds]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int | None = Field(default=None, ge=1)
    user: Any = None
    truncate_prompt_tokens: Int | None = Field(default=None, ge=1)  # vLLM's
    priority: Priority = 0


class PoolingRequest(EmbeddingRequest):
    """POST /pooling (vLLM's): the embeddings request's fields; each input's pooled output
    (an embedding model's vector, a classifier's class probabilities)."""


class ScoreRequest(_Body):
    """POST /score, /v1/score (vLLM's): ``text_1`` one item and ``text_2`` several (each
    pair scored), or both the same length (pairwise); an item a text or token ids."""

    model: Str | None = None
    text_1: Str | list[Str] | TokenIds | list[TokenIds]
    text_2: Str | list[Str] | TokenIds | list[TokenIds]
    truncate_prompt_tokens: Int | None = Field(default=None, ge=1)
    priority: Priority = 0


class RerankRequest(_Body):
    """POST /rerank, /v1/rerank, /v2/rerank (vLLM's, Jina / Cohere shape): ``documents``
    ordered by relevance to ``query``; ``top_n`` (0 or none: all) of them."""

    model: Str | None = None
    query: Str
    documents: list[Str]
    top_n: Int | None = Field(default=None, ge=0)
    return_documents: Bool = True
    truncate_prompt_tokens: Int | None = Field(default=None, ge=1)
    priority: Priority = 0


class TokenizeRequest(_Body):
    """POST /tokenize (vLLM's): a text prompt, or chat messages through the chat template."""

    model: Str | None = None
    prompt: Str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolDef] | None = None  # messages only: shown to the chat template
    add_special_tokens: Bool = True  # prompt only (the chat template places its own)
    # messages only, as the chat endpoint takes them (vLLM's)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False
    reasoning_effort: Literal["low", "medium", "high"] | None = None


class DetokenizeRequest(_Body):
    """POST /detokenize (vLLM's): token ids back to text."""

    model: Str | None = None
    tokens: TokenIds


# Fields that take one of several shapes: one sentence beats pydantic's error per shape.
_SHAPES = {
    "prompt": "a string, a list of strings, a list of token ids or a list of lists of token ids",
    "stop": "a string or a list of strings",
    "content": 'a string or a list of {"type": "text", "text": ...}, {"type": "image_url", '
               '"image_url": {"url": "data:image/...;base64,..."}}, {"type": "video_url", '
               '"video_url": {"url": ...}}, {"type": "audio_url", "audio_url": {"url": ...}} and '
               '{"type": "input_audio", "input_audio": {"data": base64, "format": "wav"}} parts',
}


def validation_error(e: ValidationError) -> APIError:
    """The first pydantic error as a 400 naming the field."""
    errs = e.errors(include_url=False)
    if not errs:
        return bad_request("invalid request body")
    err = errs[0]
    path = [x for x in err.get("loc", ()) if not _is_type_tag(x)]
    loc = ".".join(str(x) for x in path)
    # The field itself, before any list index inside it (prompt.0.1 -> prompt).
    field = next((str(x) for x in reversed(path) if str(x) in _SHAPES), None)
    if field is not None:
        cut = max(i for i, x in enumerate(path) if str(x) == field)
        loc = ".".join(str(x) for x in path[: cut + 1])
        return bad_request(f"{loc} must be {_SHAPES[field]}", param=loc)
    msg = err.get("msg", "invalid value")
    more = f" (and {len(errs) - 1} more problems)" if len(errs) > 1 else ""
    return bad_request(f"{loc or 'body'}: {msg}{more}", param=loc or None)


def _is_type_tag(x: object) -> bool:
    # pydantic names the union member it tried ("str", "list[int]", ...) inside loc.
    return isinstance(x, str) and (x in ("str", "int", "float", "bool", "function-after")
                                   or x.startswith(("list[", "constrained-")))


class LoadLoRAAdapterRequest(_Body):
    """POST /v1/load_lora_adapter (vLLM's, with runtime LoRA updating on)."""

    lora_name: Str = Field(min_length=1)
    lora_path: Str = Field(min_length=1)


class UnloadLoRAAdapterRequest(_Body):
    """POST /v1/unload_lora_adapter (vLLM's)."""

    lora_name: Str = Field(min_length=1)
    lora_int_id: Int | None = None


class ClassifyRequest(_Body):
    """POST /classify (vLLM's): ``input`` a text, texts, token ids, or lists of ids."""

    model: Str | None = None
    input: Str | list[Str] | TokenIds | list[TokenIds]
    truncate_prompt_tokens: Int | None = Field(default=None, ge=1)
    priority: Priority = 0
    user: Any = None
