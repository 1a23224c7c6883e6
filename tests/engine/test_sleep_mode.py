"""Sleep mode and in-place weight updates (engine/sleep.py, vLLM's enable_sleep_mode as RLHF
frameworks drive it): sleep(1) + wake_up() and sleep(2) + wake_up() + reload_weights() give
the same greedy tokens; load_weights with a second checkpoint's tensors gives that
checkpoint's tokens; while asleep the released storages hold no bytes; misuse is an error
naming the fix, and no KV block leaks. The GPU test checks the memory really goes back to
the allocator and comes back, CUDA graphs included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flashpage import LLM, SamplingParams
from flashpage.engine.sleep import EngineBusyError, EngineSleepingError
from flashpage.models.loader import iter_safetensors
from tests.conftest import build_tiny_checkpoint, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
# a 20-token prompt: two full blocks of 8, cached by the prefix cache
PROMPTS = random_prompts(4, 6, 20, seed=3) + [list(range(3, 23))]
KW = dict(dtype="float32", device="cpu", max_model_len=128, block_size=8, max_num_seqs=8,
          max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    """Two tiny GQA Llamas with tied embeddings (stacked qkv_proj and gate_up_proj, a
    shared LM head), the same shapes, different random weights."""
    root = tmp_path_factory.mktemp("sleep_ckpts")
    return (build_tiny_checkpoint(root / "a", "tied", seed=0),
            build_tiny_checkpoint(root / "b", "tied", seed=1))


def _ids(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def _weight_bytes(llm: LLM) -> int:
    return sum(s.nbytes() for s in llm.engine.sleep_state.weights.storages)


def _param_bytes(llm: LLM) -> int:
    return sum(p.untyped_storage().nbytes() for p in llm.engine.model.parameters())


def _kv_tensors(llm: LLM) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for c in llm.engine.runner.kv_caches:
        out.extend(c if isinstance(c, tuple) else (c,))
    return out


def test_sleep_level1_round_trip(checkpoints):
    llm = LLM(str(checkpoints[0]), enable_sleep_mode=True, **KW)
    engine = llm.engine
    want = _ids(llm)
    again = llm.generate(PROMPTS[-1:], GREEDY, use_tqdm=False)[0]
    assert again.metrics.num_cached_tokens == 16  # the prefix cache holds the long prompt's 2 blocks
    kv = _kv_tensors(llm)
    params = dict(engine.model.named_parameters())
    ptrs = {n: p.data_ptr() for n, p in params.items()}
    weight_bytes, kv_bytes = _weight_bytes(llm), sum(t.untyped_storage().nbytes() for t in kv)
    assert weight_bytes > 0 and kv_bytes > 0
    assert not llm.is_sleeping()

    llm.sleep(level=1)
    assert llm.is_sleeping()
    # nothing left in the storages: no KV cache, no weights (their bytes on the host)
    assert all(t.untyped_storage().nbytes() == 0 for t in kv)
    assert _weight_bytes(llm) == 0 and _param_bytes(llm) == 0
    host = engine.sleep_state.weights.host
    assert sum(h.numel() for h in host if h is not None) == weight_bytes
    assert not engine.kv_manager.pool.cached  # the prefix cache is reset
    with pytest.raises(EngineSleepingError, match=r"call wake_up\(\) before generating"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert not engine.has_unfinished_requests()

    llm.wake_up()
    assert not llm.is_sleeping()
    # the same tensor objects hold their storages again (the layers' caches are these)
    assert [t.untyped_storage().nbytes() for t in _kv_tensors(llm)] == [t.untyped_storage().nbytes() for t in kv]
    assert all(a is b for a, b in zip(_kv_tensors(llm), kv, strict=True))
    assert all(float(t.abs().sum()) == 0.0 for t in kv)  # zeroed: the old contents are gone
    assert dict(engine.model.named_parameters()) == params and _weight_bytes(llm) == weight_bytes
    assert ptrs  # (addresses may move: the engine captures CUDA graphs again on wake_up)
    out = llm.generate(PROMPTS[-1:], GREEDY, use_tqdm=False)[0]
    assert out.metrics.num_cached_tokens == 0  # nothing was cached across the sleep
    assert _ids(llm) == want
    assert engine.kv_manager.num_free_blocks == engine.num_blocks  # no block leaked
    # and a second round
    llm.sleep(1)
    llm.wake_up()
    assert _ids(llm) == want


def test_sleep_level2_then_reload(checkpoints):
    llm = LLM(str(checkpoints[0]), enable_sleep_mode=True, **KW)
    engine = llm.engine
    want = _ids(llm)
    buffer_bytes = sum(b.untyped_storage().nbytes() for b in engine.model.buffers())
    llm.sleep(level=2)
    assert _param_bytes(llm) == 0 and _weight_bytes(llm) == 0
    # only the buffers (rotary tables) are kept on the host: no copy of the parameters
    kept = sum(h.numel() for h in engine.sleep_state.weights.host if h is not None)
    assert kept == buffer_bytes > 0
    with pytest.raises(EngineSleepingError, match="asleep"):
        llm.reload_weights()  # the weights' storage is not there to write into
    llm.wake_up(tags=["weights"])
    assert llm.is_sleeping()  # the KV cache still sleeps
    with pytest.raises(EngineSleepingError, match=r"wake_up\(tags=\['kv_cache'\]\)"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.reload_weights()
    llm.wake_up(tags=["kv_cache"])
    assert not llm.is_sleeping()
    assert _ids(llm) == want
    assert engine.kv_manager.num_free_blocks == engine.num_blocks


def test_level2_without_a_load_is_refused(checkpoints):
    llm = LLM(str(checkpoints[0]), enable_sleep_mode=True, **KW)
    llm.sleep(2)
    llm.wake_up()
    # the discarded parameters come back as zeros (never stale memory); buffers as they were
    assert all(float(p.detach().abs().sum()) == 0.0 for p in llm.engine.model.parameters())
    assert any(float(b.abs().sum()) > 0 for b in llm.engine.model.buffers())
    with pytest.raises(EngineSleepingError, match=r"discarded by sleep\(level=2\).*reload_weights"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    # a level-1 sleep in between does not make the discarded weights valid
    llm.sleep(1)
    llm.wake_up()
    with pytest.raises(EngineSleepingError, match="discarded"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)


def test_load_weights_switches_to_the_second_checkpoint(checkpoints):
    """An RLHF update: wake the weights alone, load the trainer's tensors (HF names: q_proj /
    k_proj / v_proj into qkv_proj, gate/up into gate_up_proj, in two calls), wake the KV
    cache: the tokens are those of an engine built from the second checkpoint."""
    first, second = checkpoints
    want_b = _ids(LLM(str(second), **KW))
    llm = LLM(str(first), enable_sleep_mode=True, **KW)
    want_a = _ids(llm)
    assert want_a != want_b
    llm.sleep(2)
    llm.wake_up(tags=["weights"])
    tensors = list(iter_safetensors(str(second)))
    names = [n for n, _ in tensors]
    assert any(n.endswith("q_proj.weight") for n in names) and any(n.endswith("up_proj.weight") for n in names)
    loaded = llm.load_weights(iter(tensors[: len(tensors) // 2]))
    loaded |= llm.load_weights(tensors[len(tensors) // 2:])
    assert loaded and all("." in n for n in loaded)
    llm.wake_up(tags=["kv_cache"])
    assert _ids(llm) == want_b
    # back to the first: reload_weights reads it from disk (no sleep needed for an update)
    llm.reload_weights()
    assert _ids(llm) == want_a


def test_load_weights_resets_the_prefix_cache(checkpoints):
    first, second = checkpoints
    want_b = _ids(LLM(str(second), **KW), PROMPTS[-1:])
    llm = LLM(str(first), **KW)  # load_weights needs no sleep mode
    _ids(llm, PROMPTS[-1:])
    assert llm.engine.kv_manager.pool.cached
    llm.load_weights(iter_safetensors(str(second)))
    assert not llm.engine.kv_manager.pool.cached
    out = llm.generate(PROMPTS[-1:], GREEDY, use_tqdm=False)[0]
    assert out.metrics.num_cached_tokens == 0 and [list(out.outputs[0].token_ids)] == want_b


def test_load_weights_errors_name_the_parameter(checkpoints):
    llm = LLM(str(checkpoints[0]), **KW)
    want = _ids(llm)
    q = dict(iter_safetensors(str(checkpoints[1])))["model.layers.0.self_attn.q_proj.weight"]
    with pytest.raises(ValueError, match="model.layers.0.self_attn.nonsense.weight"):
        llm.load_weights([("model.layers.0.self_attn.nonsense.weight", q)])
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.q_proj.weight.*shape \(64, 32\)"):
        llm.load_weights([("model.layers.0.self_attn.q_proj.weight", q[:, :32])])
    with pytest.raises(ValueError, match="model.norm.weight.*checkpoint shape"):
        llm.load_weights([("model.norm.weight", torch.ones(3))])
    with pytest.raises(ValueError, match="item 0 is not a"):
        llm.load_weights([q])
    assert _ids(llm) == want  # nothing was written by the refused calls


def test_misuse_is_named(checkpoints):
    off = LLM(str(checkpoints[0]), **KW)
    with pytest.raises(ValueError, match="sleep mode is off.*enable_sleep_mode=True"):
        off.sleep(1)
    with pytest.raises(ValueError, match="sleep mode is off"):
        off.wake_up()
    assert not off.is_sleeping()
    llm = LLM(str(checkpoints[0]), enable_sleep_mode=True, **KW)
    with pytest.raises(ValueError, match="sleep level must be 1"):
        llm.sleep(3)
    with pytest.raises(ValueError, match="unknown wake_up tag"):
        llm.wake_up(tags=["weight"])
    llm.wake_up()  # awake already: nothing to do
    # requests in flight: sleep, load_weights and reload_weights refuse, nothing changes
    llm.engine.add_request("r", PROMPTS[0], GREEDY)
    llm.engine.step()
    for call in (lambda: llm.sleep(1), llm.reload_weights,
                 lambda: llm.load_weights(iter_safetensors(str(checkpoints[1])))):
        with pytest.raises(EngineBusyError, match="1 request"):
            call()
    assert not llm.is_sleeping()
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_blocks
    llm.sleep(1)
    # while asleep the engine refuses requests one by one too (the server's path)
    with pytest.raises(EngineSleepingError, match="wake_up"):
        llm.engine.add_request("s", PROMPTS[0], GREEDY)
    with pytest.raises(EngineSleepingError, match=r"wake_up\(tags=\['weights'\]\)"):
        llm.load_weights([])
    assert not llm.engine.has_unfinished_requests()


def test_sleep_refuses_what_it_cannot_restore(checkpoints):
    with pytest.raises(ValueError, match="speculative_config is not supported"):
        LLM(str(checkpoints[0]), enable_sleep_mode=True,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2}, **KW)
    llm = LLM(str(checkpoints[0]), enable_sleep_mode=True, quantization="fp8", **KW)
    with pytest.raises(ValueError, match=r"level=2.*quantized at load.*use sleep\(level=1\)"):
        llm.sleep(2)
    with pytest.raises(ValueError, match="load_weights: the weights were quantized"):
        llm.load_weights([])
    want = _ids(llm)
    llm.sleep(1)  # level 1 keeps the quantized weights' bytes: fine
    llm.wake_up()
    assert _ids(llm) == want


def test_sliding_window_null_block_after_wake(tiny_checkpoint):
    """Mistral's window: block 0 is the never-written null block read as zeros; the KV
    cache comes back zeroed, so the tokens past the window still match."""
    llm = LLM(str(tiny_checkpoint("mistral_window")), enable_sleep_mode=True, **KW)
    prompts = random_prompts(3, 30, 50, seed=5)
    want = _ids(llm, prompts)
    llm.sleep(1)
    llm.wake_up()
    assert _ids(llm, prompts) == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fixed", [True, False])
def test_sleep_releases_gpu_memory(tiny_checkpoint, monkeypatch, fixed):
    """bf16 on the GPU with CUDA graphs (captured by default): sleep(1) gives back at least
    the weights' and the KV cache's bytes to the driver, wake_up takes them again, and the
    greedy tokens are the same, replayed from graphs: with fixed addresses (engine/cumem.py,
    the default) the very graphs captured at start-up, kept through the sleep; without,
    graphs captured again over the new addresses. Then sleep(2) + wake_up +
    reload_weights likewise, and nothing grows from one sleep to the next."""
    monkeypatch.setenv("FLASHPAGE_SLEEP_FIXED_ADDRESSES", "1" if fixed else "0")
    path = tiny_checkpoint("head64_gqa")
    llm = LLM(str(path), device="cuda", enable_sleep_mode=True, block_size=16, num_gpu_blocks=512,
              max_num_seqs=16, max_num_batched_tokens=256, max_model_len=256)
    engine = llm.engine
    state = engine.sleep_state
    assert state.keeps_graphs is fixed
    assert engine.runner.graphs is not None  # decode graphs captured on CUDA by default
    graph_ids = [id(g) for g in engine.runner.graphs.graphs.values()]
    prompts = random_prompts(6, 5, 60, seed=7)
    want = _ids(llm, prompts)
    torch.cuda.synchronize()
    need = state.nbytes("weights") + state.nbytes("kv_cache")
    free_awake = torch.cuda.mem_get_info()[0]
    before = torch.cuda.memory_allocated()
    llm.sleep(1)
    free_asleep, asleep = torch.cuda.mem_get_info()[0], torch.cuda.memory_allocated()
    if fixed:  # the pages back to the driver (torch's allocator still counts the pool's blocks)
        assert free_asleep - free_awake >= need, (free_awake, free_asleep, need)
    else:
        assert before - asleep >= need, (before, asleep, need)
    llm.wake_up()
    if fixed:
        assert free_asleep - torch.cuda.mem_get_info()[0] >= need
    else:
        assert torch.cuda.memory_allocated() - asleep >= need
        assert torch.cuda.mem_get_info()[0] < free_asleep  # empty_cache had given it to the driver
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.graphs
    assert ([id(g) for g in graphs.graphs.values()] == graph_ids) is fixed  # kept, or captured again
    del graphs  # a reference kept here would keep the graphs' memory pool past sleep(2)
    replays = []
    real = torch.cuda.CUDAGraph.replay

    def counting(g):
        replays.append(id(g))  # not g: the graph object holds its pool
        return real(g)

    torch.cuda.CUDAGraph.replay = counting  # type: ignore[method-assign]
    try:
        got = _ids(llm, prompts)
    finally:
        torch.cuda.CUDAGraph.replay = real  # type: ignore[method-assign]
    assert replays and got == want
    llm.sleep(2)
    # nothing grows from one sleep to the next (run 217: cuBLAS's workspaces, 32 MiB a
    # stream, stayed allocated through a sleep and one more came with each recapture)
    if fixed:
        assert torch.cuda.mem_get_info()[0] >= free_asleep - (4 << 20), (free_asleep, torch.cuda.mem_get_info()[0])
    else:
        assert torch.cuda.memory_allocated() <= asleep + (1 << 20), (asleep, torch.cuda.memory_allocated())
    llm.wake_up(tags=["weights"])
    llm.reload_weights()
    llm.wake_up(tags=["kv_cache"])
    assert _ids(llm, prompts) == want
    assert engine.kv_manager.num_free_blocks == engine.num_blocks
    if fixed:  # a third cycle, level 1 again: the graphs still the start-up's
        llm.sleep(1)
        llm.wake_up()
        assert _ids(llm, prompts) == want
        assert [id(g) for g in engine.runner.graphs.graphs.values()] == graph_ids


def test_level2_over_level1_drops_the_host_copy(checkpoints):
    """sleep(1) then sleep(2): the parameters' host copy goes (the buffers' stays), and the
    engine wants a load before generating, as after a plain level-2 sleep."""
    llm = LLM(str(checkpoints[0]), enable_sleep_mode=True, **KW)
    want = _ids(llm)
    llm.sleep(1)
    host = llm.engine.sleep_state.weights.host
    big = max(h.untyped_storage().nbytes() for h in host if h is not None)
    assert big == _weight_bytes_awake(llm)  # one host buffer for the whole group
    llm.sleep(2)
    kept = [h for h in llm.engine.sleep_state.weights.host if h is not None]
    buffer_bytes = sum(b.numel() * b.element_size() for b in llm.engine.model.buffers())
    assert sum(h.untyped_storage().nbytes() for h in kept) == buffer_bytes
    llm.wake_up()
    with pytest.raises(EngineSleepingError, match="discarded"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.reload_weights()
    assert _ids(llm) == want


def _weight_bytes_awake(llm: LLM) -> int:
    return sum(llm.engine.sleep_state.weights.sizes)


@pytest.mark.parametrize("how", ["reload", "load"])
def test_mla_moe_level2(tiny_mla_checkpoint, how):
    """DeepSeek-V3's shape: one MLA latent tensor a layer, routed experts fused per layer
    (each expert's HF gate/up/down merged by the loader), a correction-bias buffer: after
    sleep(2) the weights come back from disk, or from the checkpoint's tensors given to
    load_weights, with the same greedy tokens."""
    path = tiny_mla_checkpoint("deepseek_v3")
    llm = LLM(str(path), enable_sleep_mode=True, **KW)
    assert all(not isinstance(c, tuple) for c in llm.engine.runner.kv_caches)  # latents
    want = _ids(llm)
    llm.sleep(2)
    assert all(t.untyped_storage().nbytes() == 0 for t in _kv_tensors(llm))
    assert _param_bytes(llm) == 0
    llm.wake_up(tags=["weights"])
    if how == "reload":
        llm.reload_weights()
    else:
        tensors = list(iter_safetensors(str(path)))
        assert any(".experts.3." in n for n, _ in tensors)
        llm.load_weights(tensors)
    llm.wake_up(tags=["kv_cache"])
    assert _ids(llm) == want
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_blocks


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_gguf_reload(checkpoints, tmp_path, name):
    """A GGUF checkpoint's weights come back from the file (q/k un-permuted by its reader):
    Llama, and Gemma 2 (KV cache groups: two tensors of slots shared by windowed and full
    layers)."""
    pytest.importorskip("gguf")
    from tests.models.test_gguf_families import _build, convert

    src = checkpoints[0] if name == "llama" else _build(tmp_path / "hf", name)
    path = tmp_path / f"{name}.gguf"
    convert(src, path, name)
    llm = LLM(str(path), enable_sleep_mode=True, attention_backend="torch_native", **KW)
    if name == "gemma2":
        assert llm.engine.kv_layout is not None  # KV cache groups
    prompts = random_prompts(3, 20, 40, seed=9)
    want = _ids(llm, prompts)
    llm.sleep(2)
    llm.wake_up()
    llm.reload_weights()
    assert _ids(llm, prompts) == want
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.kv_manager.num_usable_blocks


def test_sleep_with_kv_offloading(checkpoints):
    """Sleep mode beside the host KV tier (engine/kv_offload.py): the tier's copies go
    through views of the same cache storages sleep releases and retakes, so after
    sleep(1) + wake_up() a prompt's blocks still travel to the host and back, and the
    tokens are the same; after load_weights nothing cached under the old weights (GPU or
    host) is reused."""
    kw = dict(KW, num_gpu_blocks=10, kv_offloading_size=0.001)
    llm = LLM(str(checkpoints[0]), enable_sleep_mode=True, **kw)
    long_prompt = PROMPTS[-1:]
    fillers = random_prompts(2, 40, 40, seed=11)

    def from_host() -> tuple[list[int], int]:
        llm.generate(long_prompt, GREEDY, use_tqdm=False)
        llm.generate(fillers, GREEDY, use_tqdm=False)  # the pool's blocks reused: stored to the host
        out = llm.generate(long_prompt, GREEDY, use_tqdm=False)[0]
        return list(out.outputs[0].token_ids), out.metrics.num_host_cached_tokens

    want, host = from_host()
    assert host == 16
    llm.sleep(level=1)
    llm.wake_up()
    got, host = from_host()
    assert (got, host) == (want, 16)
    free = llm.engine.kv_manager.pool.free_queue.num_free
    llm.load_weights(iter_safetensors(str(checkpoints[1])))
    out = llm.generate(long_prompt, GREEDY, use_tqdm=False)[0]
    assert out.metrics.num_cached_tokens == 0
    other = LLM(str(checkpoints[1]), **KW)
    assert list(out.outputs[0].token_ids) == _ids(other, long_prompt)[0]
    assert llm.engine.kv_manager.pool.free_queue.num_free == free
