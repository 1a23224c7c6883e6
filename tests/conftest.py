"""Shared test fixtures: tiny random HF checkpoints and their transformers reference."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:  # step_metadata imports it itself: nothing may import triton before the flag below
    from flashpage.attention.backend import AttentionMetadata

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Without a GPU, Triton kernels run in its interpreter (set before triton is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _fix_interpreter_scalar_index() -> None:
    """Triton 3.6's interpreter holds scalars as 1-element arrays and turns them into
    Python ints with int(array), which numpy >= 2.4 refuses for arrays with ndim > 0.
    Loops with data-dependent bounds (``range(start, end)`` of loaded values) then fail
    on the CPU. Take the single element instead."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        from triton.runtime import interpreter
    except ImportError:
        return

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


_fix_interpreter_scalar_index()

SHARED_CONFIGS = Path(__file__).resolve().parents[2] / "shared" / "configs"

# name -> (HF config class name, extra config kwargs)
TINY_MODELS: dict[str, tuple[str, dict]] = {
    "llama2_mha": ("LlamaConfig", dict(num_key_value_heads=4)),
    "llama31_gqa": ("LlamaConfig", dict(num_key_value_heads=2, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}, rope_theta=500000.0)),
    "mqa": ("LlamaConfig", dict(num_key_value_heads=1)),
    "qwen2_bias": ("Qwen2Config", dict(num_key_value_heads=2)),
    "qwen3_qknorm": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=16)),
    "tied": ("LlamaConfig", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "mistral_window": ("MistralConfig", dict(num_key_value_heads=2, sliding_window=24)),
    # head_dim 64 (a Triton attention tile unpadded): 4 query heads over 2 KV heads
    "head64_gqa": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2,
                                       head_dim=64, hidden_size=128)),
    # head_dim 128, the Gluon prefill's (sm_90): 4 query heads over 2 KV heads
    "head128_gqa": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2,
                                        head_dim=128, hidden_size=128)),
}


def edited_copy(src: Path, dst: Path, edit=None, config_edit=None) -> Path:
    """A copy of the checkpoint folder ``src`` at ``dst``, its model.safetensors tensors
    (a name -> tensor dict) and its config.json (a dict) passed through ``edit`` and
    ``config_edit`` in place (broken-file tests)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if edit is not None:
        t = load_file(str(dst / "model.safetensors"))
        edit(t)
        save_file(t, str(dst / "model.safetensors"))
    if config_edit is not None:
        cfg = json.loads((dst / "config.json").read_text())
        config_edit(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def assert_edit_refused(src: Path, tmp_path: Path, edit, message: str,
                        error: type[Exception] = ValueError) -> None:
    """A copy of the checkpoint ``src`` with its tensors passed through ``edit``
    (edited_copy) fails to load (fp32, CPU) with ``error`` matching ``message``."""
    from flashpage.models.loader import load_model, resolve_model

    path = edited_copy(src, tmp_path / "edited", edit=edit)
    with pytest.raises(error, match=message):
        load_model(resolve_model(str(path)), torch.float32, torch.device("cpu"))


def assert_missing_tensor_named(src: Path, tmp_path: Path, dropped: str) -> None:
    """Without the tensor ``dropped``, loading names it (and only it) as the checkpoint
    names it."""
    from flashpage.models.loader import ModelLoadError

    assert_edit_refused(src, tmp_path, lambda t: t.pop(dropped),
                        rf"1 weight\(s\) missing from the checkpoint: {dropped.replace('.', '[.]')}$",
                        ModelLoadError)


def build_tiny_checkpoint(path: Path, name: str, seed: int = 0, **overrides) -> Path:
    """Save a tiny random HF checkpoint (fp32 safetensors + config.json) under ``path``;
    ``overrides``: config fields over the named model's (e.g. a larger vocab_size)."""
    import transformers

    cls_name, extra = TINY_MODELS[name]
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=512, rms_norm_eps=1e-6,
                tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    base.update(extra)
    base.update(overrides)
    config = getattr(transformers, cls_name)(**base)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init is small; widen it so logits are far from ties.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" not in n:
                p.normal_(0, 0.2)
            else:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path, safe_serialization=True)
    return path


