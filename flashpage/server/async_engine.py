"""AsyncEngine: one LLMEngine driven by one thread, fed from asyncio.

The engine is not thread-safe, so every call into it (add, abort, step, stats) happens
on the engine thread. The asyncio side talks to that thread through a command queue and
gets each request's outputs back on its own asyncio.Queue::

    event loop (uvicorn)                         engine thread
    ───────────────────                          ─────────────
    add_request ── ("add", ..., future) ──►  ┐
    stream.abort ─ ("abort", id) ─────────►  ├ drain commands
    stats() ────── ("stats", future) ─────►  │
    call(fn) ───── ("call", fn, future) ──►  ┘
                                              step() while there is work, else sleep
    RequestStream._queue ◄── call_soon_threadsafe(put_nowait, RequestOutput)

A stream whose consumer goes away (client disconnect, CancelledError, GeneratorExit,
or the stream object being garbage-collected) aborts its request at once: the abort is
the next command the engine thread runs, between two steps, and it frees the request's
KV blocks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from flashpage.outputs import RequestOutput
from flashpage.sampling_params import SamplingParams

if TYPE_CHECKING:
    from flashpage.engine.llm_engine import LLMEngine
    from flashpage.lora.request import LoRARequest
    from flashpage.pooling import PoolingParams
    from flashpage.server.metrics import ServerMetrics

T = TypeVar("T")

logger = logging.getLogger("flashpage.server")


class EngineDeadError(RuntimeError):
    """The engine loop failed or was shut down; the request cannot complete."""


class RequestStream:
    """The outputs of one request, as an async iterator of RequestOutput deltas.

    Each item is the RequestOutput the engine produced in one step (``new_text[i]`` is
    the text choice ``i`` gained that step), or several consecutive steps merged when
    the consumer fell behind; the last one has ``finished=True``.
    Leaving the iteration early (or calling :meth:`abort`) aborts the request.
    """

    def __init__(self, engine: AsyncEngine, request_id: str) -> None:
        self._engine = engine
        self.request_id = request_id
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self.finished = False
        self._aborted = False
        self._pending: BaseException | None = None

    def _put(self, item: RequestOutput | BaseException) -> None:
        """Called from the engine thread."""
        with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody listens
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item: RequestOutput | BaseException
        if self._pending is not None:
            item, self._pending = self._pending, None
        else:
            try:
                item = await self._queue.get()
            except BaseException:  # cancelled while waiting: the consumer is gone
                self.abort()
                raise
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        # A consumer that fell behind gets the steps it missed as one output.
        while not item.finished and not self._queue.empty():
            nxt = self._queue.get_nowait()
            if isinstance(nxt, BaseException):
                self._pending = nxt
                break
            item = _merge(item, nxt)
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        """Abort the request unless it already finished (idempotent, never blocks)."""
        if not self.finished and not self._aborted:
            self._aborted = True
            self._engine._submit(("abort", self.request_id))

    def __del__(self) -> None:
        # Safety net: a stream dropped without being drained must not keep its blocks.
        with contextlib.suppress(Exception):
            self.abort()


class AsyncEngine:
    """Wraps one LLMEngine; start() launches the engine thread, shutdown() stops it."""

    def __init__(self, engine: LLMEngine, metrics: ServerMetrics | None = None,
                 idle_wait_s: float = 1.0) -> None:
        self.engine = engine
        self.metrics = metrics
        self._idle_wait_s = idle_wait_s
        self._commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self.dead: BaseException | None = None
        self._compiler: concurrent.futures.ThreadPoolExecutor | None = None  # compile_guide's
        self.log_requests = False  # --enable-log-requests (server/request_log.py)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="flashpage-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort every request, stop the engine thread and wait for it."""
        if self._thread is None:
            return
        self._submit(("shutdown",))
        self._thread.join(timeout)
        self._thread = None
        if self._compiler is not None:
            self._compiler.shutdown(wait=False, cancel_futures=True)
            self._compiler = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead is None

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.engine.model_config.hidden_size

    # ------------------------------------------------------------------ asyncio side
    def check_priority(self, priority: object) -> None:
        """The engine's ValueError for a priority it does not take (reads only its config)."""
        self.engine.check_priority(priority)

    async def add_request(self, request_id: str, prompt: str | list[int],
                          params: SamplingParams | PoolingParams, arrival_time: float | None = None,
                          lora_request: LoRARequest | None = None,
                          priority: int = 0, cache_salt: str | None = None,
                          multi_modal_data: Any = None) -> RequestStream:
        """Queue a request (``lora_request``: the adapter it runs with; ``priority``: for the
        priority scheduling policy; ``multi_modal_data``: its images, engine/multimodal.py);
        raises ValueError (the engine's message) if it cannot run."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        if self.log_requests:
            from flashpage.server.request_log import log_arrival

            log_arrival(request_id, prompt, params)
        stream = RequestStream(self, request_id)
        fut: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._submit(("add", request_id, prompt, params, arrival_time, lora_request, priority,
                      cache_salt, multi_modal_data, stream, fut))
        try:
            await asyncio.wrap_future(fut)
        except ValueError:
            stream.finished = True  # never added: nothing to abort
            raise
        except BaseException:
            stream.abort()  # cancelled while queued: the add (if it ran) is undone
            raise
        return stream

    async def compile_guide(self, params: SamplingParams) -> None:
        """Compile a structured-outputs spec on a worker thread, ahead of add_request (which
        then finds it in the engine's cache): not on the engine thread, between everyone's
        steps. Raises the engine's StructuredOutputsError for a bad spec."""
        if params.structured_outputs is None:
            return
        if self._compiler is None:
            self._compiler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="flashpage-guides")
        await asyncio.get_running_loop().run_in_executor(self._compiler, self.engine.compile_guide, params)

    async def generate(self, request_id: str, prompt: str | list[int],
                       params: SamplingParams | PoolingParams, arrival_time: float | None = None,
                       lora_request: LoRARequest | None = None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """add_request, then yield the request's outputs; leaving early aborts it."""
        stream = await self.add_request(request_id, prompt, params, arrival_time, lora_request,
                                        priority)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    async def stats(self) -> dict[str, Any]:
        """engine.stats(), taken on the engine thread between two steps."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        fut: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
        self._submit(("stats", fut))
        return await asyncio.wrap_future(fut)

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """fn(engine) on the engine thread between two steps (as stats); its exception
        comes back here."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._submit(("call", fn, fut))
        return await asyncio.wrap_future(fut)

    def _submit(self, cmd: tuple[Any, ...]) -> None:
        self._commands.put(cmd)
        self._wake.set()

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # never leave clients waiting on a dead thread
            logger.exception("engine thread died")
            self._stop = True
            error = EngineDeadError(f"engine thread died: {e}")
            self._fail_all(error)
            while True:  # commands queued before the death: fail their futures
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    break
                fut = cmd[-1] if cmd[0] in ("add", "call") else cmd[1] if cmd[0] == "stats" else None
                if isinstance(fut, concurrent.futures.Future) and fut.set_running_or_notify_cancel():
                    fut.set_exception(error)

    def _loop(self) -> None:
        engine = self.engine
        device = getattr(engine, "device", None)
        if device is not None and device.type == "cuda":
            import torch

            # The current CUDA device is per thread; this one must run on the engine's.
            index = device.index if device.index is not None else torch.cuda.current_device()
            torch.cuda.set_device(index)
        while not self._stop:
            self._drain_commands()
            if self._stop:
                break
            if engine.has_unfinished_requests():
                try:
                    outputs = engine.step()
                except Exception as e:  # a bug or a device error: fail what runs, keep serving
                    logger.exception("engine step failed; aborting %d requests", len(self._streams))
                    self._fail_all(EngineDeadError(f"engine step failed: {e}"))
                    continue
                self._deliver(outputs)
            else:
                self._wake.wait(self._idle_wait_s)
                self._wake.clear()
        self._fail_all(EngineDeadError("the server is shutting down"))

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            kind = cmd[0]
            if kind == "add":
                self._do_add(*cmd[1:])
            elif kind == "abort":
                self._do_abort(cmd[1])
            elif kind == "stats":
                fut = cmd[1]
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(self.engine.stats())
                    except Exception as e:
                        fut.set_exception(e)
            elif kind == "call":
                fn, fut = cmd[1], cmd[2]
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn(self.engine))
                    except Exception as e:
                        fut.set_exception(e)
            elif kind == "shutdown":
                self._stop = True

    def _do_add(self, request_id: str, prompt: str | list[int], params: SamplingParams | PoolingParams,
                arrival_time: float | None, lora_request: LoRARequest | None, priority: int,
                cache_salt: str | None, multi_modal_data: Any, stream: RequestStream,
                fut: concurrent.futures.Future[None]) -> None:
        if not fut.set_running_or_notify_cancel():
            return  # the caller gave up before we got here
        try:
            mm = {"multi_modal_data": multi_modal_data} if multi_modal_data is not None else {}
            self.engine.add_request(request_id, prompt, params, arrival_time, lora_request,
                                    priority=priority, cache_salt=cache_salt, **mm)
        except ValueError as e:
            fut.set_exception(e)
            return
        except Exception as e:  # anything else is our bug, but must not kill the loop
            logger.exception("add_request failed")
            fut.set_exception(EngineDeadError(f"could not add the request: {e}"))
            return
        self._streams[request_id] = stream
        if self.metrics is not None:
            self.metrics.on_added(request_id, getattr(params, "n", 1))  # an embedding: one
        fut.set_result(None)

    def _do_abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is None:
            return  # finished (or never added) meanwhile
        self.engine.abort_request(request_id)
        if self.metrics is not None:
            self.metrics.on_aborted(request_id)
        if self.log_requests:
            from flashpage.server.request_log import logger

            logger.info("request %s finished: finish_reason=abort (client gone or cancelled)",
                        request_id)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        batches: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
        for out in outputs:
            if self.metrics is not None:
                self.metrics.on_output(out, now)
            stream = self._streams.get(out.request_id)
            if out.finished:
                self._streams.pop(out.request_id, None)
                if self.log_requests:
                    from flashpage.server.request_log import log_finish

                    log_finish(out)
            if stream is not None:
                batches.setdefault(stream._loop, []).append((stream, out))
        # One wake-up of each event loop per step, not one per request.
        for loop, items in batches.items():
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody listens
                loop.call_soon_threadsafe(_dispatch, items)

    def _fail_all(self, error: BaseException) -> None:
        if self._stop:  # shutting down: refuse new requests (a failed step does not)
            self.dead = error
        ids = list(self._streams)
        for rid, stream in self._streams.items():
            stream._put(error)
            if self.metrics is not None:
                self.metrics.on_aborted(rid)
        self._streams.clear()
        with contextlib.suppress(Exception):
            self.engine.abort_request(ids)


def _merge(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Two consecutive outputs of one request as one: b's state (outputs carry the whole
    text, token ids and logprobs so far), with the text deltas of both."""
    new_text = [x + y for x, y in zip(a.new_text, b.new_text, strict=True)]
    return dataclasses.replace(b, new_text=new_text)


def _dispatch(items: list[tuple[RequestStream, RequestOutput]]) -> None:
    """On the event loop: hand one step's outputs to their streams."""
    for stream, out in items:
        stream._queue.put_nowait(out)
