"""Prompts given as input embeddings (engine/prompt_embeds.py, vLLM's EmbedsPrompt): greedy
tokens equal the token prompt's and transformers' generate(inputs_embeds=...), through mixed
batches, chunked prefill, preemption, prefix caching and async scheduling; bad requests are
refused by name and cost nobody else anything."""

from __future__ import annotations

import pytest
import torch

from flashpage import LLM, SamplingParams
from flashpage.config import ConfigError
from flashpage.pooling import PoolingParams
from flashpage.sampling_params import BeamSearchParams
from tests.conftest import ok_tokens as _tokens
from tests.conftest import random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def hf_model(path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    return model


def embed_ids(model, ids: list[int]) -> torch.Tensor:
    """What transformers' model takes as inputs_embeds for ``ids``."""
    with torch.no_grad():
        return model.get_input_embeddings()(torch.tensor(ids)).detach().clone()


def hf_greedy_embeds(model, embeds: list[torch.Tensor], max_new_tokens: int = 12, **gen) -> list[list[int]]:
    outs = []
    with torch.no_grad():
        for e in embeds:
            mask = torch.ones(1, e.shape[0], dtype=torch.long)
            out = model.generate(inputs_embeds=e[None], attention_mask=mask, max_new_tokens=max_new_tokens,
                                 min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, **gen)
            outs.append(out[0].tolist())  # only the new tokens: there are no input ids
    return outs


def _llm(path, **kw) -> LLM:
    return LLM(str(path), **{"dtype": "float32", "device": "cpu", "block_size": 8,
                             "enable_prompt_embeds": True, **kw})


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    path = tiny_checkpoint("llama31_gqa")
    return path, hf_model(path)


def test_embeds_of_token_ids_equal_the_token_prompt_and_transformers(llama):
    path, hf = llama
    prompts = random_prompts(3, 5, 40, seed=1)
    embeds = [embed_ids(hf, p) for p in prompts]
    llm = _llm(path)
    by_ids = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    outs = llm.generate([{"prompt_embeds": e} for e in embeds], GREEDY, use_tqdm=False)
    assert _tokens(outs) == by_ids
    assert _tokens(outs) == hf_greedy_embeds(hf, embeds)
    assert all(o.prompt_token_ids == [] and o.prompt is None for o in outs)
    assert llm.engine.kv_manager.stats().blocks_used == 0


def test_random_embeddings_equal_transformers(llama):
    """Rows no token embeds to: the model's own rows nowhere, still transformers' tokens."""
    path, hf = llama
    scale = float(hf.get_input_embeddings().weight.detach().std())
    g = torch.Generator().manual_seed(3)
    embeds = [torch.randn(n, hf.config.hidden_size, generator=g) * scale for n in (7, 19, 33)]
    llm = _llm(path)
    outs = llm.generate([{"prompt_embeds": e} for e in embeds], GREEDY, use_tqdm=False)
    assert _tokens(outs) == hf_greedy_embeds(hf, embeds)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_mixed_batch_with_chunked_prefill(llama, monkeypatch, async_scheduling):
    """Embeds prompts, token prompts and text-free decodes in the same steps, prompts cut
    into chunks of a small budget: every request's tokens are its token prompt's."""
    path, hf = llama
    prompts = random_prompts(6, 9, 45, seed=4)
    plain = _tokens(_llm(path).generate(prompts, GREEDY, use_tqdm=False))
    llm = _llm(path, max_num_batched_tokens=16, async_scheduling=async_scheduling)
    seen: list[tuple[int, int]] = []  # (tokens, rows given as embeddings) of each forward
    model = llm.engine.model
    forward = model.forward

    def spy(input_ids, positions, md, inputs_embeds=None):
        seen.append((input_ids.shape[0], 0 if inputs_embeds is None else inputs_embeds.rows.shape[0]))
        return forward(input_ids, positions, md, inputs_embeds)

    monkeypatch.setattr(model, "forward", spy)
    mixed = [{"prompt_embeds": embed_ids(hf, p)} if i % 2 else p for i, p in enumerate(prompts)]
    assert _tokens(llm.generate(mixed, GREEDY, use_tqdm=False)) == plain
    assert any(0 < rows < n for n, rows in seen)  # a step of embeds rows beside token rows
    assert max(n for n, _ in seen) <= 16
    assert llm.engine.kv_manager.stats().blocks_used == 0


def test_preemption_recomputes_from_the_embeddings(llama):
    path, hf = llama
    prompts = random_prompts(6, 20, 30, seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = _tokens(_llm(path).generate(prompts, params, use_tqdm=False))
    llm = _llm(path, block_size=4, num_gpu_blocks=40, max_num_batched_tokens=32,
               enable_prefix_caching=False)
    free = llm.engine.kv_manager.num_free_blocks
    outs = llm.generate([{"prompt_embeds": embed_ids(hf, p)} for p in prompts], params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert _tokens(outs) == plain
    assert llm.engine.kv_manager.num_free_blocks == free


def test_prefix_cache_shares_only_identical_embeddings(llama):
    """The second of two identical embeds prompts hits all their full blocks; an embeds
    prompt never hits a token prompt's blocks (even of the same ids), nor those of an embeds
    prompt that differs in its last row; tokens equal throughout."""
    path, hf = llama
    ids = random_prompts(1, 41, 41, seed=8)[0]  # 5 full blocks of 8 + 1 token
    e = embed_ids(hf, ids)
    llm = _llm(path)
    kv = llm.engine.kv_manager
    first = _tokens(llm.generate([ids], GREEDY, use_tqdm=False))  # the token prompt's blocks cached
    hits = kv.prefix_hits
    assert _tokens(llm.generate([{"prompt_embeds": e}], GREEDY, use_tqdm=False)) == first
    assert kv.prefix_hits == hits  # not the token prompt's blocks
    assert _tokens(llm.generate([{"prompt_embeds": e.clone()}], GREEDY, use_tqdm=False)) == first
    assert kv.prefix_hits - hits == 40  # the identical embeds prompt's 5 blocks
    other = e.clone()
    other[-1] += 0.01
    hits = kv.prefix_hits
    llm.generate([{"prompt_embeds": other}], GREEDY, use_tqdm=False)
    assert kv.prefix_hits == hits
    hits = kv.prefix_hits  # and the token prompt does not take the embeds prompts' blocks
    assert _tokens(llm.generate([ids + [5]], SamplingParams(temperature=0.0, max_tokens=1),
                                use_tqdm=False))
    assert kv.prefix_hits - hits == 40  # (its own first run's blocks, not another's)
    assert kv.stats().blocks_used == 0


def test_prefix_roots_differ_with_salt_and_lora_id():
    from flashpage.kv_cache.prefix_cache import chain, splice_cid, splice_hash

    d1, d2 = b"a" * 32, b"b" * 32
    chains = [chain(0, None, None, 0, 16), chain(0, None, d1, 0, 16), chain(0, None, d2, 0, 16),
              chain(0, "s", d1, 0, 16), chain(3, None, d1, 0, 16), chain(0, "s", None, 0, 16)]
    # block 0's parent hash and parent content id, spliced where the chain says
    firsts = {(splice_hash(r, s[1]), splice_cid(c, s[1])) if s else (r, c) for r, c, s in chains}
    assert len({f[0] for f in firsts}) == 6 and len({f[1] for f in firsts}) == 6


def test_n_samples_and_truncation(llama):
    path, hf = llama
    ids = random_prompts(1, 30, 30, seed=9)[0]
    llm = _llm(path)
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    a = llm.generate([ids], params, use_tqdm=False)[0]
    b = llm.generate([{"prompt_embeds": embed_ids(hf, ids)}], params, use_tqdm=False)[0]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    cut = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, truncate_prompt_tokens=11)
    assert _tokens(llm.generate([{"prompt_embeds": embed_ids(hf, ids)}], cut, use_tqdm=False)) == \
        _tokens(llm.generate([ids[-11:]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                             use_tqdm=False))


def test_truncation_comes_before_the_length_check(llama):
    path, hf = llama
    ids = random_prompts(1, 80, 80, seed=14)[0]
    llm = _llm(path, max_model_len=64)
    cut = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, truncate_prompt_tokens=20)
    outs = llm.generate([ids, {"prompt_embeds": embed_ids(hf, ids)}], cut, use_tqdm=False)
    assert _tokens(outs)[0] == _tokens(outs)[1]


def test_digest_names_dtype_shape_and_bytes():
    from flashpage.engine.prompt_embeds import digest

    a = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    same = {digest(a), digest(a.clone())}
    others = {digest(a.reshape(4, 3)), digest(a.to(torch.bfloat16)), digest(a.to(torch.float16)),
              digest(a + 1e-6)}
    assert len(same) == 1 and len(others | same) == 5


def test_repetition_penalty_reads_the_outputs_only(llama):
    """An embeds prompt has no ids to penalize: as transformers' generate(inputs_embeds=...),
    whose penalty sees the generated tokens alone."""
    path, hf = llama
    g = torch.Generator().manual_seed(11)
    scale = float(hf.get_input_embeddings().weight.detach().std())
    embeds = [torch.randn(n, hf.config.hidden_size, generator=g) * scale for n in (6, 15)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.8)
    outs = _llm(path).generate([{"prompt_embeds": e} for e in embeds], params, use_tqdm=False)
    assert _tokens(outs) == hf_greedy_embeds(hf, embeds, repetition_penalty=1.8)


def test_bad_requests_are_refused_by_name_and_leak_nothing(llama):
    path, hf = llama
    H = hf.config.hidden_size
    llm = _llm(path, max_model_len=64)
    kv = llm.engine.kv_manager
    free = kv.num_free_blocks
    good = random_prompts(2, 6, 12, seed=12)
    bad = [
        (torch.zeros(5, H + 1), [f"hidden size {H + 1}", str(H)]),
        (torch.zeros(5, H, dtype=torch.int64), ["floating-point", "int64"]),
        (torch.zeros(H), ["2-D", "1-D"]),
        (torch.zeros(2, 5, H), ["2-D", "3-D"]),
        (torch.zeros(0, H), ["empty"]),
        (torch.zeros(64, H), ["64 tokens", "max_model_len is 64"]),
        (torch.full((3, H), float("nan")), ["NaN"]),
        ([[0.0] * H], ["torch.Tensor"]),
    ]
    batch = [good[0], *({"prompt_embeds": t} for t, _ in bad), {"prompt_embeds": embed_ids(hf, good[1])}]
    outs = llm.generate(batch, GREEDY, use_tqdm=False)
    for out, (_, needles) in zip(outs[1:-1], bad, strict=True):
        assert out.error is not None and not out.outputs
        for n in needles:
            assert n in out.error, out.error
    plain = _tokens(_llm(path).generate(good, GREEDY, use_tqdm=False))
    assert _tokens([outs[0], outs[-1]]) == plain
    e = {"prompt_embeds": embed_ids(hf, good[0])}
    out = llm.generate([e], SamplingParams(max_tokens=2, prompt_logprobs=1), use_tqdm=False)[0]
    assert "prompt_logprobs" in out.error
    with pytest.raises(ValueError, match="prompt_embeds"):
        llm.engine.add_request("x", embed_ids(hf, good[0]), PoolingParams())
    with pytest.raises(ValueError, match="beam_search"):
        llm.beam_search([e], BeamSearchParams(beam_width=2, max_tokens=2))
    both = {"prompt_embeds": e["prompt_embeds"], "prompt_token_ids": [1]}
    assert "one of 'prompt'" in llm.generate([both], GREEDY, use_tqdm=False)[0].error
    assert kv.num_free_blocks == free and kv.stats().blocks_used == 0
    assert not llm.engine.has_unfinished_requests()


def test_refused_without_the_flag_and_with_speculative_decoding(llama):
    path, hf = llama
    llm = LLM(str(path), dtype="float32", device="cpu", block_size=8)
    out = llm.generate([{"prompt_embeds": embed_ids(hf, [1, 2, 3])}], GREEDY, use_tqdm=False)[0]
    assert "enable_prompt_embeds" in out.error
    with pytest.raises(ConfigError, match="enable_prompt_embeds.*speculative_config"):
        LLM(str(path), dtype="float32", device="cpu", enable_prompt_embeds=True,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                "prompt_lookup_max": 3})


def test_a_model_without_inputs_embeds_is_refused_at_build(llama, monkeypatch):
    from flashpage.models.llama import LlamaForCausalLM

    monkeypatch.setattr(LlamaForCausalLM, "supports_prompt_embeds", False)
    with pytest.raises(ConfigError, match="enable_prompt_embeds: LlamaForCausalLM"):
        _llm(llama[0])


def test_cli_flag_reaches_the_engine(llama):
    import argparse

    from flashpage.cli import add_engine_arguments, build_llm

    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    assert p.parse_args([]).enable_prompt_embeds is False
    args = p.parse_args(["--model", str(llama[0]), "--device", "cpu", "--dtype", "float32",
                         "--enable-prompt-embeds"])
    llm = build_llm(args)  # what generate, chat, serve and bench build
    assert llm.engine.config.enable_prompt_embeds is True
    out = llm.generate([{"prompt_embeds": embed_ids(llama[1], [1, 2, 3])}], GREEDY, use_tqdm=False)
    assert out[0].error is None and len(out[0].outputs[0].token_ids) == GREEDY.max_tokens


@pytest.mark.gpu
def test_embeds_prompts_on_cuda_with_graphs(tiny_checkpoint):
    """On CUDA with the default graphs (steps with embeds rows run eagerly, their decodes in
    the graphs): embeds prompts' tokens equal the token prompts', mixed in one batch."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    path = tiny_checkpoint("head64_gqa")
    hf = hf_model(path)
    prompts = random_prompts(6, 5, 60, seed=13)
    llm = LLM(str(path), dtype="float32", enable_prompt_embeds=True)
    assert llm.engine.runner.graphs is not None
    plain = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    mixed = [{"prompt_embeds": embed_ids(hf, p)} if i % 2 else p for i, p in enumerate(prompts)]
    assert _tokens(llm.generate(mixed, GREEDY, use_tqdm=False)) == plain
    only = [{"prompt_embeds": embed_ids(hf, p)} for p in prompts]
    assert _tokens(llm.generate(only, GREEDY, use_tqdm=False)) == plain
    assert llm.engine.kv_manager.stats().blocks_used == 0


def test_sliding_window_release_and_hits(tiny_checkpoint):
    """Behind a released window (Mistral's 24): an identical embeds prompt hits (the window
    search from the right), tokens equal to the token prompt's and transformers'."""
    path = tiny_checkpoint("mistral_window")
    hf = hf_model(path)
    ids = random_prompts(1, 57, 57, seed=15)[0]
    e = embed_ids(hf, ids)
    llm = _llm(path)
    kv = llm.engine.kv_manager
    assert llm.engine.release_window == 24
    plain = _tokens(llm.generate([ids], GREEDY, use_tqdm=False))
    hits = kv.prefix_hits
    assert _tokens(llm.generate([{"prompt_embeds": e}], GREEDY, use_tqdm=False)) == plain
    assert kv.prefix_hits == hits
    assert _tokens(llm.generate([{"prompt_embeds": e.clone()}], GREEDY, use_tqdm=False)) == plain
    assert kv.prefix_hits > hits
    assert plain == hf_greedy_embeds(hf, [e])
    assert kv.stats().blocks_used == 0


def test_graph_paths_pass_embeds_steps_by(llama, monkeypatch):
    """With the decode, prompt-only and piecewise graphs' padded steps in place (run eagerly
    on the CPU, capture=False), a step holding embeds rows takes none of them (their
    static inputs are ids) and the other steps still do; tokens equal the token prompts'."""
    from flashpage.engine.cuda_graph import DecodeGraphs, PiecewiseGraphs, PrefillGraphs

    path, hf = llama
    prompts = random_prompts(4, 6, 30, seed=16)
    kw = dict(max_num_batched_tokens=32, block_size=16)
    plain = _tokens(_llm(path, **kw).generate(prompts, GREEDY, use_tqdm=False))
    llm = _llm(path, **kw)
    runner = llm.engine.runner
    runner.graphs = DecodeGraphs(runner.model, 4, 16, runner.device, groups=runner.num_groups)
    runner.capture_prefill_graphs(32, llm.engine.max_model_len, capture=False)
    runner.capture_piecewise_graphs(32, capture=False)
    used: list[tuple[str, bool]] = []  # (graph kind, whether the step had embeds rows)
    prepare = runner.prepare

    def spy_prepare(out):
        inp = prepare(out)
        used.append(("step", inp.inputs_embeds is not None))
        return inp

    monkeypatch.setattr(runner, "prepare", spy_prepare)
    for cls, kind in ((DecodeGraphs, "decode"), (PrefillGraphs, "prefill"), (PiecewiseGraphs, "piecewise")):
        run = cls.run

        def spy(self, *a, _run=run, _kind=kind, **k):
            used.append((_kind, used[-1][1]))
            return _run(self, *a, **k)

        monkeypatch.setattr(cls, "run", spy)
    mixed = [{"prompt_embeds": embed_ids(hf, p)} if i % 2 else p for i, p in enumerate(prompts)]
    assert _tokens(llm.generate(mixed, GREEDY, use_tqdm=False)) == plain
    graphed = [(k, e) for k, e in used if k != "step"]
    assert graphed and not any(e for _, e in graphed)  # no graph ran a step with embeds rows
    assert {k for k, _ in graphed} >= {"decode"}
    assert any(e for k, e in used if k == "step")