# DeepSeek (MLA + MoE), kept apart from TINY_MODELS, whose tests assume Llama-like heads.
# name -> (HF config class name, extra config kwargs)
_MLA_BASE = dict(num_hidden_layers=3, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
                 qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
                 n_shared_experts=1, moe_intermediate_size=32)
TINY_MLA_MODELS: dict[str, tuple[str, dict]] = {
    # V2: q_proj (no q_lora_rank), softmax greedy routing, every layer MoE, DeepSeek YaRN
    # with an attention factor (mscale != mscale_all_dim) and a softmax-scale fix.
    "deepseek_v2": ("DeepseekV2Config", dict(
        _MLA_BASE, q_lora_rank=None, first_k_dense_replace=0, topk_method="greedy",
        routed_scaling_factor=1.5, rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128,
            beta_fast=32, beta_slow=1, mscale=0.9, mscale_all_dim=0.7))),
    # V3: q_lora_rank, a dense first layer, sigmoid noaux_tc over 2 groups with a
    # correction bias, normalised top-k weights, interleaved rope.
    "deepseek_v3": ("DeepseekV3Config", dict(
        _MLA_BASE, q_lora_rank=24, first_k_dense_replace=1, n_group=2, topk_group=1,
        norm_topk_prob=True, routed_scaling_factor=2.5)),
}


# Mixtral, Qwen2-MoE, Qwen3-MoE: the Llama body with MoE MLPs (models/llama.py), 2 layers.
# name -> (HF config class name, extra config kwargs)
_MOE_BASE = dict(num_hidden_layers=2, num_key_value_heads=2, num_experts_per_tok=2,
                 moe_intermediate_size=32)
TINY_MOE_MODELS: dict[str, tuple[str, dict]] = {
    # 8 experts of intermediate_size, top-2 renormalized (always), every layer; a window
    # shorter than the prompts
    "mixtral": ("MixtralConfig", dict(num_hidden_layers=2, num_key_value_heads=2,
                                      num_local_experts=8, num_experts_per_tok=2,
                                      sliding_window=24)),
    # q/k norm; layer 0 dense (mlp_only_layers); top-3 of 8, renormalized
    "qwen3_moe": ("Qwen3MoeConfig", dict(_MOE_BASE, head_dim=16, num_experts=8,
                                         num_experts_per_tok=3, norm_topk_prob=True,
                                         mlp_only_layers=[0])),
    # decoder_sparse_step 2: layer 0 dense, layer 1 MoE; top-2 of 4, not renormalized
    "qwen3_moe_step2": ("Qwen3MoeConfig", dict(_MOE_BASE, head_dim=16, num_experts=4,
                                               decoder_sparse_step=2, norm_topk_prob=False)),
    # qkv bias, a shared expert behind a sigmoid gate, top-2 of 8 not renormalized
    "qwen2_moe": ("Qwen2MoeConfig", dict(_MOE_BASE, num_experts=8, norm_topk_prob=False,
                                         shared_expert_intermediate_size=48)),
}


def build_tiny_moe_checkpoint(path: Path, name: str, seed: int = 0, **overrides) -> Path:
    """Save a tiny random Mixtral / Qwen MoE checkpoint (fp32 safetensors + config.json)
    under ``path``; ``overrides``: config fields over the named model's."""
    cls_name, extra = TINY_MOE_MODELS[name]
    return _save_tiny_routed(path, cls_name, {**extra, **overrides}, seed, False)


def build_tiny_mla_checkpoint(path: Path, name: str, seed: int = 0, fan_in_init: bool = False,
                              **overrides) -> Path:
    """Save a tiny random DeepSeek checkpoint (fp32 safetensors + config.json) under ``path``;
    ``overrides``: config fields over the named model's (e.g. V2-Lite's attention dims).
    ``fan_in_init``: weights of std 0.2 x sqrt(64 / fan-in) instead of 0.2 (wide overrides:
    latent 512 at std 0.2 blows activations up until bf16 and fp32 greedy tokens part after
    a few steps whatever the kernels, 81 of 495 with torch_native on the CPU)."""
    cls_name, extra = TINY_MLA_MODELS[name]
    return _save_tiny_routed(path, cls_name, {**extra, **overrides}, seed, fan_in_init)


