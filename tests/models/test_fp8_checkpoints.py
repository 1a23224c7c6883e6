"""Checkpoints whose weights are already fp8 (config.json's quantization_config: quant_method
fp8, compressed-tensors, fbgemm_fp8), read with no flag (models/fp8_checkpoint.py).

Each test checkpoint is a tiny random model quantized here with the formats' own formulas
(per tensor, per channel, per block), written with its scales; its reference twin holds the
same weights dequantized (scale * e4m3 value, fp32) under a plain config. Checked: the
config's parsing and its errors, which layers keep e4m3 (block-scaled ones with their tiles'
scales, merged linears whose pieces are not whole blocks dequantized), the loaded weights
against the file's (to the bit), the engine's tokens and log-probabilities against the
twin's (and transformers' tokens), ignored layers, broken files, ``flashpage inspect``; on
the GPU (skipped without one) bf16 with graphs."""

from __future__ import annotations

import gc
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashpage.config import CheckpointQuantization, ConfigError, ModelConfig
from flashpage.layers.quant import FP8_DTYPE, FP8_MAX, quantized_linears
from flashpage.models.loader import ModelLoadError
from tests.conftest import edited_copy, random_prompts

GPU = torch.cuda.is_available()
LAYER_LINEARS = ["self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"]
# llama31_gqa's merged pieces' rows (tests/conftest: 4 heads of 16, 2 KV heads, MLP 128)
PIECE_ROWS = {"q_proj": 64, "k_proj": 32, "v_proj": 32, "gate_proj": 128, "up_proj": 128}


# ----------------------------------------------------------------------------- builders
def quantize_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per tensor: s = amax|W| / 448 (a scalar), Wq = e4m3(W / s)."""
    s = w.abs().max() / FP8_MAX
    return (w / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), s


def quantize_channel(w: torch.Tensor, scale_dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Per output row: s [N, 1] = amax_k |W[n, k]| / 448 (stored in ``scale_dtype``, as
    llm-compressor stores bf16 scales for bf16 models), Wq = e4m3(W / s)."""
    s = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).to(scale_dtype)
    return (w / s.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), s


