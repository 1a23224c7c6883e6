"""Tokenizer loading and incremental detokenization.

The tokenizer comes from the model's own files: a HF folder's tokenizer files, or the
vocabulary and chat template stored in a GGUF file (converted by transformers).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from flashpage import envs
from flashpage.config import ConfigError
from flashpage.models.loader import ModelSource


def load_tokenizer(source: ModelSource, tokenizer: str | None = None,
                   trust_remote_code: bool = False) -> Any | None:
    """A HF tokenizer for the model, or None when it has none (token-id prompts only)."""
    if tokenizer is not None:
        return auto_tokenizer(tokenizer, trust_remote_code)
    if source.kind == "gguf" and source.path:
        from flashpage.models.gguf_config import open_gguf

        if "tokenizer.ggml.model" not in open_gguf(source.path).fields:
            return None  # weights only: prompts must be token ids
        return _gguf_tokenizer(source.path)
    if source.kind == "hf" and source.path:
        files = os.listdir(source.path)
        if any(f in files for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
            return auto_tokenizer(source.path, trust_remote_code)
    return None


def auto_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    """transformers' AutoTokenizer over a folder. A folder whose tokenizer is its own Python
    (tokenizer_config.json's ``auto_map``, as InternLM2's tokenization_internlm2.py) loads
    only with ``trust_remote_code``, vLLM's flag: that code then runs in this process.
    Without it the refusal names the class and both ways out. The flag is always passed as
    a bool: transformers would otherwise ask on a terminal, which a server cannot answer."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except ValueError as e:
        if trust_remote_code or "trust_remote_code" not in str(e):
            raise
        custom = _custom_tokenizer_class(path)
        raise ConfigError(
            f"the tokenizer of {path} is the checkpoint's own code ({custom}); flashpage runs it "
            "only when asked: --trust-remote-code (LLM(trust_remote_code=True)), or --tokenizer "
            "with a folder transformers reads without code") from None


def _custom_tokenizer_class(path: str) -> str:
    """tokenizer_config.json's auto_map entry for AutoTokenizer, as its text says it."""
    import json

    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            entry = json.load(f).get("auto_map", {}).get("AutoTokenizer")
    except (OSError, ValueError, AttributeError):
        return "tokenizer_config.json's auto_map"
    names = [n for n in (entry if isinstance(entry, list) else [entry]) if isinstance(n, str)]
    return "auto_map AutoTokenizer: " + " / ".join(names) if names else "tokenizer_config.json's auto_map"


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    With a fast tokenizer it uses the ``tokenizers`` library's ``DecodeStream`` (one step
    per token, ~1 us), seeded with the prompt's last tokens so the first word gets its
    leading space right. Otherwise it decodes a short window (a few tokens already shown,
    then the new ones) and holds back text ending in a partial UTF-8 character
    ("\ufffd") until the next token completes it.
    """

    def __init__(self, tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.text = ""
        self._stream: Any = None
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            try:
                from tokenizers.decoders import DecodeStream

                self._stream = DecodeStream(ids=list(prompt_ids[-6:]),
                                            skip_special_tokens=skip_special_tokens)
                self._backend = backend
            except (ImportError, TypeError):  # an older tokenizers: the window below
                self._stream = None
        self.ids: list[int] = list(prompt_ids[-6:])
        self.prefix_offset = max(len(self.ids) - 5, 0)
        self.read_offset = len(self.ids)

    def add(self, token_id: int) -> str:
        if self._stream is not None:
            delta = self._stream.step(self._backend, token_id) or ""
            self.text += delta
            return delta
        self.ids.append(token_id)
        dec = self.tokenizer.decode
        prefix = dec(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip)
        full = dec(self.ids[self.prefix_offset:], skip_special_tokens=self.skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""


def _gguf_tokenizer(path: str) -> Any:
    """The tokenizer stored in a GGUF file, converted once and kept under ~/.cache/flashpage
    (the conversion parses the whole vocabulary and takes seconds)."""
    import hashlib

    from transformers import AutoTokenizer

    st = os.stat(path)
    key = hashlib.sha256(f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cache = os.path.join(envs.cache_dir(), "tokenizers", key)
    if os.path.isfile(os.path.join(cache, "tokenizer.json")):
        try:
            return AutoTokenizer.from_pretrained(cache)
        except Exception:  # a damaged cache: convert again below
            pass
    folder, name = os.path.split(path)
    try:
        tok = AutoTokenizer.from_pretrained(folder or ".", gguf_file=name)
    except ValueError as e:
        if "is not supported yet" not in str(e):
            raise
        # AutoTokenizer reads the file's config to pick a class, and transformers reads the
        # GGUF configs of a few architectures only (not command-r, olmo2, granite, gemma,
        # ...); the vocabulary itself is built from tokenizer.ggml.model whatever the
        # architecture, which the generic fast tokenizer does
        from transformers import PreTrainedTokenizerFast

        tok = PreTrainedTokenizerFast.from_pretrained(folder or ".", gguf_file=name)
    with contextlib.suppress(OSError):  # read-only home: convert each time
        tok.save_pretrained(cache)
    return tok
