"""Fixtures for the server tests: a tiny checkpoint with a tiny tokenizer, an offline LLM
on it, and a live server on loopback (uvicorn in a background thread)."""

from __future__ import annotations

import contextlib
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }} </s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)
_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a paged cache keeps the keys and values of every token in fixed size blocks",
    "hello world, how are you today? i am fine, thank you.",
    "system user assistant: the capital of france is paris",
    "one two three four five six seven eight nine ten",
    "THE QUICK BROWN FOX 0123456789 !?.,;:'\"()-",
]
MAX_MODEL_LEN = 128


def build_tiny_tokenizer(folder: Path, vocab_size: int = 256) -> None:
    """A word-piece-free BPE (Metaspace, so decoding restores spaces) with at most
    ``vocab_size`` tokens; ids 0-3 are <pad>, <s>, </s>, <unk> as in the tiny configs
    (bos 1, eos 2). Writes tokenizer.json and tokenizer_config.json with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer)
    assert tok.get_vocab_size() <= vocab_size
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_checkpoint, tmp_path_factory) -> Path:
    """llama2_mha (vocab 256, random weights) plus a tiny tokenizer, in its own folder."""
    src = tiny_checkpoint("llama2_mha")
    dst = tmp_path_factory.mktemp("tiny_with_tokenizer")
    for f in src.iterdir():
        shutil.copy(f, dst / f.name)
    build_tiny_tokenizer(dst)
    return dst


def engine_kwargs() -> dict:
    return dict(dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN, block_size=8,
                max_num_seqs=64, max_num_batched_tokens=1024)


@pytest.fixture(scope="session")
def offline_llm(tiny_model_dir):
    from flashpage import LLM

    return LLM(str(tiny_model_dir), **engine_kwargs())


@dataclass
class LiveServer:
    url: str  # http://127.0.0.1:PORT
    model: str
    api_key: str | None
    async_engine: object

    def get(self, path: str, **kw) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.get(self.url + path, headers=headers, timeout=30, **kw)

    def metrics(self) -> dict[str, float]:
        """/metrics as {sample name with labels: value} (Prometheus text format)."""
        r = self.get("/metrics")
        r.raise_for_status()
        out: dict[str, float] = {}
        for line in r.text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def wait_idle(self, timeout: float = 20.0) -> dict[str, float]:
        """Poll /metrics until no request runs or waits and no KV block is in use."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (m["flashpage:kv_cache_blocks_used"] == 0 and m["flashpage:num_requests_running"] == 0
                    and m["flashpage:num_requests_waiting"] == 0)
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.05)


@contextlib.contextmanager
def live_server(model_dir: Path, api_key: str | None = None, name: str = "tiny",
                engine_kw: dict | None = None, **app_kw) -> Iterator[LiveServer]:
    """A server on 127.0.0.1 (a free port) in a background thread; stopped on exit.

    Its engine schedules asynchronously, as it does on a GPU (the CPU default is
    synchronous), while ``offline_llm`` is synchronous: tests that compare the two
    check one against the other."""
    import uvicorn

    from flashpage import LLM
    from flashpage.server.api_server import build_app
    from flashpage.server.async_engine import AsyncEngine

    llm = LLM(str(model_dir), **{**engine_kwargs(), **(engine_kw or {})}, async_scheduling=True)
    async_engine = AsyncEngine(llm.engine)
    app = build_app(async_engine, name, api_key=api_key, **app_kw)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        yield LiveServer(f"http://127.0.0.1:{port}", name, api_key, async_engine)
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()
        assert not thread.is_alive(), "uvicorn did not stop"
        assert not async_engine.is_running, "the engine thread did not stop"


@pytest.fixture(scope="session")
def server(tiny_model_dir) -> Iterator[LiveServer]:
    with live_server(tiny_model_dir) as s:
        yield s
