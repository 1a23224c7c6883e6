"""Checkpoints whose weights are already fp8, read as vLLM reads them: no flag, the
config's ``quantization_config`` says so (parsed once: ``config.CheckpointQuantization``).

Every ``X.weight`` stored as float8_e4m3fn comes with ``X.weight_scale`` or
``X.weight_scale_inv`` (the same thing under DeepSeek's name: the factor that multiplies
the stored values back, W = scale * Wq). Our fp8 linears hold e4m3 rows with one fp32
scale per output row, or per tile for block-scaled files (layers/quant.py), so:

    scale in the file                 what the model holds
    []  or [1]     (strategy tensor)  Wq as stored, weight_scale [N] = the scale on every row
    [N] or [N, 1]  (strategy channel) Wq as stored, weight_scale [N] = the scale
    [N/bn, K/bk]   (strategy block)   Wq as stored, weight_scale [N/bn, K/bk] = the tiles'
                                      scales, weight_block (bn, bk): kernels/fp8_block_gemm

A merged linear (Llama's qkv_proj, gate_up_proj) takes each piece's rows with that
piece's own scale, so q, k and v under different per-tensor scales stay exact (vLLM
re-quantizes such a fused weight to the largest of its scales instead); block scales stack
along their N-block axis, which is exact only where every piece's rows are a multiple of
bn: a merged linear with a piece that is not (or blocks bk not a multiple of 16, which
the kernels' K tiles need: ``CheckpointQuantization.block_unsupported``) is dequantized
to the model's dtype instead, with a log line (quantization="fp8" then re-quantizes it
per row, as any 16-bit weight).

Kept in e4m3: a ``ColumnParallelLinear`` / ``RowParallelLinear`` left ``quantizable``
whose pieces are all e4m3 with a per-tensor, per-channel or (as above) block scale; and,
when the loader asks (``keep_experts``: the engine where the fused fp8 MoE kernel runs,
envs.fp8_moe), a layer's routed experts (``...experts.{e}.{gate,up,down}_proj.weight``,
DeepSeek's and Qwen's names) in 128 x 128 blocks, every one of them e4m3 in the file, with
hidden and expert intermediate sizes whole blocks: layers/moe.FusedExperts.hold_fp8 (e4m3
[E, 2I, H] and [E, H, I], each expert's tile scales stacked), run by
kernels/fused_moe_fp8.py. Everything else that the file holds in e4m3 (embeddings, the LM
head, MLA's kv_b_proj, the other MoE experts) is dequantized to the model's dtype. Linears
the file holds in 16 bits (the config's ignore list) stay so, with ``quantization="fp8"``
too.

A multimodal checkpoint's (Qwen3-VL / Qwen3-VL-MoE: config._vl_checkpoint_quantization)
weights are matched to the text model's linears and experts under their names as the text
model's (``model.language_model.`` -> ``model.``: multimodal.text_model_name); its tower's
e4m3 weights are left out of that stream and read by the image encoder's own pass
(``fp8_tower_weights``: dequantized, as our tower has no fp8 path).

Not read: ``input_scale`` (static activation scales): activations are quantized per token
at run time (W8A8 on the GPU), each token's scale from its own amax, which never clips
and rounds no coarser than one calibrated scale for all tokens; ``k_scale`` / ``v_scale``
(the fp8 KV cache is kept at scale 1); zero points, which symmetric checkpoints may store
as zeros (a non-zero one is an error).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from flashpage.config import CheckpointQuantization, ModelConfig
from flashpage.kernels.fp8_block_ref import dequantize_fp8_block
from flashpage.layers.linear import _ParallelLinear
from flashpage.layers.quant import FP8_DTYPE
from flashpage.models.loader import ModelLoadError, safetensors_files

logger = logging.getLogger("flashpage")

# Tensors beside the weights that are read by nobody (see the module's docstring).
UNUSED_SUFFIXES = (".input_scale", ".input_scale_ub", ".activation_scale", ".k_scale",
                   ".v_scale", ".kv_scale")
# HF projections that live in one of our merged linears (models/llama.py, deepseek.py).
MERGED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
          "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


@dataclass(frozen=True)
class _Fp8Tensor:
    scale_name: str
    shape: tuple[int, ...]


def dequantize_fp8_checkpoint(q: torch.Tensor, scale: torch.Tensor,
                              block: tuple[int, int] | None = None) -> torch.Tensor:
    """A stored e4m3 weight q [N, K] times its scale, in fp32: a scalar or one per row,
    or with ``block`` (bn, bk) one per tile, scale [ceil(N/bn), ceil(K/bk)] (edge tiles
    partial)."""
    s = scale.float()
    if block is not None:
        return dequantize_fp8_block(q, s, block)
    return q.float() * (s.reshape(-1, 1) if s.numel() > 1 else s.reshape(()))


def row_scales(name: str, shape: tuple[int, ...], scale: torch.Tensor,
               qc: CheckpointQuantization) -> torch.Tensor | None:
    """fp32 [N] for a weight of ``shape`` whose scale is per tensor or per channel; None
    for block scales. ModelLoadError when the scale's shape is not what the config says."""
    n = shape[0]
    if qc.weight_strategy == "block":
        assert qc.block_size is not None
        bn, bk = qc.block_size
        want = (-(-n // bn), -(-shape[1] // bk))
        if tuple(scale.shape) != want:
            raise ModelLoadError(f"{name}: block scales of shape {tuple(scale.shape)}, expected "
                                 f"{list(want)} for a {list(shape)} weight in {bn}x{bk} blocks")
        return None
    if qc.weight_strategy == "tensor":
        if scale.numel() != 1:
            raise ModelLoadError(f"{name}: scale of shape {tuple(scale.shape)}, expected one "
                                 f"value (per-tensor, as quantization_config says)")
        return scale.float().reshape(1).expand(n).clone()
    if tuple(scale.shape) not in ((n,), (n, 1)):
        raise ModelLoadError(f"{name}: scale of shape {tuple(scale.shape)}, expected [{n}, 1] "
                             f"(per-channel, as quantization_config says)")
    return scale.float().reshape(n).clone()


def linear_of(model: nn.Module, hf_module: str) -> tuple[str, _ParallelLinear] | None:
    """Our linear that holds the HF module's weight (itself, or the merged one its rows
    go into), or None (an embedding, the experts, a router ...). A family whose
    checkpoints name its modules otherwise (``hf_names``: GPT-NeoX, Phi) has them mapped."""
    if (names := getattr(model, "hf_names", None)) is not None:
        hf_module = names.to_ours(hf_module)
    parent, _, leaf = hf_module.rpartition(".")
    for path in (hf_module, f"{parent}.{MERGED[leaf]}" if leaf in MERGED else None):
        if path is None:
            continue
        try:
            m = model.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(m, _ParallelLinear):
            return path, m
    return None


def linears_of(model: nn.Module, keys: dict[str, str]
               ) -> dict[str, tuple[_ParallelLinear, list[str]]]:
    """Our linears the checkpoint's modules go into: {key: its HF module path} -> {our
    linear's path: (the linear, the keys whose modules it holds, in order)}."""
    out: dict[str, tuple[_ParallelLinear, list[str]]] = {}
    for key, hf_module in keys.items():
        if (hit := linear_of(model, hf_module)) is not None:
            out.setdefault(hit[0], (hit[1], []))[1].append(key)
    return out


def hold_fp8_experts(model: nn.Module, fp8: dict[str, _Fp8Tensor],
                     qc: CheckpointQuantization,
                     ours: Callable[[str], str | None] = lambda n: n) -> set[str]:
    """Turn the routed experts that can keep the file's block-fp8 weights to hold them
    (FusedExperts.hold_fp8); returns their weights' names in the file (each loads as
    stored, with its tile scales). ``ours``: a file name as the model's (None: not the
    model's; a multimodal checkpoint's tower)."""
    from flashpage.kernels.fp8_block_ref import EXPERT_BLOCK
    from flashpage.layers.moe import EXPERT_NAME, FusedExperts

    if qc.weight_strategy != "block" or qc.block_size != (EXPERT_BLOCK, EXPERT_BLOCK):
        return set()
    groups: dict[str, list[str]] = {}
    for name in fp8:
        mine = ours(name)
        if mine is not None and (m := EXPERT_NAME.match(mine)) is not None and m["kind"] == "weight":
            groups.setdefault(m["prefix"], []).append(name)
    held: set[str] = set()
    left: list[str] = []
    for prefix, names in groups.items():
        try:
            experts = model.get_submodule(prefix)
        except AttributeError:
            continue  # not ours to load (DeepSeek-V3's MTP layer: models/mtp.py)
        if not isinstance(experts, FusedExperts):
            continue
        why = experts.fp8_unsupported()
        if why is None and len(names) != 3 * experts.num_experts:
            why = "some of its experts' weights are not e4m3 in the file"
        if why is not None:
            left.append(f"{prefix} ({why})")
            continue
        experts.hold_fp8()
        held.update(names)
    if left:
        logger.warning("fp8 checkpoint: %d MoE layers' routed experts dequantized to 16 bits "
                       "instead of kept in e4m3: %s%s", len(left), left[0],
                       f" and {len(left) - 1} more" if len(left) > 1 else "")
    return held


def _model_names(config: ModelConfig) -> Callable[[str], str | None]:
    """A checkpoint tensor's name as the model's: a multimodal checkpoint's language model's
    renamed (models/multimodal.text_model_name; None for its tower's), else as it is."""
    if not config.multimodal_architecture:
        return lambda n: n
    from flashpage.models.multimodal import text_model_name

    return lambda n: text_model_name(n, config)


def _fp8_tensors(folder: str, files: list[str], keep: Callable[[str], bool] | None = None
                 ) -> tuple[dict[str, tuple[str, str, tuple[int, ...]]], dict[str, _Fp8Tensor]]:
    """The files' headers ({name: (file, dtype, shape)}) and their e4m3 weights with the
    name of each one's scale, of the tensors ``keep`` takes (all by default); a
    ModelLoadError names an fp8 tensor we cannot read (e5m2, not a ``.weight``, not 2-D,
    with no scale or two)."""
    from safetensors import safe_open

    header: dict[str, tuple[str, str, tuple[int, ...]]] = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                if keep is None or keep(name):
                    sl = f.get_slice(name)
                    header[name] = (path, sl.get_dtype(), tuple(sl.get_shape()))
    fp8: dict[str, _Fp8Tensor] = {}
    for name, (_, dtype, shape) in header.items():
        if dtype == "F8_E5M2" or (dtype == "F8_E4M3" and not name.endswith(".weight")):
            raise ModelLoadError(f"{folder}: tensor {name} is {dtype}; only *.weight tensors "
                                 "in float8_e4m3fn are read")
        if dtype != "F8_E4M3":
            continue
        if len(shape) != 2:
            raise ModelLoadError(f"{folder}: fp8 weight {name} has shape {list(shape)}; "
                                 "only [N, K] linears are read")
        found = [name + s for s in ("_scale", "_scale_inv") if name + s in header]
        if len(found) != 1:
            raise ModelLoadError(f"{folder}: fp8 weight {name} has "
                                 f"{'no scale' if not found else 'two scales'} "
                                 f"({name}_scale or {name}_scale_inv)")
        fp8[name] = _Fp8Tensor(found[0], shape)
    return header, fp8


def _read_scales(files: list[str], header: dict[str, tuple[str, str, tuple[int, ...]]],
                 fp8: dict[str, _Fp8Tensor]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    scales: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for t in fp8.values():
                if header[t.scale_name][0] == path:
                    scales[t.scale_name] = f.get_tensor(t.scale_name)
    return scales


def fp8_tower_weights(folder: str, qc: CheckpointQuantization, keep: Callable[[str], bool]
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors ``keep`` takes of an fp8 checkpoint (a Qwen3-VL's vision tower:
    models/qwen2_vl.load_image_encoder) as 16/32-bit ones: each e4m3 ``X.weight``
    dequantized (scale * value, fp32, its scale per tensor, row or tile as ``qc`` says),
    its scale and the unused activation scales not at all, every other tensor as stored.
    The published checkpoints leave their towers 16-bit (modules_to_not_convert /
    ignore); one that quantizes a tower's linears is read as the same model dequantized,
    which our tower's 16-bit linears run (the tower is a small part of the model's weights
    and of a request's work)."""
    files = safetensors_files(folder)
    header, fp8 = _fp8_tensors(folder, files, keep)
    scales = _read_scales(files, header, fp8)
    rows = {name: row_scales(name, t.shape, scales[t.scale_name], qc) for name, t in fp8.items()}
    if fp8:
        logger.info("fp8 checkpoint: %d vision tower weights stored in e4m3, dequantized at "
                    "load (%s%s)", len(fp8), ", ".join(sorted(fp8)[:2]), " ..." if len(fp8) > 2 else "")
    skip = {n for n in header if n.endswith(UNUSED_SUFFIXES)} | {t.scale_name for t in fp8.values()}
    return _stream([f for f in files if any(h[0] == f for h in header.values())], skip, fp8,
                   set(), rows, scales, qc.block_size, keep)


def fp8_checkpoint_weights(model: nn.Module, config: ModelConfig, folder: str,
                           keep_experts: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Prepare ``model`` for the fp8 checkpoint in ``folder`` and return its weights as
    ``load_weights`` takes them: the linears that keep e4m3 are turned to hold it now (an
    e4m3 ``weight`` and an fp32 ``weight_scale`` [N], or [N/bn, K/bk] for block scales, to
    fill), and each of their weights comes as (``X.weight`` e4m3, ``X.weight_scale`` fp32
    [rows] or the file's tiles); every other e4m3 weight
    comes dequantized (fp32), every other tensor as stored, the unused scales not at all.
    ``keep_experts``: block-fp8 routed experts that can are kept too (hold_fp8_experts), each
    expert's weight coming as stored with its ``X.weight_scale`` tiles.
    Shapes, scales and dtypes are checked from the files' headers before anything loads."""
    qc = config.quantization_config
    assert qc is not None
    files = safetensors_files(folder)
    ours = _model_names(config)
    header, fp8 = _fp8_tensors(folder, files)
    if not fp8:
        raise ModelLoadError(f"{folder}: config.json has a quantization_config ({qc.method}) "
                             "but no tensor is float8_e4m3fn")
    # a multimodal checkpoint's tower (not the text model's): read by its image encoder's
    # own pass (fp8_tower_weights), left out of this one
    tower: set[str] = set()
    if config.multimodal_architecture:
        from flashpage.models.multimodal import vision_prefixes

        tower = {n for n in fp8 if n.startswith(vision_prefixes(config))}
    for n in tower:
        del fp8[n]
    scales = _read_scales(files, header, fp8)
    rows = {name: row_scales(name, t.shape, scales[t.scale_name], qc) for name, t in fp8.items()}

    # Which of our linears keep e4m3: all their pieces in the file e4m3 with row scales, or
    # with block scales that stack (block_unsupported).
    kept: set[str] = set()
    unstacked: list[str] = []
    linears = linears_of(model, {n: mine[:-7] for n in header if n.endswith(".weight")
                                 and (mine := ours(n)) is not None})
    for path, (m, names) in linears.items():
        if not all(n in fp8 for n in names):
            m.quantizable = False  # (partly) left 16-bit by the checkpoint: quantization="fp8" too
        elif not m.quantizable:
            continue
        elif all(rows[n] is not None for n in names):
            m.hold_fp8()
            kept.update(names)
        elif qc.weight_strategy == "block":
            assert qc.block_size is not None
            why = qc.block_unsupported([(n[:-7], fp8[n].shape[0]) for n in names])
            hook = getattr(model, "fp8_block_unsupported", None)  # GPT-NeoX's regrouped rows
            if why is None and callable(hook):
                why = hook(str(ours(names[0]))[:-7], qc.block_size)
            if why is None:
                m.hold_fp8(qc.block_size)
                kept.update(names)
            else:
                unstacked.append(f"{path} ({why})")
    if keep_experts:
        kept.update(hold_fp8_experts(model, fp8, qc, ours))
    if unstacked:
        logger.warning("fp8 checkpoint: %d linears dequantized to 16 bits instead of kept in e4m3 "
                       "with their block scales: %s%s", len(unstacked), unstacked[0],
                       f" and {len(unstacked) - 1} more" if len(unstacked) > 1 else "")
    dequantized = sorted(set(fp8) - kept)
    logger.info("fp8 checkpoint, %s: %d weights kept in e4m3 with their scales, %d dequantized "
                "to %s%s", qc.describe(), len(kept), len(dequantized),
                str(next(p.dtype for p in model.parameters() if p.dtype != FP8_DTYPE)).replace(
                    "torch.", ""),
                f" ({', '.join(dequantized[:3])}{' ...' if len(dequantized) > 3 else ''})"
                if dequantized else "")
    unused = [n for n in header if n.endswith(UNUSED_SUFFIXES)]
    if unused:
        logger.info("fp8 checkpoint: %d static activation / KV scales not used (activations are "
                    "quantized per token at run time)", len(unused))
    skip = set(unused) | {t.scale_name for t in fp8.values()} | tower | {
        header_scale for n in tower for header_scale in (n + "_scale", n + "_scale_inv")}
    return _stream(files, skip, fp8, kept, rows, scales, qc.block_size)


def _stream(files: list[str], skip: set[str], fp8: dict[str, _Fp8Tensor], kept: set[str],
            rows: dict[str, torch.Tensor | None], scales: dict[str, torch.Tensor],
            block: tuple[int, int] | None, keep: Callable[[str], bool] | None = None
            ) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    for path in files:
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118
                    if name in skip or (keep is not None and not keep(name)):
                        continue
                    t = f.get_tensor(name)
                    if name.endswith("_zero_point"):  # symmetric checkpoints may store zeros
                        if t.any():
                            raise ModelLoadError(f"{path}: {name} is not zero (asymmetric fp8 "
                                                 "is not supported)")
                        continue
                    if name not in fp8:
                        yield name, t
                    elif name in kept:
                        r = rows[name]
                        yield name, t
                        yield name + "_scale", r if r is not None else scales[
                            fp8[name].scale_name].float()
                    else:
                        yield name, dequantize_fp8_checkpoint(
                            t, scales[fp8[name].scale_name], block if rows[name] is None else None)
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"{path} is corrupt or not a safetensors file: {e}") from e