def _save_tiny_routed(path: Path, cls_name: str, extra: dict, seed: int, fan_in_init: bool) -> Path:
    """A tiny random MoE checkpoint: router weights wider than the rest, so that no expert
    choice is near a tie (build_tiny_mla_checkpoint says what ``fan_in_init`` does)."""
    import transformers

    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
                bos_token_id=1, eos_token_id=2, pad_token_id=0)
    base.update(extra)
    config = getattr(transformers, cls_name)(**base)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Widen the small random init so logits are far from ties (as build_tiny_checkpoint).
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n and n.endswith(".bias"):
                p.normal_(0, 0.2)  # a LayerNorm's (Starcoder2): 0.5-1.5 would swamp the logits
            elif "norm" in n:
                p.uniform_(0.5, 1.5)
            elif "gate.weight" in n or "router.weight" in n:  # router.weight: Granite MoE's
                p.normal_(0, 0.5)  # router logits far apart: no near-tied expert choices
            elif fan_in_init and p.dim() == 2:
                p.normal_(0, 0.2 * min(1.0, (64 / p.shape[1]) ** 0.5))
            else:
                p.normal_(0, 0.2)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.uniform_(-0.3, 0.3)  # V3 chooses with it but weights without it
    model.save_pretrained(path, safe_serialization=True)
    return path


def _checkpoints(tmp_path_factory, build):
    """name -> checkpoint folder, each built once per session."""
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = build(tmp_path_factory.mktemp(name), name)
        return cache[name]

    return get


def tiny_table_builder(table: dict[str, tuple[str, dict]]):
    """``build(path, name, seed=0, **overrides)`` over a family test's table of tiny
    checkpoints (name -> (transformers config class, its fields)), each saved by
    _save_tiny_routed (routers widened, dense weights as transformers initializes them)."""

    def build(path: Path, name: str, seed: int = 0, **overrides) -> Path:
        cls_name, extra = table[name]
        return _save_tiny_routed(path, cls_name, {**extra, **overrides}, seed, False)

    return build


def cpu_llm(path: Path, **kw):
    """Our engine as the family tests run it against transformers: fp32 on the CPU, blocks
    of 8, torch_native attention (a keyword overrides any of these)."""
    from flashpage import LLM

    return LLM(str(path), **{"dtype": "float32", "device": "cpu", "block_size": 8,
                             "attention_backend": "torch_native", **kw})


def ok_tokens(outs) -> list[list[int]]:
    """Each output's token ids, every request having run (an error shown otherwise)."""
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [o.outputs[0].token_ids for o in outs]


def count_encodes(monkeypatch, enc) -> list[int]:
    """The number of inputs (images, videos) of each call of the engine's ``enc.encode``,
    in order, as the calls come."""
    calls: list[int] = []
    encode = enc.encode
    monkeypatch.setattr(enc, "encode", lambda data: calls.append(len(data)) or encode(data))
    return calls


def cpu_greedy(path: Path, prompts: list[list[int]], params=None, **kw) -> list[list[int]]:
    """cpu_llm's tokens for each prompt (greedy, 12 tokens, EOS ignored unless ``params``
    says otherwise), every KV block handed back after."""
    from flashpage import SamplingParams

    llm = cpu_llm(path, **kw)
    params = params or SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.kv_manager.stats().blocks_used == 0
    return [o.outputs[0].token_ids for o in outs]