def expand_blocks(s: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    return torch.kron(s.float(), torch.ones(block))[: shape[0], : shape[1]]


def quantize_block(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's: s [ceil(N/bn), ceil(K/bk)] = each tile's amax / 448 (edge tiles
    partial), Wq = e4m3(W / s of its tile)."""
    (n, k), (bn, bk) = w.shape, block
    padded = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk)
    padded[:n, :k] = w
    tiles = padded.reshape(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
    s = tiles.abs().amax(dim=(1, 3)) / FP8_MAX
    return (w / expand_blocks(s, (n, k), block)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), s


def dequantize_file(q: torch.Tensor, s: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """What the file means: scale * e4m3 value in fp32 (broadcast, or tile by tile)."""
    if block is not None and s.numel() > 1 and s.shape != (q.shape[0], 1):
        return q.float() * expand_blocks(s, tuple(q.shape), block)
    return q.float() * s.float()


# name -> (quantization_config, how each weight is quantized, scale name, extra tensors)
FORMATS: dict[str, dict] = {
    # DeepSeek-V3's own form (their blocks are 128 x 128; 32 x 48 here so tiles are partial)
    "fp8_block": dict(config={"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                              "weight_block_size": [32, 48]},
                      strategy="block", block=(32, 48), scale_name="weight_scale_inv"),
    # the published 128 x 128: on llama31_gqa (q_proj 64 rows) qkv_proj cannot stack its
    # pieces' block scales and is dequantized; o_proj's 64 rows are one partial block
    "fp8_block128": dict(config={"quant_method": "fp8", "activation_scheme": "dynamic",
                                 "weight_block_size": [128, 128]},
                         strategy="block", block=(128, 128), scale_name="weight_scale_inv"),
    # vLLM's per-tensor fp8 with static activation scales; one of q/k/v left 16-bit; the
    # embeddings stored fp8 too (transformers' modules_to_convert)
    "fp8_tensor_static": dict(config={"quant_method": "fp8", "activation_scheme": "static",
                                      "ignored_layers": ["lm_head", "model.layers.1.self_attn.q_proj"]},
                              strategy="tensor", scale_name="weight_scale", input_scales=True,
                              fp8_embeddings=True),
    # llm-compressor FP8_DYNAMIC: per-channel bf16 scales, lm_head and one down_proj ignored
    "ct_channel": dict(config={
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "quantization_status": "compressed", "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False,
                        "symmetric": True, "observer": "minmax"},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                  "dynamic": True, "symmetric": True}}},
        "ignore": ["lm_head", "re:.*layers\\.1\\.mlp\\.down_proj$"]},
        strategy="channel", scale_name="weight_scale", scale_dtype=torch.bfloat16),
    # llm-compressor FP8 (static): per-tensor [1] scales and input_scale tensors
    "ct_tensor_static": dict(config={
        "quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
            "group_0": {"targets": ["Linear"],
                        "weights": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                    "dynamic": False, "symmetric": True},
                        "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                              "dynamic": False, "symmetric": True}}},
        "ignore": ["lm_head"]},
        strategy="tensor", scale_name="weight_scale", input_scales=True, scale_shape=(1,)),
    # fbgemm (Meta's Llama 3.1 405B FP8): [N, 1] scales; layer 0's MLP left 16-bit
    "fbgemm": dict(config={"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                           "modules_to_not_convert": ["lm_head", "model.layers.0.mlp"]},
                   strategy="channel", scale_name="weight_scale"),
}


def build_fp8_checkpoint(src: Path, dst: Path, ref: Path, fmt: str | dict,
                         is_linear=None) -> dict[str, str]:
    """Write ``dst`` (the fp8 checkpoint of ``src`` in format ``fmt``) and ``ref`` (the same
    weights dequantized, fp32, no quantization_config). Returns {weight name: "fp8" or
    "16-bit"}: how each linear weight was stored. ``is_linear(name, tensor)``: which
    tensors are the linears' weights (default: ``*_proj.weight`` and ``lm_head.weight``).
    ``fmt``: a FORMATS name, or a spec of its own in FORMATS' shape."""
    spec = FORMATS[fmt] if isinstance(fmt, str) else fmt
    qc = CheckpointQuantization.from_dict(spec["config"], str(dst))
    tensors = load_file(str(src / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    deq: dict[str, torch.Tensor] = {}
    stored: dict[str, str] = {}
    for name, w in tensors.items():
        module = name.removesuffix(".weight")
        linear = (is_linear(name, w) if is_linear is not None else name.endswith(".weight")
                  and ("_proj" in module.rsplit(".", 1)[-1] or module == "lm_head"))
        embed = name == "model.embed_tokens.weight" and spec.get("fp8_embeddings")
        if not (linear or embed) or qc.ignores(module) or (
                "mlp.gate." in name):  # a router (DeepSeek): never quantized
            out[name] = deq[name] = w
            if linear:
                stored[name] = "16-bit"
            continue
        if embed:
            q, s = quantize_tensor(w)
        elif spec["strategy"] == "block":
            q, s = quantize_block(w, spec["block"])
        elif spec["strategy"] == "tensor":
            q, s = quantize_tensor(w)
            s = s.reshape(spec.get("scale_shape", ()))
        else:
            q, s = quantize_channel(w, spec.get("scale_dtype", torch.float32))
        out[name], out[f"{module}.{spec['scale_name']}"] = q, s
        deq[name] = dequantize_file(q, s, spec.get("block"))
        if spec.get("input_scales"):
            out[f"{module}.input_scale"] = torch.tensor([0.05])
        stored[name] = "fp8"
    for folder, data, quant in ((dst, out, True), (ref, deq, False)):
        folder.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.name != "model.safetensors":
                shutil.copy(f, folder / f.name)
        cfg = json.loads((src / "config.json").read_text())
        if quant:
            cfg["quantization_config"] = spec["config"]
        (folder / "config.json").write_text(json.dumps(cfg))
        save_file(data, str(folder / "model.safetensors"))
    return stored


@pytest.fixture(scope="module")
def fp8_checkpoint(tiny_checkpoint, tiny_mla_checkpoint, tmp_path_factory):
    """(model, format) -> (fp8 folder, reference folder, {weight: stored as}), built once."""
    cache: dict[tuple[str, str], tuple[Path, Path, dict[str, str]]] = {}

    def get(model: str, fmt: str):
        if (model, fmt) not in cache:
            src = (tiny_mla_checkpoint if model.startswith("deepseek") else tiny_checkpoint)(model)
            root = tmp_path_factory.mktemp(f"{model}_{fmt}")
            stored = build_fp8_checkpoint(src, root / "fp8", root / "ref", fmt)
            cache[model, fmt] = (root / "fp8", root / "ref", stored)
        return cache[model, fmt]

    return get


def _load(path, quantization=None, dtype=torch.float32):
    from flashpage.models.loader import load_model, resolve_model

    return load_model(resolve_model(str(path), None), dtype, torch.device("cpu"),
                      quantization=quantization)


# ----------------------------------------------------------------------------- config
def test_each_format_parses_to_its_strategy(tmp_path):
    got = {fmt: CheckpointQuantization.from_dict(spec["config"], fmt)
           for fmt, spec in FORMATS.items()}
    assert got["fp8_block"] == CheckpointQuantization("fp8", "block", (32, 48), "dynamic", ())
    assert got["fp8_tensor_static"] == CheckpointQuantization(
        "fp8", "tensor", None, "static", ("lm_head", "model.layers.1.self_attn.q_proj"))
    assert got["ct_channel"].weight_strategy == "channel"
    assert got["ct_channel"].activation_scheme == "dynamic"
    assert got["ct_tensor_static"].weight_strategy == "tensor"
    assert got["ct_tensor_static"].activation_scheme == "static"
    assert got["fbgemm"] == CheckpointQuantization(
        "fbgemm_fp8", "channel", None, "dynamic", ("lm_head", "model.layers.0.mlp"))
    # ignore lists: names, the modules under one, "re:" patterns from the start
    ct = got["ct_channel"]
    assert ct.ignores("lm_head") and ct.ignores("model.layers.1.mlp.down_proj")
    assert not ct.ignores("model.layers.0.mlp.down_proj") and not ct.ignores("lm_head_x")
    assert got["fbgemm"].ignores("model.layers.0.mlp.up_proj")
    assert not got["fbgemm"].ignores("model.layers.0.mlp_x.up_proj")
    assert "128x128 block scales" in CheckpointQuantization(
        "fp8", "block", (128, 128)).describe()

    # DeepSeek-V3's published config (the shared copy has its quantization_config removed)
    from tests.conftest import SHARED_CONFIGS

    v3 = SHARED_CONFIGS / "deepseek-v3" / "config.json"
    if not v3.exists():
        pytest.skip("needs ../shared/configs")
    raw = json.loads(v3.read_text())
    raw["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3",
                                  "quant_method": "fp8", "weight_block_size": [128, 128]}
    cfg = ModelConfig.from_hf(raw)
    assert cfg.quantization_config == CheckpointQuantization("fp8", "block", (128, 128))
    assert ModelConfig.from_hf(v3).quantization_config is None


def _ct(weights=None, **kw):
    w = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
    w.update(weights or {})
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": w}}, **kw}


@pytest.mark.parametrize("qc,match", [
    ({"quant_method": "awq", "bits": 8}, r"quantization_config.bits 8 is not supported"),
    ({"quant_method": "gptq", "bits": 4, "desc_act": True},
     r"quantization_config.desc_act True is not supported"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True},
     r"quant_method 'bitsandbytes' is not supported"),
    ({"bits": 4}, r"quantization_config has no quant_method"),
    ("fp8", r"quantization_config must be a JSON object"),
    ({"quant_method": "fp8", "weight_block_size": [128]},
     r"quantization_config.weight_block_size must be two positive integers"),
    ({"quant_method": "fp8", "weight_block_size": [128, 0]},
     r"quantization_config.weight_block_size must be two positive integers"),
    ({"quant_method": "fp8", "activation_scheme": "per_token"},
     r"quantization_config.activation_scheme must be 'dynamic' or 'static'"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, r"quantization_config.fmt 'e5m2' is not supported"),
    ({"quant_method": "fp8", "ignored_layers": "lm_head"},
     r"quantization_config.ignored_layers must be a list"),
    (_ct({"num_bits": 4, "type": "int", "strategy": "group"}, format="pack-quantized"),
     r"quantization_config.format 'pack-quantized' is not supported"),
    (_ct({"num_bits": 4, "type": "int", "strategy": "group"}),
     r"config_groups.group_0.weights: 4-bit int weights are not supported"),
    (_ct({"type": "int"}), r"config_groups.group_0.weights: 8-bit int weights are not supported"),
    (_ct({"strategy": "group", "group_size": 128}),
     r"config_groups.group_0.weights.strategy 'group' is not supported"),
    (_ct({"symmetric": False}), r"weights.symmetric: asymmetric"),
    (_ct({"strategy": "block"}), r"weights.block_structure must be two positive integers"),
    (_ct(ignore="lm_head"), r"quantization_config.ignore must be a list"),
    ({"quant_method": "compressed-tensors"}, r"quantization_config.config_groups must be"),
])
def test_unsupported_quantization_configs_are_named(qc, match):
    base = {"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf({**base, "quantization_config": qc})


def test_quantization_flag_on_fp8_checkpoints(fp8_checkpoint):
    """No flag needed; "fp8" is fine (kept e4m3 weights stay as they are); the checkpoint's
    own method name as a flag says no flag is needed; anything else is the usual error."""
    from flashpage import LLM

    fp8, _, _ = fp8_checkpoint("llama31_gqa", "ct_channel")
    for bad in ("compressed-tensors", "fbgemm_fp8"):
        with pytest.raises(ValueError, match=r"quantization must be None or one of 'fp8'.*no flag"):
            LLM(str(fp8), device="cpu", quantization=bad)
    with pytest.raises(ValueError, match=r"quantization must be None or one of 'fp8', 'int4', 'rtn', got 'int8'$"):
        LLM(str(fp8), device="cpu", quantization="int8")
    a, b = _load(fp8), _load(fp8, "fp8")
    assert quantized_linears(a) == quantized_linears(b)
    assert quantized_linears(_load(fp8, "int4")) == quantized_linears(a)  # e4m3 kept, not rounded again
    for (n, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(p.view(torch.uint8) if p.dtype == FP8_DTYPE else p,
                           q.view(torch.uint8) if q.dtype == FP8_DTYPE else q), n


# ----------------------------------------------------------------------------- loading
def _expected_fp8(stored: dict[str, str], fmt: str | None = None) -> list[str]:
    """Our linears (llama31_gqa's) whose pieces the file holds all in fp8, and with ``fmt``'s
    block scales whose pieces are whole blocks (None: whatever the scales: quantization="fp8"
    re-quantizes the rest per row)."""
    block = FORMATS[fmt].get("block") if fmt is not None else None
    out = []
    for i in range(2):
        p = f"model.layers.{i}"
        pieces = {"self_attn.qkv_proj": ["q_proj", "k_proj", "v_proj"], "self_attn.o_proj": ["o_proj"],
                  "mlp.gate_up_proj": ["gate_proj", "up_proj"], "mlp.down_proj": ["down_proj"]}
        for ours, hf in pieces.items():
            sub = ours.split(".")[0]
            whole = block is None or len(hf) == 1 or all(PIECE_ROWS[h] % block[0] == 0 for h in hf)
            if all(stored[f"{p}.{sub}.{h}.weight"] == "fp8" for h in hf) and whole:
                out.append(f"{p}.{ours}")
    return out


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_loaded_weights_are_the_files_to_the_bit(fp8_checkpoint, fmt):
    """Every format keeps the file's e4m3 bytes with each piece's scale on its rows (q, k and
    v of one qkv_proj each under its own per-tensor scale; block scales stacked along their
    N-block axis); a merged linear whose pieces are not whole blocks, the LM head and
    embeddings come dequantized; ignored layers as stored. Every weight, read back in HF's
    names, equals scale * value computed from the file."""
    from flashpage.bench.common import weight_bytes
    from flashpage.inspect import inspect_config

    fp8, ref, stored = fp8_checkpoint("llama31_gqa", fmt)
    model = _load(fp8)
    expected = _expected_fp8(stored, fmt)
    assert quantized_linears(model) == expected
    if fmt == "fp8_tensor_static":  # layer 1's q_proj ignored: its qkv_proj stays 16-bit
        assert "model.layers.1.self_attn.qkv_proj" not in expected
    if fmt == "fbgemm":
        assert "model.layers.0.mlp.gate_up_proj" not in expected
    if fmt == "fp8_block128":  # q_proj's 64 rows are half a block: qkv_proj dequantized
        assert "model.layers.0.self_attn.qkv_proj" not in expected
        assert "model.layers.0.mlp.gate_up_proj" in expected
    file = load_file(str(fp8 / "model.safetensors"))
    want = load_file(str(ref / "model.safetensors"))
    got = dict(model.hf_weights())
    assert got.keys() == want.keys()
    for name, w in want.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], w), name
    scale_name = FORMATS[fmt]["scale_name"]
    for path in expected:
        m = model.get_submodule(path)
        assert m.weight.dtype == FP8_DTYPE and m.weight_scale.dtype == torch.float32
        # the e4m3 bytes as stored, each piece's rows under its own scale
        block = FORMATS[fmt].get("block")
        assert m.weight_block == block
        for hf in model._pieces(f"{path}.weight") or [f"{path}.weight"]:
            _, off, rows = model._split_name(hf) or (None, 0, m.weight.shape[0])
            assert torch.equal(m.weight[off:off + rows].view(torch.uint8),
                               file[hf].view(torch.uint8)), hf
            s = file[hf.removesuffix("weight") + scale_name].float()
            if block is not None:  # the tiles' scales, this piece's N-blocks of them
                bn, bk = block
                assert m.weight_scale.shape == (-(-m.weight.shape[0] // bn),
                                                -(-m.weight.shape[1] // bk))
                assert torch.equal(m.weight_scale[off // bn:-(-(off + rows) // bn)], s), hf
            else:
                assert torch.equal(m.weight_scale[off:off + rows], s.reshape(-1).expand(rows)), hf
    qkv = [file[f"model.layers.0.self_attn.{x}_proj.{scale_name}"].float().reshape(-1)
           for x in "qkv"]
    if FORMATS[fmt]["strategy"] == "tensor":
        assert len({s.item() for s in qkv}) == 3  # three different scales in one qkv_proj
    for name, how in stored.items():
        if how == "16-bit":
            module = name.removesuffix(".weight")
            assert file[name].dtype == torch.float32 and torch.equal(got[name], file[name]), name
            assert CheckpointQuantization.from_dict(FORMATS[fmt]["config"], fmt).ignores(module)
    # the LM head, embeddings and norms as the model's dtype
    assert model.lm_head.weight.dtype == torch.float32
    assert model.model.embed_tokens.weight.dtype == torch.float32
    # flashpage inspect counts, from the config alone, the bytes the engine holds
    info = inspect_config(ModelConfig.from_hf(fp8), 1 << 30, "fp32")
    assert info["weights_bytes"] == weight_bytes(model)
    assert info["quantization_config"]["method"] == FORMATS[fmt]["config"]["quant_method"]


@pytest.mark.parametrize("fmt", ["fp8_block", "fp8_block128", "ct_channel", "fp8_tensor_static"])
def test_quantization_fp8_requantizes_only_what_the_checkpoint_quantized(fp8_checkpoint, fmt):
    """quantization="fp8" on an fp8 checkpoint: the kept e4m3 weights stay (the checkpoint's
    own bytes and scales, not a re-quantization); merged block-scaled ones dequantized at
    load are quantized per row like any 16-bit weight; layers the checkpoint left 16-bit
    stay 16-bit."""
    from flashpage.bench.common import weight_bytes
    from flashpage.inspect import inspect_config

    fp8, _, stored = fp8_checkpoint("llama31_gqa", fmt)
    model = _load(fp8, "fp8")
    assert quantized_linears(model) == _expected_fp8(stored)
    plain = _load(fp8)
    assert quantized_linears(plain) == _expected_fp8(stored, fmt)
    for path in quantized_linears(plain):
        a, b = model.get_submodule(path), plain.get_submodule(path)
        assert torch.equal(a.weight.view(torch.uint8), b.weight.view(torch.uint8)), path
        assert torch.equal(a.weight_scale, b.weight_scale) and a.weight_block == b.weight_block
    info = inspect_config(ModelConfig.from_hf(fp8), 1 << 30, "fp32", quantization="fp8")
    assert info["weights_bytes"] == weight_bytes(model)


def test_quantization_int4_on_a_block_checkpoint(fp8_checkpoint):
    """quantization="int4" on a block-scaled checkpoint: the linears kept in e4m3 stay so,
    the merged one dequantized at load (qkv_proj: q_proj is half a 128-row block) is rounded
    to int4; inspect counts the bytes the engine holds."""
    from flashpage.bench.common import weight_bytes
    from flashpage.inspect import inspect_config
    from flashpage.layers.int4 import int4_linears

    fp8, _, stored = fp8_checkpoint("llama31_gqa", "fp8_block128")
    model = _load(fp8, "int4")
    kept = _expected_fp8(stored, "fp8_block128")
    assert quantized_linears(model) == kept
    assert int4_linears(model) == [f"model.layers.{i}.self_attn.qkv_proj" for i in range(2)]
    info = inspect_config(ModelConfig.from_hf(fp8), 1 << 30, "fp32", quantization="int4")
    assert info["weights_bytes"] == weight_bytes(model)
    assert info["fp8_linears"] == len(kept) and info["int4_linears"] == 2


def _generate(path, prompts, **kw):
    from flashpage import LLM, SamplingParams

    llm = LLM(str(path), device="cpu", dtype="float32", **kw)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                logprobs=1), use_tqdm=False)
    fp8 = len(quantized_linears(llm.engine.model))
    del llm
    gc.collect()
    return ([o.outputs[0].token_ids for o in outs],
            [[lp.top[0][1] for lp in o.outputs[0].logprobs] for o in outs], fp8)


@pytest.mark.parametrize("model,fmt", [("llama31_gqa", "ct_channel"),
                                       ("llama31_gqa", "fp8_tensor_static"),
                                       ("llama31_gqa", "fp8_block"),
                                       ("llama31_gqa", "fp8_block128"),
                                       ("qwen2_bias", "fbgemm"),
                                       ("deepseek_v3", "ct_channel"),
                                       ("deepseek_v3", "fp8_block")])
def test_engine_tokens_equal_the_dequantized_checkpoints(fp8_checkpoint, model, fmt):
    """LLM(fp8 checkpoint) with no flag, fp32 on the CPU (e4m3 weights, per row or per block,
    dequantized per call: scale * value, the very weights of the reference): the same greedy
    tokens and the same log-probabilities, to the bit, as the engine over the dequantized
    fp32 checkpoint."""
    fp8, ref, _ = fp8_checkpoint(model, fmt)
    prompts = random_prompts(4, 3, 30, seed=5)
    tokens, logprobs, n_fp8 = _generate(fp8, prompts)
    ref_tokens, ref_logprobs, ref_fp8 = _generate(ref, prompts)
    assert ref_fp8 == 0 and n_fp8 > 0
    assert tokens == ref_tokens
    assert logprobs == ref_logprobs


@pytest.mark.parametrize("model,fmt", [("llama31_gqa", "fp8_block"), ("deepseek_v3", "fp8_block"),
                                       ("llama31_gqa", "fp8_block128")])
def test_block_fp8_stays_e4m3_and_matches_transformers(fp8_checkpoint, model, fmt):
    """A block-scaled checkpoint (DeepSeek-V3's form) keeps its linears as stored: each one's
    only tensors are the e4m3 weight and its fp32 tile scales, nothing 16/32-bit of [N, K]
    is kept beside them (the model is 3 bytes per kept weight value smaller than the
    dequantized twin, plus the scales), and greedy decoding on the CPU (fp32, the weights
    dequantized per call) gives transformers' tokens over the dequantized checkpoint."""
    from flashpage import LLM, SamplingParams
    from flashpage.bench.common import weight_bytes
    from tests.conftest import hf_greedy

    fp8, ref, _ = fp8_checkpoint(model, fmt)
    bn, bk = FORMATS[fmt]["block"]
    llm = LLM(str(fp8), device="cpu", dtype="float32")
    m = llm.engine.model
    kept = quantized_linears(m)
    assert kept
    values = scales = 0
    for path in kept:
        lin = m.get_submodule(path)
        n, k = lin.weight.shape
        assert [name for name, _ in lin.named_parameters()] == ["weight"], path
        assert [name for name, _ in lin.named_buffers()] == ["weight_scale"], path
        assert not [a for a, v in vars(lin).items() if isinstance(v, torch.Tensor)], path
        assert lin.weight.dtype == FP8_DTYPE and lin.weight_block == (bn, bk)
        assert lin.weight_scale.dtype == torch.float32
        assert lin.weight_scale.shape == (-(-n // bn), -(-k // bk))
        values += n * k
        scales += lin.weight_scale.numel()
    twin = _load(ref)
    assert weight_bytes(m) == weight_bytes(twin) - 3 * values + 4 * scales
    del twin
    prompts = random_prompts(3, 3, 20, seed=11)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                        use_tqdm=False)
    del llm
    gc.collect()
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(ref, prompts, 10)


@pytest.mark.parametrize("fmt", ["ct_channel", "fp8_block"])
def test_deepseek_keeps_what_our_fp8_linears_run(fp8_checkpoint, fmt):
    """DeepSeek-V3 stored per channel or per block (its own form), everything fp8 but the
    router: MLA's projections, the dense MLP and shared experts keep e4m3 (block scales too:
    gate_up_proj's pieces are whole 32-row blocks, q_a_proj's 24 rows one partial block);
    kv_b_proj (absorbed as a matrix), the routed experts (their fused kernel) and the LM head
    come dequantized; the router as stored."""
    fp8, ref, stored = fp8_checkpoint("deepseek_v3", fmt)
    model = _load(fp8)
    attn = ["self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa",
            "self_attn.o_proj"]
    mlps = [["mlp.gate_up_proj", "mlp.down_proj"]] + [
        ["mlp.shared_experts.gate_up_proj", "mlp.shared_experts.down_proj"]] * 2
    assert quantized_linears(model) == [f"model.layers.{i}.{n}" for i in range(3)
                                        for n in attn + mlps[i]]
    assert stored["model.layers.1.mlp.experts.0.gate_proj.weight"] == "fp8"
    assert stored["model.layers.0.self_attn.kv_b_proj.weight"] == "fp8"
    for n, p in model.named_parameters():
        if ".experts." in n or "kv_b_proj" in n or n.endswith("mlp.gate.weight") or "lm_head" in n:
            assert p.dtype == torch.float32, n
    want = load_file(str(ref / "model.safetensors"))
    experts = model.model.layers[1].mlp.experts
    inter = experts.gate_up_proj.shape[1] // 2
    assert torch.equal(experts.gate_up_proj[3, :inter],
                       want["model.layers.1.mlp.experts.3.gate_proj.weight"])
    assert torch.equal(model.model.layers[2].self_attn.kv_b_proj.weight,
                       want["model.layers.2.self_attn.kv_b_proj.weight"])


def test_sharded_checkpoint_with_scales_apart_from_their_weights(fp8_checkpoint, tmp_path):
    """A sharded fp8 checkpoint (model.safetensors.index.json) whose scales sit in another
    shard than their weights, after them: loaded the same as the single file."""
    fp8, _, _ = fp8_checkpoint("llama31_gqa", "ct_tensor_static")
    path = edited_copy(fp8, tmp_path / "sharded")
    tensors = load_file(str(path / "model.safetensors"))
    # llm-compressor may write zero points (all zero) beside symmetric scales: skipped
    tensors["model.layers.0.mlp.down_proj.weight_zero_point"] = torch.zeros(1, dtype=torch.int8)
    (path / "model.safetensors").unlink()
    shards = {"model-00001-of-00002.safetensors": {}, "model-00002-of-00002.safetensors": {}}
    a, b = shards.values()
    for name, t in tensors.items():
        (b if name.endswith("_scale") else a)[name] = t
    weight_map = {}
    for file, data in shards.items():
        save_file(data, str(path / file))
        weight_map.update(dict.fromkeys(data, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    one, two = _load(fp8), _load(path)
    assert quantized_linears(two) == quantized_linears(one) != []
    for (n, p), (_, q) in zip(one.state_dict().items(), two.state_dict().items(), strict=True):
        assert torch.equal(p.view(torch.uint8) if p.dtype == FP8_DTYPE else p,
                           q.view(torch.uint8) if q.dtype == FP8_DTYPE else q), n


# ----------------------------------------------------------------------------- broken files
def test_broken_fp8_checkpoints_are_clear_errors(fp8_checkpoint, tmp_path):
    fp8, _, _ = fp8_checkpoint("llama31_gqa", "ct_channel")
    w = "model.layers.0.self_attn.k_proj.weight"
    cases = [
        (lambda t: t.pop(w + "_scale"), None, rf"fp8 weight {w} has no scale"),
        (lambda t: t.update({w + "_scale": torch.ones(3, 1)}), None,
         rf"{w}: scale of shape \(3, 1\), expected \[32, 1\] \(per-channel"),
        (lambda t: t.update({w + "_scale_inv": torch.ones(32, 1)}), None, "has two scales"),
        (lambda t: t.update({w.removesuffix("weight") + "weight_zero_point": torch.ones(32, 1)}),
         None, r"weight_zero_point is not zero \(asymmetric fp8 is not supported\)"),
        (lambda t: t.update({w: t[w].to(torch.float8_e5m2)}), None,
         rf"tensor {w} is F8_E5M2"),
        (None, lambda c: c.pop("quantization_config"),
         r"tensor model\.layers\.0\.\S+ is float8_e4m3fn but .* has no "
         "quantization_config"),
        (lambda t: t.update({k: v.float() for k, v in t.items() if v.dtype == FP8_DTYPE}), None,
         r"has a quantization_config \(compressed-tensors\) but no tensor is float8_e4m3fn"),
        (None, lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(
            strategy="tensor"), r"scale of shape \(\d+, 1\), expected one value \(per-tensor"),
    ]
    for i, (edit, config_edit, match) in enumerate(cases):
        path = edited_copy(fp8, tmp_path / str(i), edit, config_edit)
        with pytest.raises(ModelLoadError, match=match):
            _load(path)
    blocks, _, _ = fp8_checkpoint("llama31_gqa", "fp8_block")
    path = edited_copy(blocks, tmp_path / "blocks", config_edit=lambda c: c["quantization_config"].update(
        weight_block_size=[16, 48]))
    with pytest.raises(ModelLoadError, match=r"block scales of shape \(\d+, 2\), expected \[\d+, 2\] for a \[\d+, 64\] weight in 16x48 blocks"):
        _load(path)


def test_inspect_reports_the_checkpoint_quantization(fp8_checkpoint, capsys):
    from flashpage.inspect import main

    fp8, ref, _ = fp8_checkpoint("llama31_gqa", "fp8_block")
    assert main([str(fp8)]) == 0
    out = capsys.readouterr().out
    assert "fp8 e4m3 (fp8, 32x48 block scales, dynamic activations): kept in e4m3, a scale per " \
        "block (8 linears)" in out
    assert main([str(fp8), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["quantization_config"] == {"method": "fp8", "weight_strategy": "block",
                                           "block_size": [32, 48], "activation_scheme": "dynamic",
                                           "ignored": [], "bits": 8, "group_size": None}
    assert main([str(ref), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["quantization_config"] is None


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", ["ct_channel", "fp8_tensor_static", "fp8_block", "fp8_block128"])
def test_fp8_checkpoint_bf16_on_the_gpu_with_graphs(fp8_checkpoint, fmt):
    """bf16 on CUDA, engine defaults (triton, CUDA graphs, our GEMV / W8A8 over the kept
    e4m3 weights; block-scaled ones through kernels/fp8_block_gemm.py and, one sequence
    alone, the one-row GEMV): each greedy token of the bf16 engine over the dequantized
    checkpoint, fed back, is the fp8 checkpoint engine's top token where bf16 is sure (the
    same rule as test_fp8_weights' GPU test: W8A8 rounds the activations too), and decode
    graphs captured."""
    from flashpage import LLM, SamplingParams

    fp8, ref, _ = fp8_checkpoint("head128_gqa", fmt)
    prompts = random_prompts(12, 3, 300, seed=2)
    base = LLM(str(ref), dtype="bfloat16", num_gpu_blocks=1024)
    outs = base.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                 logprobs=2), use_tqdm=False)
    margins = torch.tensor([lp.top[0][1] - lp.top[1][1] for o in outs for lp in o.outputs[0].logprobs])
    full = [p + o.outputs[0].token_ids for p, o in zip(prompts, outs, strict=True)]
    del base
    gc.collect()
    torch.cuda.empty_cache()
    quant = LLM(str(fp8), dtype="bfloat16", num_gpu_blocks=1024)
    assert quant.engine.runner.graphs is not None
    assert len(quantized_linears(quant.engine.model)) > 0
    forced = quant.generate(full, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    ranks = torch.tensor([e.rank for p, o in zip(prompts, forced, strict=True)
                          for e in o.prompt_logprobs[len(p):]])
    assert torch.all(ranks[margins > 3.0] == 1)
    assert (ranks == 1).float().mean() > 0.45
    if FORMATS[fmt]["strategy"] == "block":
        # one sequence alone: its decode steps take the one-row GEMV over the block scales
        blocks = [m for m in quant.engine.model.modules() if getattr(m, "weight_block", None)]
        assert blocks and all(m.row_gemv for m in blocks)
        one = quant.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=24,
                                                          ignore_eos=True), use_tqdm=False)
        got, want = one[0].outputs[0].token_ids, outs[0].outputs[0].token_ids
        for i, lp in enumerate(outs[0].outputs[0].logprobs):
            if got[:i] != want[:i]:
                break
            if lp.top[0][1] - lp.top[1][1] > 3.0:
                assert got[i] == want[i], (i, got, want)
