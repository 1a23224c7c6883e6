"""The server's own tokenizer handle: prompts and chat templates, off the event loop.

The engine thread decodes with the engine's tokenizer while requests are tokenized here;
a HF fast tokenizer is not safe to share between threads (encoding may reconfigure it),
so the server encodes with its own copy on one worker thread, one call at a time, and
renders logprob tokens with a third copy on the event loop thread.
"""

from __future__ import annotations

import asyncio
import copy
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import Any

from flashpage.server.protocol import bad_request


class ServerTokenizer:
    def __init__(self, tokenizer: Any | None) -> None:
        self._tok = copy.deepcopy(tokenizer) if tokenizer is not None else None
        # A second copy for token strings (logprobs), used on the event loop thread.
        self._dec = copy.deepcopy(tokenizer) if tokenizer is not None else None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="flashpage-tokenize")
        self.token_str = lru_cache(maxsize=1 << 16)(self._token_str)

    @property
    def has_tokenizer(self) -> bool:
        return self._tok is not None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._tok is None:
            raise bad_request("this model has no tokenizer: send the prompt as token ids", "prompt")
        return await self._run(self._encode, text, add_special_tokens)

    def _encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # Same call as LLMEngine.tokenize, so served and offline prompts are the same ids.
        assert self._tok is not None  # checked by encode()
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    async def encode_pair(self, text_1: str | list[int], text_2: str | list[int],
                          family: str) -> list[int]:
        """A cross-encoder's input for one pair (flashpage/encoder/engine.py's join_pair),
        on the tokenizer thread with this copy of the tokenizer."""
        from flashpage.encoder.engine import join_pair

        return await self._run(join_pair, self._tok, family, text_1, text_2)

    async def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Token ids -> text, special tokens kept (what /detokenize answers) unless skipped."""
        if self._tok is None:
            raise bad_request("this model has no tokenizer: nothing to detokenize with", "tokens")
        return await self._run(self._decode, ids, skip_special_tokens)

    def _decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        assert self._tok is not None  # checked by decode()
        return str(self._tok.decode(ids, skip_special_tokens=skip_special_tokens))

    async def apply_chat_template(self, conversation: list[dict[str, Any]],
                                  tools: list[dict[str, Any]] | None = None,
                                  **template_kw: Any) -> list[int]:
        """The conversation through the chat template (``tools``: OpenAI function definitions
        the template shows the model) -> prompt ids."""
        if self._tok is None or not getattr(self._tok, "chat_template", None):
            raise bad_request("this model has no chat template: use /v1/completions", "messages")
        return await self._run(self._chat, conversation, tools, template_kw)

    async def apply_chat_template_expanded(self, conversation: list[dict[str, Any]],
                                           expand: Any, tools: list[dict[str, Any]] | None = None,
                                           **template_kw: Any) -> list[int]:
        """The conversation through the chat template as text, ``expand``ed, then tokenized
        without added special tokens (InternVL's videos: each ``<video>`` written out as its
        frames' text before tokenizing, as LLM.chat and its processor do)."""
        if self._tok is None or not getattr(self._tok, "chat_template", None):
            raise bad_request("this model has no chat template: use /v1/completions", "messages")

        def run() -> list[int]:
            assert self._tok is not None
            kw = {"add_generation_prompt": True, **template_kw}
            try:
                text = self._tok.apply_chat_template(conversation, tools=tools, tokenize=False, **kw)
            except Exception as e:  # the template refused the conversation (roles, order, ...)
                raise bad_request(f"the chat template refused these messages: {e}", "messages") from None
            return list(self._tok.encode(expand(text), add_special_tokens=False))

        return await self._run(run)

    def _chat(self, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
              template_kw: dict[str, Any]) -> list[int]:
        """``template_kw``: add_generation_prompt (default True), continue_final_message and
        the request's chat_template_kwargs, as apply_chat_template takes them."""
        assert self._tok is not None  # checked by apply_chat_template()
        kw = {"add_generation_prompt": True, **template_kw}
        try:
            ids = self._tok.apply_chat_template(conversation, tools=tools, tokenize=True,
                                                return_dict=False, **kw)
        except Exception as e:  # the template refused the conversation (roles, order, ...)
            raise bad_request(f"the chat template refused these messages: {e}", "messages") from None
        return list(ids)

    def _token_str(self, token_id: int) -> str:
        """The text of one token, as logprobs show it ("token_id:N" without a tokenizer)."""
        if self._dec is None:
            return f"token_id:{token_id}"
        return self._dec.decode([token_id], skip_special_tokens=False)


# apply_chat_template's own parameters: not for a request's chat_template_kwargs to set
_RESERVED = {"conversation", "tools", "documents", "chat_template", "tokenize", "return_dict",
             "return_tensors", "padding", "truncation", "max_length", "tokenizer_kwargs",
             "return_assistant_tokens_mask", "add_generation_prompt", "continue_final_message"}


def template_kwargs(req: Any) -> dict[str, Any]:
    """What the chat template is given beyond the messages and tools (a chat or /tokenize
    request's chat_template_kwargs, add_generation_prompt, continue_final_message,
    reasoning_effort); 400s naming the field."""
    extra = dict(req.chat_template_kwargs or {})
    bad = sorted(set(extra) & _RESERVED)
    if bad:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(bad)} (use the request's "
                          "own fields)", "chat_template_kwargs")
    effort = getattr(req, "reasoning_effort", None)
    if effort is not None:  # as vLLM gives it to the template
        if extra.get("reasoning_effort", effort) != effort:
            raise bad_request(f"reasoning_effort {effort!r} and chat_template_kwargs' "
                              f"{extra['reasoning_effort']!r} differ", "reasoning_effort")
        extra["reasoning_effort"] = effort
    if req.continue_final_message:
        if req.add_generation_prompt:
            raise bad_request("continue_final_message needs add_generation_prompt: false",
                              "continue_final_message")
        if req.messages[-1].role != "assistant":
            raise bad_request("continue_final_message needs the last message to be the "
                              "assistant's", "continue_final_message")
    return {**extra, "add_generation_prompt": req.add_generation_prompt,
            "continue_final_message": req.continue_final_message}