def save_widened(config, path: Path, seed: int, is_norm) -> Path:
    """transformers' model for ``config`` saved as fp32 safetensors under ``path``, its
    weights widened so logits are far from ties: norm weights (``is_norm(name)``) in
    [0.5, 1.5], everything else N(0, 0.2). The LayerNorm families' tiny checkpoints."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if is_norm(n) and n.endswith(".weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return path


def load_and_round_trip(path: Path, head: str = "lm_head.weight"):
    """Our model of the checkpoint at ``path`` (fp32, CPU), after asserting that every tensor
    comes back from ``hf_weights`` under its HF name equal to the file's (a tied ``head``
    left out). Returns (model, the file's tensors)."""
    from flashpage.models.loader import iter_safetensors, load_model, resolve_model

    model = load_model(resolve_model(str(path)), torch.float32, torch.device("cpu"))
    ref = dict(iter_safetensors(str(path)))
    mine = dict(model.hf_weights())
    if model.config.tie_word_embeddings:
        ref.pop(head, None)
        mine.pop(head, None)
    assert mine.keys() == ref.keys()
    assert all(torch.equal(mine[n], ref[n]) for n in ref)
    return model, ref


def assert_dense_params_match_hf(path: Path) -> None:
    """``flashpage inspect``'s parameter counts, from config.json alone, are transformers'
    count of the loaded model (a dense one: every parameter active for every token)."""
    import transformers

    from flashpage.config import ModelConfig
    from flashpage.inspect import param_counts

    total, active = param_counts(ModelConfig.from_hf(path))
    assert total == active == transformers.AutoModelForCausalLM.from_pretrained(path).num_parameters()


@pytest.fixture(scope="session")
def tiny_mla_checkpoint(tmp_path_factory):
    return _checkpoints(tmp_path_factory, build_tiny_mla_checkpoint)


@pytest.fixture(scope="session")
def tiny_moe_checkpoint(tmp_path_factory):
    return _checkpoints(tmp_path_factory, build_tiny_moe_checkpoint)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    return _checkpoints(tmp_path_factory, build_tiny_checkpoint)


@pytest.fixture(scope="session")
def byte_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama whose tokenizer is byte-level BPE (as SmolLM2's, Llama 3's):
    every byte is a token, so any text (JSON, regex matches) can be written with it, and
    multi-byte characters come as partial UTF-8 tokens too. vocab 320, eos 2."""
    from tests.byte_tokenizer import VOCAB_SIZE, build_byte_tokenizer

    path = tmp_path_factory.mktemp("tiny_byte_bpe")
    build_tiny_checkpoint(path, "llama2_mha", vocab_size=VOCAB_SIZE)
    build_byte_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def byte_model_dir_head64(tmp_path_factory) -> Path:
    """byte_model_dir's tokenizer over head64_gqa's shapes: head_dim 64, which our Triton
    kernels take (byte_model_dir's 16 is too small for them)."""
    from tests.byte_tokenizer import VOCAB_SIZE, build_byte_tokenizer

    path = tmp_path_factory.mktemp("tiny_byte_bpe_head64")
    build_tiny_checkpoint(path, "head64_gqa", vocab_size=VOCAB_SIZE)
    build_byte_tokenizer(path)
    return path


def hf_greedy(path: Path, prompts: list[list[int]], max_new_tokens: int,
              dtype: torch.dtype = torch.float32, device: str = "cpu",
              **load_kwargs) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (fp32 on the CPU unless told, one at
    a time); ``load_kwargs`` go to from_pretrained (e.g. attn_implementation="eager")."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                              **load_kwargs).to(device)
    model.generation_config.eos_token_id = None
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
            outs.append(out[0, len(p):].tolist())
    return outs


def assert_gpu_graphs_match_hf(path: Path, prompts: list[list[int]], reference=None, **llm_kwargs):
    """On CUDA in fp32 (triton backend, block 16): greedy runs of 4 + 2i tokens for prompt i
    (decode batches shrink through the graph sizes) equal with CUDA graphs and eagerly, and
    equal transformers' fp32 tokens (a prefix of its longest run; ``reference(path, prompts,
    max_tokens)`` gives them instead where the GPU image's transformers cannot run the model).
    Returns the graphed LLM for a caller's own checks. ``llm_kwargs`` go to both LLMs."""
    from flashpage import LLM, SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=4 + 2 * i, ignore_eos=True)
              for i in range(len(prompts))]

    def run(**kw):
        llm = LLM(str(path), dtype="float32", device="cuda", **{
            "attention_backend": "triton", "block_size": 16, **llm_kwargs, **kw})
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)], llm

    graphs, llm = run(max_num_seqs=16)
    assert llm.engine.runner.graphs is not None, "decode graphs were not captured"
    eager, _ = run(enforce_eager=True)
    assert graphs == eager
    longest = (reference or hf_greedy)(path, prompts, params[-1].max_tokens)  # greedy: shorter runs are prefixes
    assert graphs == [t[:sp.max_tokens] for t, sp in zip(longest, params, strict=True)]
    return llm


