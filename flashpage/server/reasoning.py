"""Reasoning parsers (vLLM's ``--reasoning-parser``): a reasoning model's thinking, written
between ``<think>`` and ``</think>``, answered apart from its content, as ``reasoning`` (and
``reasoning_content``, its older name) beside ``content`` in a chat message or delta.

Every format here writes ``<think> ... </think>`` and differs in where the thinking starts:

- ``deepseek_r1`` (DeepSeek-R1, its distills, QwQ): always thinking first, whether or not the
  model writes the opening tag (R1 often leaves it out; newer templates put it in the prompt);
  no ``</think>`` at all means the answer was cut off while thinking: all of it is reasoning.
- ``qwen3`` (Qwen3, Qwen3-Thinking), ``deepseek_v3`` (DeepSeek-V3.1 / 3.2, thinking when its
  template was asked to, ``chat_template_kwargs: {"thinking": true}``), ``glm45``: thinking
  only where the output opens with ``<think>`` or the prompt (the template) ends with it;
  else all content. (vLLM's qwen3 parser calls an unclosed ``<think>`` content when not
  streaming and reasoning when streaming; here both are reasoning, so a streamed answer always adds up
  to the non-streamed one.)
- ``openai_gptoss`` (GPT-OSS): no ``<think>`` at all; its harmony format's ``analysis``
  channel is the reasoning, the rest the content (server/harmony.py's HarmonySplitter, which
  passes messages addressed to tools on whole, for the ``openai`` tool-call parser).

``ReasoningSplitter`` (``make_splitter`` picks the format's) follows the text as it comes (``feed`` pieces, then ``finish``): each
piece becomes (reasoning, content) deltas, a tag split across pieces held back until it is
known; the non-streamed split is the same machine fed the whole text at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    implicit_start: bool  # thinking from the first token, opening tag or not
    # GPT-OSS's harmony channels instead of <think> tags (server/harmony.py); their markers
    # are special tokens the text must keep
    harmony: bool = False

    @property
    def keeps_special_tokens(self) -> bool:
        return self.harmony


REASONING_PARSERS = {
    "deepseek_r1": ReasoningFormat("deepseek_r1", True),
    "qwen3": ReasoningFormat("qwen3", False),
    "deepseek_v3": ReasoningFormat("deepseek_v3", False),
    "glm45": ReasoningFormat("glm45", False),
    "openai_gptoss": ReasoningFormat("openai_gptoss", False, harmony=True),
}


class Splitter(Protocol):
    """A choice's text -> (reasoning, content), streamed (``feed``, ``finish``) or whole."""

    saw_reasoning: bool

    def feed(self, piece: str) -> tuple[str, str]: ...

    def finish(self, piece: str = "") -> tuple[str, str]: ...

    def split(self, text: str) -> tuple[str | None, str]: ...


def make_splitter(fmt: ReasoningFormat, prompt_tail: str = "") -> Splitter:
    """The splitter of ``fmt`` for one choice, after a prompt ending in ``prompt_tail``."""
    if fmt.harmony:
        from flashpage.server.harmony import HarmonySplitter

        return HarmonySplitter(prompt_tail)
    return ReasoningSplitter(fmt, prompt_tail)


def get_reasoning_parser(name: str) -> ReasoningFormat:
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; known: "
                         f"{', '.join(sorted(REASONING_PARSERS))}") from None


def opens_thinking(fmt: ReasoningFormat, prompt_tail: str) -> bool:
    """Whether the output starts inside the thinking: the format's way, or a template that
    ended the prompt with ``<think>``."""
    return fmt.implicit_start or prompt_tail.rstrip().endswith(START)


def structured_reasoning(fmt: ReasoningFormat, prompt_tail: str) -> str:
    """StructuredOutputsParams.reasoning for this format and prompt: the pattern starts
    after the thinking (structured/reasoning_prefix.py; <think> formats only)."""
    if fmt.harmony:
        raise ValueError(f"structured outputs after {fmt.name}'s analysis channel are not "
                         "supported (start the server with --structured-outputs-in-reasoning "
                         "for a pattern over the whole harmony output)")
    return "first" if opens_thinking(fmt, prompt_tail) else "optional"


def _held(buf: str, tag: str) -> int:
    """Length of the longest end of ``buf`` that could begin ``tag``."""
    for n in range(min(len(buf), len(tag) - 1), 0, -1):
        if tag.startswith(buf[-n:]):
            return n
    return 0


class SplitterBase:
    """What every reasoning splitter shares: text arrives in pieces (``feed``, then
    ``finish``) into ``buf``; a subclass's ``_run`` takes out what it can place."""

    buf: str
    saw_reasoning: bool

    def _run(self, final: bool) -> tuple[str, str]:
        raise NotImplementedError

    def feed(self, piece: str) -> tuple[str, str]:
        """The (reasoning, content) text this piece adds."""
        self.buf += piece
        return self._run(final=False)

    def finish(self, piece: str = "") -> tuple[str, str]:
        """The last piece: everything held back goes out."""
        self.buf += piece
        return self._run(final=True)

    def split(self, text: str) -> tuple[str | None, str]:
        """A whole answer -> (reasoning or None, content)."""
        r, c = self.finish(text)
        return (r if self.saw_reasoning else None), c


class ReasoningSplitter(SplitterBase):
    """One choice's text -> reasoning and content. ``prompt_tail``: the end of the prompt as
    text (a template that opens the thinking itself ends with ``<think>``)."""

    def __init__(self, fmt: ReasoningFormat, prompt_tail: str = "") -> None:
        # "open": expecting an optional <think> then thinking; "maybe": thinking only if
        # the output opens with <think>; "think"; "content"
        self.state = "open" if opens_thinking(fmt, prompt_tail) else "maybe"
        self.buf = ""
        self.saw_reasoning = False

    def _run(self, final: bool) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            buf = self.buf
            if self.state in ("open", "maybe"):
                body = buf.lstrip()
                if body.startswith(START):
                    self.buf, self.state = body[len(START):], "think"
                    self.saw_reasoning = True
                    continue
                if (START.startswith(body) and not final) or not body and not final:
                    return "".join(reasoning), "".join(content)  # could still open
                self.state = "think" if self.state == "open" else "content"
                self.saw_reasoning |= self.state == "think"
                continue
            if self.state == "think":
                at = buf.find(END)
                if at >= 0:
                    reasoning.append(buf[:at])
                    self.buf, self.state = buf[at + len(END):], "content"
                    continue
                keep = 0 if final else _held(buf, END)
                reasoning.append(buf[:len(buf) - keep])
                self.buf = buf[len(buf) - keep:]
                return "".join(reasoning), "".join(content)
            content.append(buf)  # content: as it comes
            self.buf = ""
            return "".join(reasoning), "".join(content)