def test_encoder_model_refuses_the_flag(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["BertModel"], "model_type": "bert", "vocab_size": 32, "hidden_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32}))
    with pytest.raises(ValueError, match="enable_prompt_embeds applies to decoder models"):
        LLM(str(tmp_path), device="cpu", enable_prompt_embeds=True)


def test_lora_adapter_with_embeds_prompts(llama, tmp_path):
    """Under a LoRA adapter (its own prefix-cache root too): an embeds prompt's tokens are
    the token prompt's under the same adapter, and the merged checkpoint's."""
    from flashpage.lora.request import LoRARequest
    from tests.peft_adapter import merge_adapter, write_adapter

    path, hf = llama
    adapter = write_adapter(tmp_path / "adapter", path, seed=2)
    merged = merge_adapter(path, adapter, tmp_path / "merged")
    prompts = random_prompts(3, 8, 30, seed=17)
    want = _tokens(_llm(merged).generate(prompts, GREEDY, use_tqdm=False))
    llm = _llm(path, enable_lora=True)
    lora = LoRARequest("a", 1, str(adapter))
    embeds = [{"prompt_embeds": embed_ids(hf, p)} for p in prompts]
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=lora)) == want
    assert _tokens(llm.generate(embeds, GREEDY, use_tqdm=False, lora_request=lora)) == want
    assert _tokens(llm.generate(embeds, GREEDY, use_tqdm=False)) != want  # the adapter mattered