def bf16_teacher_forced_hits(path: Path, prompts: list[list[int]], truth: list[list[int]],
                             hf_kwargs: dict | None = None, **llm_kwargs) -> tuple[int, int]:
    """(ours, transformers'): over every position of the fp32 continuations ``truth``, how
    often the bf16 model's top token is fp32's, given the fp32 tokens before it (teacher-
    forced: greedy bf16 runs of a tiny random model part chaotically once one token
    differs). Ours through LLM(path, dtype="bfloat16", device="cuda", **llm_kwargs) and
    prompt_logprobs; transformers' bf16 on CUDA (``hf_kwargs`` to from_pretrained)."""
    import transformers

    from flashpage import LLM, SamplingParams

    seqs = [p + t for p, t in zip(prompts, truth, strict=True)]
    hf16 = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, **(hf_kwargs or {})).cuda()
    hf_hits = 0
    with torch.no_grad():
        for p, s in zip(prompts, seqs, strict=True):
            pred = hf16(torch.tensor([s], device="cuda")).logits[0, len(p) - 1:-1].argmax(-1)
            hf_hits += sum(a == b for a, b in zip(pred.tolist(), s[len(p):], strict=True))
    llm = LLM(str(path), dtype="bfloat16", device="cuda", **llm_kwargs)
    outs = llm.generate(seqs, SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0.0),
                        use_tqdm=False)
    ours = sum(o.prompt_logprobs[i].rank == 1 for p, s, o in zip(prompts, seqs, outs, strict=True)
               for i in range(len(p), len(s)))
    return ours, hf_hits


def assert_top_one_agreement(label: str, hf, hf16, outs, mm_inputs, cut_at: tuple[int, ...] = ()) -> None:
    """Teacher-forced on our greedy tokens (``outs``, every request done): our token is
    transformers' fp32 top one (``hf``) about as often as its own bf16 top token is
    (``hf16``): within 3 points, and at least 85%. A tiny random model's near ties flip
    under bf16 rounding either way, while a wrong position, rotary or image row costs far
    more agreement. ``mm_inputs(i, x)``: the i-th request's extra forward inputs (its pixel
    values, grids, token types) for ids ``x`` on CUDA; any "pixel_values*" goes bf16 for
    ``hf16``. ``cut_at``: ids a request's tokens are compared up to, the first of them included
    (a random model may emit its image token, which transformers, fed it back, would count
    as one more image row). The VLM GPU tests' shared check."""
    ours_top: list[bool] = []
    bf16_top: list[bool] = []
    gaps: list[float] = []
    for i, (o, got) in enumerate(zip(outs, ok_tokens(outs), strict=True)):
        cut = [j for j, t in enumerate(got) if t in cut_at]
        got = got[:cut[0] + 1] if cut else got
        n = len(o.prompt_token_ids)
        x = torch.tensor([o.prompt_token_ids + got[:-1]], device="cuda")
        kw = {k: v.to("cuda") for k, v in mm_inputs(i, x).items()}
        kw16 = {k: v.to(torch.bfloat16) if k.startswith("pixel_values") else v for k, v in kw.items()}
        with torch.no_grad():
            logits = hf(input_ids=x, attention_mask=torch.ones_like(x), **kw).logits[0, n - 1:].float()
            top16 = hf16(input_ids=x, attention_mask=torch.ones_like(x), **kw16).logits[0, n - 1:].argmax(-1)
        top32 = logits.argmax(-1)
        chosen = torch.tensor(got, device="cuda")
        ours_top += (top32 == chosen).tolist()
        bf16_top += (top32 == top16).tolist()
        gaps += (logits.max(1).values - logits.gather(1, chosen[:, None])[:, 0]).tolist()
    a, b = sum(ours_top) / len(ours_top), sum(bf16_top) / len(bf16_top)
    print(f"{label} agreement with fp32's top token over {len(ours_top)}: ours {a:.3f}, "
          f"transformers bf16 {b:.3f}")
    assert a >= b - 0.03 and a >= 0.85, (label, a, b, [round(g, 3) for g in gaps if g > 0])


