"""GPT-OSS's "harmony" response format, read as text (vLLM's ``--reasoning-parser
openai_gptoss``; its calls: server/harmony_calls.py, ``--tool-call-parser openai``).

GPT-OSS answers in messages, each a header, ``<|message|>``, a body and an end token::

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

(the prompt ends with ``<|start|>assistant``, so the first message's header is only its
channel; a recipient ``to=...`` may also stand before ``<|channel|>``:
``<|start|>assistant to=functions.f<|channel|>commentary json<|message|>``). The channels:
``analysis`` (the thinking), ``commentary`` (calls to functions, and preambles: what the
model says before calling) and ``final`` (the answer). A turn ends at ``<|return|>`` (after
the final answer) or ``<|call|>`` (after a call), both stop tokens; ``<|end|>`` ends a message
within the turn.

All of these are special tokens: the request's text must keep them, so a format here turns
``skip_special_tokens`` off for its requests (``keeps_special_tokens``), as vLLM does for
harmony. The reading is of text, not of token ids: a body that spells a marker out in
ordinary tokens reads as that marker.

``HarmonySplitter`` (the ``openai_gptoss`` reasoning parser) follows the text as it comes and
splits it into the chat message's reasoning and content:

- an ``analysis`` message with no recipient: its body is reasoning;
- a message with a recipient (``to=functions.NAME``, or a built-in tool's ``to=python``,
  ``to=browser.search``): passed on whole, ``<|start|>``, role, header, ``<|message|>``, body
  and end token as written (the first message's role, which the prompt wrote, restored as
  ``assistant``), for the tool-call parser to read (server/harmony_calls.py); without one,
  or for a recipient that is not a function, the client sees it as content;
- any other message (``final``, a ``commentary`` preamble, a channel harmony does not
  define): its body is content;
- text where a header should be that never becomes one (a model not writing harmony, text
  after an end token): content as written; a header cut off by the end of the answer (it
  follows ``<|start|>`` or holds ``<|channel|>``): nothing.

A marker cut across deltas is held back until it is known, so the streamed pieces always add
up to the non-streamed split (the same machine fed the whole text at once).
"""

from __future__ import annotations

from dataclasses import dataclass

from flashpage.server.reasoning import SplitterBase

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
ENDS = (END, CALL, RETURN)  # what ends a message's body
STOP_TOKENS = (RETURN, CALL)  # what ends the assistant's turn (stop tokens for gpt-oss)


@dataclass(frozen=True)
class Header:
    """A message's header: ``role`` (empty where the prompt wrote it), ``channel``,
    ``recipient`` (``functions.get_weather``, ``python``; None: the user) and
    ``content_type`` (``json``, ``<|constrain|>json``'s too; None if not given)."""

    role: str
    channel: str | None
    recipient: str | None
    content_type: str | None


def parse_header(text: str) -> Header:
    """A header's text (what stands between ``<|start|>`` and ``<|message|>``) -> Header:
    ``ROLE [to=R]<|channel|>CHANNEL [to=R] [[<|constrain|>]TYPE]``, any part missing."""
    before, _, after = text.partition(CHANNEL)
    role, recipient, channel, ctype = "", None, None, None
    for word in before.split():
        if word.startswith("to="):
            recipient = word[3:]
        elif not role:
            role = word
    for i, word in enumerate(after.replace(CONSTRAIN, " ").split()):
        if word.startswith("to="):
            recipient = word[3:]
        elif i == 0:
            channel = word
        else:
            ctype = word
    return Header(role, channel, recipient, ctype)


def held(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of ``text`` that could begin one of ``markers``."""
    for n in range(min(len(text), max(len(m) for m in markers) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0


def first_of(text: str, markers: tuple[str, ...], at: int = 0) -> tuple[int, str]:
    """The first of ``markers`` in ``text`` from ``at``: (index, marker), (-1, "") if none."""
    best, which = -1, ""
    for m in markers:
        i = text.find(m, at)
        if i >= 0 and (best < 0 or i < best):
            best, which = i, m
    return best, which


_BODY_ENDS = (*ENDS, START)  # a body also ends where a new message starts without an end token
_HEADER_ENDS = (MESSAGE, *_BODY_ENDS)


class HarmonySplitter(SplitterBase):
    """One choice's harmony text -> reasoning and content (``ReasoningSplitter``'s interface:
    ``feed``, ``finish``, ``split``). ``prompt_tail``: the end of the prompt as text, from
    its last ``<|start|>`` on (server/chat.py); a prompt that left a message's body open
    (``...<|channel|>final<|message|>The answer is``, continue_final_message) makes the
    output start in that body."""

    def __init__(self, prompt_tail: str = "") -> None:
        self.buf = ""
        self.saw_reasoning = False
        self.state = "header"  # "header" (reading one up to <|message|>) or "body"
        self.header = ""  # the header's text so far
        self.started = False  # it came after <|start|> (else its role is the prompt's)
        self.route = "content"  # the body's: "reasoning", "content" or "pass" (whole, for tools)
        at = prompt_tail.rfind(MESSAGE)
        if at >= 0 and first_of(prompt_tail, _BODY_ENDS, at)[0] < 0:  # the prompt's last body is open
            opened = prompt_tail[:at]
            self.started = START in opened
            self.header = opened.rsplit(START, 1)[-1]
            self._open()

    def _open(self) -> None:
        """The header read: where the body goes."""
        h = parse_header(self.header)
        if h.recipient is not None:
            self.route = "pass"
        elif h.channel == "analysis":
            self.route, self.saw_reasoning = "reasoning", True
        else:
            self.route = "content"
        self.state = "body"

    def _drop_header(self, content: list[str]) -> None:
        """A header that got no body: plain text (neither after <|start|> nor holding
        <|channel|>) is content."""
        if not self.started and CHANNEL not in self.header:
            content.append(self.header)
        self.header, self.started = "", False

    def _run(self, final: bool) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            buf = self.buf
            if self.state == "header":
                at, mark = first_of(buf, _HEADER_ENDS)
                if at < 0:
                    keep = 0 if final else held(buf, _HEADER_ENDS)
                    self.header += buf[:len(buf) - keep]
                    self.buf = buf[len(buf) - keep:]
                    if final:
                        self._drop_header(content)
                    break
                self.header += buf[:at]
                self.buf = buf[at + len(mark):]
                if mark == MESSAGE:
                    self._open()
                    if self.route == "pass":
                        role = "" if self.started else "assistant"
                        content.append(START + role + self.header + MESSAGE)
                    self.header, self.started = "", False
                else:  # a new message starts, or this one ended before its body
                    self._drop_header(content)
                    self.started = mark == START
                continue
            at, mark = first_of(buf, _BODY_ENDS)
            body = buf if at < 0 else buf[:at]
            keep = 0 if at >= 0 or final else held(buf, _BODY_ENDS)
            body = body[:len(body) - keep]
            (reasoning if self.route == "reasoning" else content).append(body)
            if at < 0:
                self.buf = buf[len(body):]
                break
            if self.route == "pass" and mark != START:
                content.append(mark)
            self.buf = buf[at + (0 if mark == START else len(mark)):]
            self.state = "header"
        return "".join(reasoning), "".join(content)
