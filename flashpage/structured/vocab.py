"""Each token's bytes, as the token adds them to the output text.

A guide walks tokens through a byte-level DFA, so it needs every token as the exact byte
string it contributes, partial UTF-8 sequences included. Read from the tokenizer's
decoder, without decoding token by token (which turns a partial character into U+FFFD):

- ``ByteLevel`` (GPT-2 style BPE; SmolLM2, Llama 3, Qwen): each character of the token
  stands for one byte through GPT-2's byte-to-character table;
- ``Metaspace`` and ``Replace`` (SentencePiece style): the replacement character is a
  space; with ``ByteFallback``, ``<0xAB>`` tokens are that byte;
- anything else: ``decode([id])``, and a token whose text is not whole characters is left
  out (it can never be generated under a guide).

Special tokens (and ids past the tokenizer's vocabulary) are None: a guide never allows
them; eos is allowed separately, where the pattern may end.
"""

from __future__ import annotations

import json
import re
from typing import Any

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def gpt2_byte_chars() -> dict[str, int]:
    """GPT-2's table, inverted: the printable stand-in character of each byte -> the byte.
    Printable Latin-1 bytes stand for themselves; the others (control characters, space,
    ...) take the characters from U+0100 on, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {chr(b): b for b in keep}
    extra = 0
    for b in range(256):
        if b not in keep:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def token_bytes(tokenizer: Any, vocab_size: int) -> list[bytes | None]:
    """``vocab_size`` entries: token id -> its bytes (None: never allowed by a guide)."""
    n = min(len(tokenizer), vocab_size)
    pieces = tokenizer.convert_ids_to_tokens(list(range(n)))
    special = set(getattr(tokenizer, "all_special_ids", ()))
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special |= {i for i, t in added.items() if getattr(t, "special", False)}
    to_bytes = _decoder(tokenizer)
    out: list[bytes | None] = [None] * vocab_size
    for i, piece in enumerate(pieces):
        if i in special or piece is None:
            continue
        b = to_bytes(i, piece)
        out[i] = b if b else None
    return out


def _decoder_config(tokenizer: Any) -> dict[str, Any] | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None) if backend is not None else None
    if decoder is None:
        return None
    try:
        return json.loads(decoder.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return None


def _decoder(tokenizer: Any) -> Any:
    """A function (id, token piece) -> bytes for this tokenizer's decoder."""
    cfg = _decoder_config(tokenizer)
    kind = cfg.get("type") if cfg else None
    if kind == "ByteLevel":
        table = gpt2_byte_chars()

        def byte_level(_: int, piece: str) -> bytes | None:
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
            return piece.encode("utf-8")  # an added token: its text as it is

        return byte_level
    steps = cfg.get("decoders", []) if kind == "Sequence" and cfg else [cfg] if cfg else []
    replace: list[tuple[str, str]] = []
    byte_fallback = False
    known = True
    for step in steps:
        t = step.get("type")
        if t == "Metaspace":
            replace.append((step.get("replacement", "\u2581"), " "))
        elif t == "Replace" and "String" in step.get("pattern", {}):
            replace.append((step["pattern"]["String"], step.get("content", "")))
        elif t == "ByteFallback":
            byte_fallback = True
        elif t not in ("Fuse", "Strip"):  # Strip only trims the start of a whole text
            known = False
    if not steps or not known:
        return lambda i, _: _standalone(tokenizer, i)

    def pieces(_: int, piece: str) -> bytes | None:
        if byte_fallback and (m := _BYTE_FALLBACK.fullmatch(piece)):
            return bytes([int(m.group(1), 16)])
        for old, new in replace:
            piece = piece.replace(old, new)
        return piece.encode("utf-8")

    return pieces


def _standalone(tokenizer: Any, i: int) -> bytes | None:
    text = tokenizer.decode([i])
    return None if "\ufffd" in text else text.encode("utf-8")