def random_prompts(n: int, lo: int, hi: int, vocab: int = 256, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (k,), generator=g).tolist() for k in lens]


def staggered_prompts() -> list[list[int]]:
    """10 prompts, the last 4 sharing a 32-token prefix (for prefix hits)."""
    shared = random_prompts(1, 32, 32, seed=7)[0]
    return random_prompts(6, 3, 60, seed=3) + [shared + p for p in random_prompts(4, 1, 20, seed=4)]


def run_staggered(engine, prompts: list[list[int]], params) -> dict:
    """Feed two prompts every other step and step until all finish.

    Returns the outputs by prompt index, the prompt chunks that were shorter than what
    their request still had to compute (chunked prefill), and how many steps mixed
    decodes with longer chunks."""
    chunks: list[tuple[str, int, int]] = []
    mixed_steps = 0
    schedule = engine.scheduler.schedule

    def recording_schedule():
        nonlocal mixed_steps
        out = schedule()
        lens = [n for _, n in out.scheduled]
        mixed_steps += 1 in lens and any(n > 1 for n in lens)
        for r, n in out.scheduled:
            remaining = r.num_tokens - r.num_computed_tokens
            if remaining > 1 and n < remaining:
                chunks.append((r.request_id, n, remaining))
        return out

    engine.scheduler.schedule = recording_schedule
    got: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    step = 0
    while pending or engine.has_unfinished_requests():
        if step % 2 == 0:
            for _ in range(2):
                if pending:
                    i, p = pending.pop(0)
                    engine.add_request(str(i), p, params)
        for o in engine.step():
            if o.finished:
                got[o.request_id] = o.outputs[0].token_ids
        step += 1
        assert step < 2000, "the engine stopped making progress"
    return {"outputs": [got[str(i)] for i in range(len(prompts))], "chunks": chunks,
            "mixed_steps": mixed_steps}


