"""AWQ and GPTQ 4-bit checkpoints, read as vLLM reads them: no flag, the config's
``quantization_config`` says so (parsed once: ``config.CheckpointQuantization``, quant_method
"awq" or "gptq", ``bits`` 4).

Each quantized linear ``X`` of the file is ``X.qweight``, ``X.qzeros``, ``X.scales`` (and
GPTQ's ``X.g_idx``) in its format's packing (models/int4_formats.py); our linears keep the
4 bits, repacked once at load into the layout our kernels read (kernels/int4_gemm.py):

    X.qweight / X.qzeros / X.scales  ->  X.weight     int32 [N, K/8]
                                         X.w4_scales  [N, K/G]  (the file's dtype, fp16)
                                         X.w4_zeros   uint8 [N, K/G]

so a merged linear (qkv_proj, gate_up_proj) takes each piece's rows as for 16-bit
weights, and so does a MoE layer's routed experts (Mixtral / Qwen2-MoE / Qwen3-MoE:
``experts.{e}.{gate,up,down}_proj``, Mixtral's ``w1 / w3 / w2``), fused per layer by
layers/moe.load_expert_weight into ``gate_up_proj`` [E, 2I, ...] / ``down_proj``
[E, H, ...]. Kept in int4: a ``ColumnParallelLinear`` / ``RowParallelLinear`` left
``quantizable`` all of whose pieces the file holds in int4. A quantized tensor with no
such home (an LM head GPTQModel quantized with ``lm_head: true``, or a merged linear with
a piece the file left 16-bit) is dequantized to the model's dtype; 16-bit tensors
(embeddings, the LM head, norms, MoE routers, ``modules_to_not_convert``) load as stored.
Routed experts are dequantized to the model's dtype too, unless the loader asks to keep
them (``keep_experts``: the engine where the fused int4 MoE kernel runs, envs.int4_moe):
then a layer all of whose experts the file holds in int4 with one group size keeps them
packed (layers/moe.FusedExperts.hold_int4), run by kernels/fused_moe_int4.py.

Every quantized module's shapes (and GPTQ's g_idx: it must be k // G, act-order is not
read) are checked before the model takes anything; a broken file is a ModelLoadError
naming the tensor.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from flashpage.config import CheckpointQuantization, ModelConfig
from flashpage.kernels.int4_gemm import dequantize_int4_ref
from flashpage.models.fp8_checkpoint import linear_of, linears_of
from flashpage.models.int4_formats import awq_to_layout, gptq_to_layout
from flashpage.models.loader import ModelLoadError, safetensors_files

logger = logging.getLogger("flashpage")

# a routed expert's module (Mixtral's w1 / w2 / w3 too): fused into layers/moe.FusedExperts
_EXPERT = re.compile(r"\.experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3)$")
_PARTS = (".qweight", ".qzeros", ".scales", ".g_idx")
_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}


def _expected(qc: CheckpointQuantization, qweight: tuple[int, ...],
              ) -> tuple[int, int, int, dict[str, tuple[int, ...]]]:
    """(K, N, G, {part: shape}) of a module from its qweight's shape."""
    if len(qweight) != 2:
        raise ValueError(f"qweight of shape {list(qweight)}, expected 2 dimensions")
    k, n = (qweight[0], qweight[1] * 8) if qc.method == "awq" else (qweight[0] * 8, qweight[1])
    g = qc.group_size or k
    if k % g or n % 8:
        raise ValueError(f"a [{k} in, {n} out] weight does not split into groups of {g} along "
                         "K and words of 8 along N")
    shapes: dict[str, tuple[int, ...]] = {".qzeros": (k // g, n // 8), ".scales": (k // g, n)}
    if qc.method == "gptq":
        shapes[".g_idx"] = (k,)
    return k, n, g, shapes


def hold_int4_experts(model: nn.Module, modules: list[str], header: dict[str, tuple[str, str,
                      tuple[int, ...]]], qc: CheckpointQuantization) -> set[str]:
    """Turn the routed experts that can keep the file's int4 weights to hold them
    (FusedExperts.hold_int4): every expert's gate / up / down module int4 in the file, one
    scale dtype, groups the fused kernel takes. Returns the file's modules kept; the other
    layers' experts are dequantized at load, with a warning naming why."""
    from flashpage.layers.moe import EXPERT_NAME, FusedExperts
    from flashpage.models.llama import _moe_name

    layers: dict[str, list[str]] = {}
    for mod in modules:
        if (m := EXPERT_NAME.match(_moe_name(mod + ".weight"))) is not None:
            layers.setdefault(m["prefix"], []).append(mod)
    kept: set[str] = set()
    skipped: dict[str, str] = {}
    for prefix, mods in layers.items():
        try:
            experts = model.get_submodule(prefix)
        except AttributeError:
            continue  # no such layer: load_weights names the tensor
        if not isinstance(experts, FusedExperts):
            continue
        why = experts.int4_unsupported(qc.group_size)
        dtypes = {header[mod + ".scales"][1] for mod in mods}
        if why is None and len(mods) != 3 * experts.num_experts:
            why = "some of its experts' weights are not int4 in the file"
        if why is None and len(dtypes) != 1:
            why = f"its experts' scales are of several dtypes ({sorted(dtypes)})"
        if why is not None:
            skipped[prefix] = why
            continue
        experts.hold_int4(qc.group_size, _DTYPES[dtypes.pop()])
        kept.update(mods)
    if skipped:
        logger.warning("int4 checkpoint: %d MoE layers' routed experts dequantized to 16 bits "
                       "at load (%s: %s)", len(skipped), *next(iter(skipped.items())))
    return kept


def int4_checkpoint_weights(model: nn.Module, config: ModelConfig, folder: str,
                            keep_experts: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Prepare ``model`` for the AWQ / GPTQ checkpoint in ``folder`` and return its weights
    as ``load_weights`` takes them: the linears that keep int4 are turned to hold it now
    (``hold_int4``) and each of their pieces comes as (``X.weight`` int32 [N, K/8],
    ``X.w4_scales``, ``X.w4_zeros``); a quantized module with no int4 home comes as
    ``X.weight`` dequantized (fp32); every other tensor as stored. ``keep_experts``: routed
    experts that can are kept too (hold_int4_experts), each expert's pieces coming as a
    linear's do."""
    from safetensors import SafetensorError, safe_open

    qc = config.quantization_config
    assert qc is not None and qc.is_int4
    header: dict[str, tuple[str, str, tuple[int, ...]]] = {}  # name -> (file, dtype, shape)
    for path in safetensors_files(folder):
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    sl = f.get_slice(name)
                    header[name] = (path, sl.get_dtype(), tuple(sl.get_shape()))
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"{path} is corrupt or not a safetensors file: {e}") from e
    modules = sorted(n.removesuffix(".qweight") for n in header if n.endswith(".qweight"))
    if not modules:
        raise ModelLoadError(f"{folder}: config.json says {qc.method} (int4) but no tensor is "
                             "a *.qweight")
    groups: dict[str, int] = {}
    for mod in modules:
        try:
            _, _, g, shapes = _expected(qc, header[mod + ".qweight"][2])
        except ValueError as e:
            raise ModelLoadError(f"{folder}: {mod}: {e}") from e
        if header[mod + ".qweight"][1] != "I32":
            raise ModelLoadError(f"{folder}: {mod}.qweight is {header[mod + '.qweight'][1]}, "
                                 "expected I32 (8 nibbles a word)")
        for part, shape in shapes.items():
            if mod + part not in header:
                raise ModelLoadError(f"{folder}: {mod}.qweight has no {mod}{part}")
            if header[mod + part][2] != shape:
                raise ModelLoadError(f"{folder}: {mod}{part} has shape "
                                     f"{list(header[mod + part][2])}, expected {list(shape)} "
                                     f"({qc.describe()})")
        if header[mod + ".scales"][1] not in _DTYPES:
            raise ModelLoadError(f"{folder}: {mod}.scales is {header[mod + '.scales'][1]}")
        groups[mod] = g

    # Which of our linears keep int4: all their pieces int4 in the file, and quantizable.
    mods_in = {m: m for m in (n.rsplit(".", 1)[0] for n in header if n.endswith((".weight", ".qweight")))}
    kept: set[str] = set()
    for m, mods in linears_of(model, mods_in).values():
        if not all(x in groups for x in mods):
            m.quantizable = False  # (partly) left 16-bit by the checkpoint: quantization="fp8" too
        elif m.quantizable:
            m.hold_int4(groups[mods[0]], _DTYPES[header[mods[0] + ".scales"][1]])
            kept.update(mods)
    if keep_experts:
        kept.update(hold_int4_experts(model, modules, header, qc))
    dequantized = sorted(set(modules) - kept)
    logger.info("%s checkpoint, %s: %d modules kept in int4, %d dequantized%s", qc.method,
                qc.describe(), len(kept), len(dequantized),
                f" ({', '.join(dequantized[:3])}{' ...' if len(dequantized) > 3 else ''})"
                if dequantized else "")
    return _stream(header, qc, set(modules), kept, model)


def _stream(header: dict[str, tuple[str, str, tuple[int, ...]]], qc: CheckpointQuantization,
            modules: set[str], kept: set[str],
            model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    handles: dict[str, Any] = {}  # one open file each: an MoE model has ~10^4 modules

    def read(name: str) -> torch.Tensor:
        path = header[name][0]
        try:
            if path not in handles:
                handles[path] = safe_open(path, framework="pt")
            return handles[path].get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"{path} is corrupt or not a safetensors file: {e}") from e

    device = next(p.device for p in model.parameters())
    for name in header:
        mod = name.rsplit(".", 1)[0]
        if mod in modules and name.endswith(_PARTS):
            if not name.endswith(".qweight"):
                continue  # read with the module's qweight
            to_layout = awq_to_layout if qc.method == "awq" else gptq_to_layout
            if qc.method == "gptq":
                k = header[name][2][0] * 8
                want = torch.arange(k, dtype=torch.int64) // (qc.group_size or k)
                if not torch.equal(read(mod + ".g_idx").to(torch.int64), want):
                    raise ModelLoadError(f"{header[name][0]}: {mod}.g_idx is not k // group_size "
                                         "(act-order / desc_act checkpoints are not read)")
            # repacked on the model's device (a GPU unpacks an 8B model's words in ~1 s)
            qweight, scales, zeros = to_layout(*(read(mod + part).to(device) for part in
                                                 (".qweight", ".qzeros", ".scales")))
            if mod in kept:
                yield mod + ".weight", qweight
                yield mod + ".w4_scales", scales
                yield mod + ".w4_zeros", zeros
            else:
                yield mod + ".weight", dequantize_int4_ref(qweight, scales, zeros)
            continue
        t = read(name)
        if name.endswith(".bias") and mod in modules and not t.any() and (
                _EXPERT.search(mod) is not None
                or ((hit := linear_of(model, mod)) is not None and hit[1].bias is None)):
            continue  # GPTQ writers store zero biases for linears that have none
        yield name, t
