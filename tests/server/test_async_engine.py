"""AsyncEngine without HTTP: outputs as the offline engine's, errors surface, leaving
early aborts, a slow consumer gets merged steps."""

from __future__ import annotations

import asyncio
import time

import pytest

from flashpage import LLM, SamplingParams
from flashpage.server.async_engine import AsyncEngine
from tests.server.conftest import engine_kwargs

PROMPT = [5, 17, 99, 3, 200, 41]


@pytest.fixture(scope="module")
def aengine(tiny_model_dir):
    ae = AsyncEngine(LLM(str(tiny_model_dir), **engine_kwargs()).engine)
    ae.start()
    yield ae
    ae.shutdown()
    assert not ae.is_running


def blocks_used(ae: AsyncEngine) -> int:
    return asyncio.run(ae.stats())["kv_cache"].blocks_used


def test_generate_equals_offline(aengine, offline_llm):
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    exp = offline_llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]

    async def run():
        outs = [o async for o in aengine.generate("a", PROMPT, params)]
        return outs

    outs = asyncio.run(run())
    assert outs[-1].finished and all(not o.finished for o in outs[:-1])
    assert outs[-1].outputs[0].token_ids == exp.token_ids
    assert "".join(o.new_text[0] for o in outs) == exp.text
    assert blocks_used(aengine) == 0


def test_add_errors_surface_as_value_error(aengine):
    async def run():
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await aengine.add_request("bad", [1, 999], SamplingParams())
        with pytest.raises(ValueError, match="prompt is empty"):
            async for _ in aengine.generate("bad2", [], SamplingParams()):
                pass

    asyncio.run(run())
    assert blocks_used(aengine) == 0


def test_leaving_early_aborts_at_once(aengine):
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True, n=3)

    async def run():
        seen = 0
        async for _ in aengine.generate("early", PROMPT, params):
            seen += 1
            if seen == 2:
                break  # the async generator is closed: its finally aborts the request

    asyncio.run(run())
    deadline = time.monotonic() + 10
    while blocks_used(aengine) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert blocks_used(aengine) == 0
    assert not aengine.engine.has_unfinished_requests()

    async def cancelled():
        task = asyncio.ensure_future(_drain(aengine.generate("cancel", PROMPT, params)))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancelled())
    deadline = time.monotonic() + 10
    while blocks_used(aengine) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert blocks_used(aengine) == 0


async def _drain(gen):
    async for _ in gen:
        pass


def test_slow_consumer_gets_merged_steps(aengine, offline_llm):
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    exp = offline_llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]

    async def run():
        outs = []
        async for o in aengine.generate("slow", PROMPT, params):
            outs.append(o)
            # Block the event loop: the engine thread keeps stepping meanwhile.
            time.sleep(0.05)
        return outs

    outs = asyncio.run(run())
    assert len(outs) < 30  # several steps arrived as one
    assert "".join(o.new_text[0] for o in outs) == exp.text
    assert outs[-1].outputs[0].token_ids == exp.token_ids


class _DyingEngine:
    """An engine whose loop breaks after a moment, as a bad CUDA device did on the H200:
    a request queued meanwhile must fail, not wait forever."""

    device = None
    tokenizer = None

    def has_unfinished_requests(self) -> bool:
        time.sleep(0.5)
        raise RuntimeError("device lost")

    def abort_request(self, ids) -> None:
        pass


def test_dead_engine_thread_fails_requests_instead_of_hanging():
    from flashpage.server.async_engine import EngineDeadError

    ae = AsyncEngine(_DyingEngine())  # type: ignore[arg-type]
    ae.start()

    async def go():  # queued while the engine thread is about to die
        return await asyncio.wait_for(ae.add_request("x", [1, 2], SamplingParams()), 5)

    with pytest.raises(EngineDeadError, match="device lost"):
        asyncio.run(go())
    ae._thread.join(5)  # type: ignore[union-attr]
    assert not ae.is_running
    with pytest.raises(EngineDeadError):  # and later ones are refused at once
        asyncio.run(go())