def assert_staggered_matches_hf(path: Path, hf_kwargs: dict | None = None, **engine_kwargs) -> None:
    """10 prompts (4 sharing a 32-token prefix) arrive over several steps into a cache too
    small for all of them (fp32, CPU, block 4, 40 blocks (20 behind a window every layer
    shares), 24-token budget, 6 sequences):
    chunked prefill, mixed steps, preemption and prefix hits must all happen, every output
    must equal transformers' greedy tokens (``hf_kwargs`` to from_pretrained), and no block
    may be left in use. ``engine_kwargs`` go to EngineConfig (e.g. attention_backend)."""
    from flashpage import SamplingParams
    from flashpage.config import EngineConfig, ModelConfig
    from flashpage.engine.llm_engine import LLMEngine

    prompts = staggered_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    expected = hf_greedy(path, prompts, params.max_tokens, **(hf_kwargs or {}))
    from flashpage.kv_cache.hybrid import group_layers

    mc = ModelConfig.from_hf(path)
    layer_windows = [mc.attention_window(i) for i in range(mc.num_hidden_layers)]
    windows = set(layer_windows)
    # behind a window every layer shares, blocks go back to the pool: half of it still
    # runs short (Mistral, Mixtral, StarCoder2, Phi-3's tiny windows); layers mixing a
    # window with full ones (KV cache groups, kv_cache/hybrid.py): 20 blocks for each full
    # group's tables and for each windowed group's what its window and a step's 24 tokens
    # span, and 2 more
    blocks = 20 if len(windows) == 1 and None not in windows else 40
    layout = group_layers(layer_windows, [mc.attention_chunk(i) for i in range(mc.num_hidden_layers)])
    if layout is not None and not engine_kwargs.get("disable_hybrid_kv_cache_manager"):
        blocks = sum(-(-((layout.windows[g] or layout.chunk(g) or 0) + 24) // 4) + 2
                     if layout.releases(g) else 20 for g in range(layout.num_groups))
    engine = LLMEngine(EngineConfig(**{
        "model": str(path), "dtype": "float32", "device": "cpu", "block_size": 4,
        "num_gpu_blocks": blocks, "max_num_batched_tokens": 24, "max_num_seqs": 6,
        **engine_kwargs}))
    run = run_staggered(engine, prompts, params)
    assert run["chunks"], "the token budget was meant to force chunked prefill"
    assert run["mixed_steps"] > 0, "decodes and prompt chunks were meant to share steps"
    assert run["outputs"] == expected
    assert engine.scheduler.num_preemptions > 0, "the cache was meant to force preemption"
    kv = engine.kv_manager.stats()
    assert kv.prefix_hits > 0, "the shared prefix was meant to hit the cache"
    assert kv.blocks_used == 0


def step_metadata(q_lens: list[int], seq_lens: list[int], tables: list[list[int]], block_size: int,
                  num_decodes: int) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata of one step (and the positions of its tokens) as the model runner builds it."""
    from flashpage.attention.backend import AttentionMetadata

    positions = torch.cat([torch.arange(s - q, s) for q, s in zip(q_lens, seq_lens, strict=True)])
    slots = torch.cat([torch.tensor(t)[torch.arange(s - q, s) // block_size] * block_size
                       + torch.arange(s - q, s) % block_size
                       for q, s, t in zip(q_lens, seq_lens, tables, strict=True)])
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    md = AttentionMetadata(
        num_actual_tokens=sum(q_lens), num_seqs=len(q_lens), query_start_loc=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=bt,
        slot_mapping=slots.long(), max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        num_decodes=num_decodes, num_decode_tokens=num_decodes, query_lens_cpu=list(q_lens),
        seq_lens_cpu=list(seq_lens))
    return md, positions


def record_prompt_graph_keys(monkeypatch) -> list[tuple[tuple[int, int] | None, int]]:
    """Record each PrefillGraphs.run call's (slots, tokens) key and logits rows, in order."""
    from flashpage.engine.cuda_graph import PrefillGraphs

    keys: list[tuple[tuple[int, int] | None, int]] = []
    real = PrefillGraphs.run

    def spy(self, input_ids, positions, md, logits_indices):
        keys.append((self.key(md.num_seqs, md.num_actual_tokens), logits_indices.shape[0]))
        return real(self, input_ids, positions, md, logits_indices)

    monkeypatch.setattr(PrefillGraphs, "run", spy)
    return keys


def fake_cuda_graphs(monkeypatch, on_capture=lambda: ()) -> list[tuple]:
    """torch.cuda.CUDAGraph, torch.cuda.graph and torch.cuda.synchronize as stand-ins for a
    capture's bookkeeping on the CPU: the list returned records ("capture", pool,
    *on_capture()) at each capture and ("replay", graph) at each replay; a graph's own
    pool() is never to be asked for (the pool is handed over)."""
    import contextlib

    import torch

    events: list[tuple] = []

    class FakeGraph:
        def replay(self):
            events.append(("replay", self))

        def pool(self):
            raise AssertionError("the pool was handed over: not a new one")

    @contextlib.contextmanager
    def graph(g, pool=None):
        events.append(("capture", pool, *on_capture()))
        yield

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    return events


def use_expert_path(model, path: str) -> None:
    """Every MoE layer of ``model`` on one expert path ("sync_free", "grouped" or "fused")
    whatever the token count (the fused router kernel with "fused")."""
    from flashpage.layers.moe import FusedExperts, set_fused_moe

    set_fused_moe(model, path == "fused")
    for m in model.modules():
        if isinstance(m, FusedExperts):
            m.sync_free_max_tokens = -1 if path == "grouped" else 10**9


def count_expert_path(monkeypatch, path: str) -> list[int]:
    """The row counts FusedExperts.forward_<path> is called with, from now on."""
    from flashpage.layers.moe import FusedExperts

    calls: list[int] = []
    original = getattr(FusedExperts, f"forward_{path}")

    def spy(self, x, *a):
        calls.append(x.shape[0])
        return original(self, x, *a)

    monkeypatch.setattr(FusedExperts, f"forward_{path}", spy)
    return calls
