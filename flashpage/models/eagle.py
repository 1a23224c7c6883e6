"""EAGLE draft heads for Llama-body targets, dense or MoE, 16-bit or quantized (vLLM's
``{"method": "eagle", "model": PATH}`` and ``{"method": "eagle3", "model": PATH}``): a
separate small checkpoint holding one Llama decoder layer that reads the target's hidden
states and the next token's embedding.

EAGLE-1 (Li et al. 2024; e.g. yuhuili/EAGLE-LLaMA3-Instruct-8B). For position p, given the
target's hidden state h_p and the token p + 1::

    x = fc(concat(embed(tok[p + 1]), h_p))          Linear(2H -> H), bias where the checkpoint has one
    r = x + attn(input_layernorm(x))                the layer's input_layernorm: identity (absent
    y = r + mlp(post_attention_layernorm(r))          from the original checkpoints; used if present)
    logits(tok[p + 2]) = lm_head(norm(y))           the target's lm_head; ``norm`` only where the
                                                    checkpoint holds norm.weight (identity otherwise)

h_p is the target's last hidden state AFTER its final norm (what its lm_head reads): the
EAGLE authors' code hands the draft the base model's ``model(...)`` output, which ends with
the norm, and vLLM hands its EAGLE drafters the same. A further draft feeds y back as h.

EAGLE-3 (Li et al. 2025; e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B). The target hands over
three of its residual-stream states (pre-norm: the INPUT of layers ``aux_layers``, by
default (2, L // 2, L - 3) of L layers, as the EAGLE-3 authors' code and vLLM collect them;
a checkpoint may name its own in ``eagle_config.eagle_aux_hidden_state_layer_ids``)::

    g = fc(concat(a_2, a_{L//2}, a_{L-3}))         Linear(3H -> H), no bias; later drafts: g = y
    z = concat(input_layernorm(embed(tok[p + 1])), hidden_norm(g))      2H wide
    r = g + attn(z)                                 q/k/v_proj read 2H columns
    y = r + mlp(post_attention_layernorm(r))        y (pre-norm) is fed back as the next g
    logits = lm_head(norm(y))                       its own lm_head over draft_vocab_size ids;
                                                    draft id i is target id i + d2t[i]

The draft's logits are scattered into the target's vocabulary (-1e4 elsewhere: never drawn
nor picked while a draft-vocabulary token is allowed), so the picking and verifying code
sees target ids. ``t2d`` (a boolean mask over the target's ids)
is read only to check its shape. The embedding is the target's unless the checkpoint holds
a different ``embed_tokens.weight``.

Tensor names: EAGLE-1's ``fc.weight`` / ``fc.bias``, ``layers.0.*`` (HF Llama names inside),
optional ``norm.weight``; EAGLE-3's ``fc.weight``, ``midlayer.*`` (or ``layers.0.*``) with
``midlayer.hidden_norm.weight``, ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``. A
leading ``model.`` is dropped. Weights come from ``*.safetensors`` or ``pytorch_model.bin``.

engine/eagle.py runs it (engine/mtp.py's runner and proposer); this module builds and loads it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, cast

import torch
from torch import nn

from flashpage.attention.backend import AttentionMetadata
from flashpage.config import ConfigError, ModelConfig, read_config_json
from flashpage.layers.attention import Attention
from flashpage.layers.linear import ColumnParallelLinear, VocabEmbedding
from flashpage.layers.mla_attention import MLAAttention
from flashpage.layers.norm import RMSNorm
from flashpage.models.mtp import HiddenStateDraft
from flashpage.models.registry import served_by

EAGLE_METHODS = ("eagle", "eagle3")
# targets of the Llama body (models/llama.LlamaModel, dense or MoE: Mixtral, Qwen2-MoE,
# Qwen3-MoE, ...), whose residual stream DecoderStack hands over; the head reads hidden states
# only, so a target's quantized linears (fp8, AWQ / GPTQ int4; its embedding and LM head stay
# 16-bit) change nothing for it
EAGLE_TARGETS = served_by("flashpage.models.llama", "LlamaForCausalLM")
_OWN = ("fc.", "norm.", "lm_head.", "embed_tokens.", "d2t", "t2d")
_OUTSIDE = -1e4  # EAGLE-3: the logit of a target id outside the draft vocabulary


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low / middle / high layers of an ``num_layers``-layer target: the inputs of
    layers 2, L // 2 and L - 3 (the EAGLE-3 authors' and vLLM's choice)."""
    return (2, num_layers // 2, num_layers - 3)


@dataclass(frozen=True)
class EagleSpec:
    """What an EAGLE checkpoint's config.json says, read once: ``config`` is its Llama
    layer's (a ModelConfig of one layer), ``draft_vocab`` EAGLE-3's reduced vocabulary,
    ``aux_layers`` the target layers EAGLE-3 reads (empty for EAGLE-1)."""

    method: str
    path: str
    config: ModelConfig
    draft_vocab: int
    aux_layers: tuple[int, ...]
    fc_bias: bool | None  # the config's "bias" (EAGLE-1); None: whatever the checkpoint holds


def _where(method: str) -> str:
    return f"speculative_config method {method!r}"


def check_eagle_target(method: str, target: ModelConfig) -> None:
    """A ConfigError unless ``target`` is a Llama-body model EAGLE drafts for."""
    if target.architecture not in EAGLE_TARGETS or target.is_mla:
        raise ConfigError(f"{_where(method)}: the target is {target.architecture}; EAGLE drafts are "
                          f"served for Llama-body targets ({', '.join(EAGLE_TARGETS)})")


def read_eagle_spec(method: str, path: str, target: ModelConfig) -> EagleSpec:
    """The EAGLE checkpoint at ``path`` (a folder with config.json) for ``target``; a
    ConfigError names what does not fit (a hidden size other than the target's, more than
    one layer, aux layers outside the target)."""
    where = _where(method)
    check_eagle_target(method, target)
    try:
        cfg_path, d = read_config_json(os.path.join(path, "config.json"))
    except ConfigError as e:
        raise ConfigError(f"{where}: the draft folder {path!r}: {e}") from None
    if d.get("hidden_size") != target.hidden_size:
        raise ConfigError(f"{where}: the draft's hidden_size {d.get('hidden_size')!r} differs from "
                          f"the target's {target.hidden_size}")
    th = d.get("target_hidden_size")
    if th is not None and th != target.hidden_size:
        raise ConfigError(f"{where}: the draft's target_hidden_size {th!r} differs from the target's "
                          f"hidden_size {target.hidden_size}")
    layers = d.get("num_hidden_layers", 1)
    if layers != 1:
        raise ConfigError(f"{where}: the draft has num_hidden_layers {layers!r}; EAGLE heads of one "
                          "decoder layer are served")
    vocab = d.get("vocab_size") or target.vocab_size
    if vocab != target.vocab_size:
        raise ConfigError(f"{where}: the draft's vocab_size {vocab!r} differs from the target's "
                          f"{target.vocab_size}")
    layer_cfg = {k: v for k, v in d.items() if k not in ("architectures", "model_type",
                                                         "quantization_config", "auto_map")}
    layer_cfg.update(architectures=["LlamaForCausalLM"], num_hidden_layers=1, vocab_size=vocab,
                     tie_word_embeddings=False)
    layer_cfg.setdefault("intermediate_size", target.intermediate_size)
    layer_cfg.setdefault("num_attention_heads", target.num_attention_heads)
    try:
        config = ModelConfig.from_hf(layer_cfg)
    except ConfigError as e:
        raise ConfigError(f"{where}: {cfg_path}: {e}") from None
    draft_vocab = d.get("draft_vocab_size") or vocab
    if not isinstance(draft_vocab, int) or not 0 < draft_vocab <= vocab:
        raise ConfigError(f"{where}: draft_vocab_size {draft_vocab!r} must be an integer in 1 .. "
                          f"{vocab} (the target's vocabulary)")
    aux: tuple[int, ...] = ()
    if method == "eagle3":
        ids = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") \
            or d.get("eagle_aux_hidden_state_layer_ids")
        n = target.num_hidden_layers
        aux = tuple(ids) if ids else default_aux_layers(n)
        if len(aux) != 3 or not all(isinstance(i, int) and 0 <= i < n for i in aux):
            raise ConfigError(f"{where}: EAGLE-3 reads three target layers in 0 .. {n - 1}; got "
                              f"{list(aux)} (a target of {n} layers needs at least 4)")
    elif draft_vocab != vocab:
        raise ConfigError(f"{where}: draft_vocab_size {draft_vocab} with method 'eagle': a reduced "
                          "draft vocabulary is EAGLE-3's: use method 'eagle3'")
    bias = d.get("bias")
    return EagleSpec(method, path, config, draft_vocab, aux,
                     bias if isinstance(bias, bool) else None)


class EagleLayer(HiddenStateDraft):
    """An EAGLE-1 or EAGLE-3 head over a target (module doc). ``forward`` reads the previous
    hidden states from ``prev_hidden`` ([n, H]: the target's, through ``from_target``, or
    the head's own y) and returns y, before ``norm``; ``compute_logits`` gives logits over
    the target's vocabulary."""

    supports_cuda_graphs = True
    supports_prefill_graphs = True

    def __init__(self, spec: EagleSpec, target: nn.Module, max_positions: int) -> None:
        super().__init__(target)
        from flashpage.models.llama import LlamaDecoderLayer

        c = spec.config
        h = c.hidden_size
        self.spec, self.config = spec, c
        self.eagle3 = spec.method == "eagle3"
        # EAGLE-3's fc reads the three aux states; EAGLE-1's the embedding and the hidden state
        self.fc = ColumnParallelLinear((3 if self.eagle3 else 2) * h, h,
                                       bias=not self.eagle3 and spec.fc_bias is not False)
        self.block = LlamaDecoderLayer(c, 0, max_positions)
        attn = self.block.self_attn
        if self.eagle3:  # q/k/v read concat(embedding, hidden): 2H columns
            attn.qkv_proj = ColumnParallelLinear(
                2 * h, (attn.num_heads + 2 * attn.num_kv_heads) * attn.head_dim, bias=c.attention_bias)
            self.block.hidden_norm = RMSNorm(h, c.rms_norm_eps)
        self.norm: RMSNorm | None = RMSNorm(h, c.rms_norm_eps)  # None: EAGLE-1 without one
        self.input_norm = True  # False: EAGLE-1 without layers.0.input_layernorm (identity)
        self.lm_head: nn.Module | None = None  # EAGLE-3's own (None: the target's)
        # draft id -> target id (EAGLE-3's reduced vocabulary; None: the same ids)
        self.draft_to_target: torch.Tensor | None = None

    def attention_layers(self) -> list[Attention | MLAAttention]:
        return [self.block.self_attn.attn]

    def from_target(self, states: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, self.fc(states)) if self.eagle3 else states

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                md: AttentionMetadata) -> torch.Tensor:
        prev = self._prev_rows(input_ids.shape[0])
        e = self._embed(input_ids)
        b = self.block
        if self.eagle3:
            residual = prev
            hidden_norm = cast(RMSNorm, b.get_submodule("hidden_norm"))
            z = torch.cat([b.input_layernorm(e), hidden_norm(prev)], dim=-1)
        else:
            residual = self.fc(torch.cat([e, prev], dim=-1))
            z = b.input_layernorm(residual) if self.input_norm else residual
        x, residual = b.post_attention_layernorm(b.self_attn(positions, z, md), residual)
        return cast(torch.Tensor, b.mlp(x)) + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.norm is not None:
            hidden = self.norm(hidden)
        head = self.lm_head if self.lm_head is not None else self._target[0].get_submodule("lm_head")
        logits = cast(torch.Tensor, head(hidden))
        d2t = self.draft_to_target
        if d2t is None:
            return logits
        # outside the draft vocabulary: a logit no real one comes near (exp underflows to 0)
        # but finite, so a row whose every draft-vocabulary token a structured-outputs
        # pattern masks still has a distribution (over what the pattern allows)
        full = logits.new_full((logits.shape[0], self.spec.config.vocab_size), _OUTSIDE)
        return full.index_copy_(1, d2t, logits)


def checkpoint_tensors(path: str, where: str) -> Iterator[tuple[str, torch.Tensor]]:
    """A head checkpoint's tensors (an EAGLE head's, Medusa heads': models/medusa.py): its
    safetensors, else its pytorch_model.bin; a ConfigError prefixed ``where`` if neither."""
    from safetensors import safe_open

    from flashpage.models.loader import ModelLoadError, safetensors_files

    try:
        files = safetensors_files(path)
    except ModelLoadError:
        binary = os.path.join(path, "pytorch_model.bin")
        if not os.path.isfile(binary):
            raise ConfigError(f"{where}: no *.safetensors nor pytorch_model.bin in {path!r}") from None
        yield from torch.load(binary, map_location="cpu", weights_only=True).items()
        return
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                yield name, f.get_tensor(name)


def _our_name(name: str) -> str:
    name = name.removeprefix("model.")
    return "layers.0." + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name


def load_eagle(spec: EagleSpec, target: nn.Module, dtype: torch.dtype, device: torch.device,
               max_positions: int) -> EagleLayer:
    """The EAGLE head of ``spec`` in ``dtype`` on ``device`` over ``target`` (the loaded
    Llama-family model); a ConfigError names a missing, misplaced or misshapen tensor."""
    from flashpage.models.llama import LlamaForCausalLM, LlamaModel

    where = _where(spec.method)
    if not isinstance(target, LlamaForCausalLM) or type(target.model) is not LlamaModel:
        raise ConfigError(f"{where}: the target ({type(target).__name__}) is not of the Llama body")
    own: dict[str, torch.Tensor] = {}
    block: list[tuple[str, torch.Tensor]] = []
    for name, t in checkpoint_tensors(spec.path, where):
        ours = _our_name(name)
        if ours.startswith("layers.0."):
            block.append(("model." + ours, t))
        elif ours.startswith(_OWN):
            own[ours] = t
        elif ours.startswith("layers."):
            raise ConfigError(f"{where}: {name}: EAGLE heads of one decoder layer are served")
        else:
            raise ConfigError(f"{where}: checkpoint tensor {name!r} has no place in an EAGLE head")
    if spec.method == "eagle" and ("d2t" in own or any(".hidden_norm." in n for n, _ in block)):
        raise ConfigError(f"{where}: {spec.path} is an EAGLE-3 checkpoint (d2t / hidden_norm): use "
                          "method 'eagle3'")
    if spec.method == "eagle3" and "fc.weight" in own and own["fc.weight"].shape[-1] != 3 * spec.config.hidden_size:
        raise ConfigError(f"{where}: fc.weight {tuple(own['fc.weight'].shape)} does not read three "
                          f"hidden states of {spec.config.hidden_size}: an EAGLE-1 checkpoint? (method 'eagle')")
    if spec.fc_bias is None and spec.method == "eagle":
        spec = replace(spec, fc_bias="fc.bias" in own)
    with torch.device(device):
        layer = EagleLayer(spec, target, max_positions)
    layer.to(dtype)
    missing: list[str] = []
    with torch.no_grad():
        def put(param: torch.Tensor, name: str) -> None:
            t = own.get(name)
            if t is None:
                missing.append(name)
            elif tuple(t.shape) != tuple(param.shape):
                raise ConfigError(f"{where}: {name}: checkpoint shape {tuple(t.shape)} != "
                                  f"{tuple(param.shape)}")
            else:
                param.copy_(t)

        put(layer.fc.weight, "fc.weight")
        if layer.fc.bias is not None:
            put(layer.fc.bias, "fc.bias")
        if "norm.weight" in own or layer.eagle3:
            assert layer.norm is not None
            put(layer.norm.weight, "norm.weight")
        else:
            layer.norm = None
        embed = cast(torch.Tensor, target.get_parameter("model.embed_tokens.weight"))
        copy = own.get("embed_tokens.weight")
        if copy is not None and not (copy.shape == embed.shape and torch.equal(copy.to(embed), embed)):
            if tuple(copy.shape) != tuple(embed.shape):
                raise ConfigError(f"{where}: embed_tokens.weight: checkpoint shape {tuple(copy.shape)} "
                                  f"!= the target's {tuple(embed.shape)}")
            with torch.device(device):
                layer.embed_tokens = VocabEmbedding(embed.shape[0], embed.shape[1])
            layer.embed_tokens.to(dtype).weight.copy_(copy)
        if layer.eagle3:
            _load_vocab(layer, own, spec, where, dtype, device, missing)
        elif "lm_head.weight" in own:  # an EAGLE-1 head's own copy: used where it differs
            head = cast(torch.Tensor, target.get_parameter("lm_head.weight"))
            copy = own["lm_head.weight"]
            if tuple(copy.shape) != tuple(head.shape):
                raise ConfigError(f"{where}: lm_head.weight: checkpoint shape {tuple(copy.shape)} != "
                                  f"the target's {tuple(head.shape)}")
            if not torch.equal(copy.to(head), head):
                with torch.device(device):
                    layer.lm_head = ColumnParallelLinear(head.shape[1], head.shape[0], bias=False)
                cast(torch.Tensor, layer.lm_head.to(dtype).weight).copy_(copy)
        unused = sorted(set(own) - {"fc.weight", "norm.weight", "embed_tokens.weight", "lm_head.weight",
                                    "d2t", "t2d"} - ({"fc.bias"} if layer.fc.bias is not None else set()))
        if unused:
            raise ConfigError(f"{where}: checkpoint tensor(s) {', '.join(unused)} have no place in the "
                              f"EAGLE head (config.json's bias: {spec.fc_bias})")
        # the decoder layer through the Llama family's loading (merged q/k/v and gate/up), on
        # a stand-in holding just this layer
        loader: Any = LlamaForCausalLM.__new__(LlamaForCausalLM)
        nn.Module.__init__(loader)
        loader.config = spec.config
        stack = nn.Module()
        stack.layers = nn.ModuleList([layer.block])
        loader.model = stack
        try:
            loaded = loader.load_weights(iter(block))
        except ValueError as e:
            raise ConfigError(f"{where}: {e}") from None
        expected = {"model.layers.0." + n for n in layer.block.state_dict() if "rotary_emb." not in n}
        if not layer.eagle3 and "model.layers.0.input_layernorm.weight" not in loaded:
            layer.input_norm = False  # the original EAGLE-1 layer has none: identity
            expected.discard("model.layers.0.input_layernorm.weight")
        gone = sorted({n for n in expected - loaded if not loader._pieces(n)} | set(loader.missing_pieces))
        missing += [n.removeprefix("model.") for n in gone]
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ConfigError(f"{where}: {spec.path}: {len(missing)} weight(s) of the EAGLE head missing "
                          f"from the checkpoint: {shown}")
    return layer.eval()


def _load_vocab(layer: EagleLayer, own: dict[str, torch.Tensor], spec: EagleSpec, where: str,
                dtype: torch.dtype, device: torch.device, missing: list[str]) -> None:
    """EAGLE-3's lm_head over its draft vocabulary and d2t (draft id -> target id offset)."""
    h, n, vocab = spec.config.hidden_size, spec.draft_vocab, spec.config.vocab_size
    head = own.get("lm_head.weight")
    if head is None:
        if n != vocab:
            missing.append("lm_head.weight")
        return  # the target's head over the same ids
    if tuple(head.shape) != (n, h):
        raise ConfigError(f"{where}: lm_head.weight: checkpoint shape {tuple(head.shape)} != "
                          f"(draft_vocab_size {n}, hidden_size {h})")
    with torch.device(device):
        lm_head = ColumnParallelLinear(h, n, bias=False)
    lm_head.to(dtype).weight.copy_(head)
    layer.lm_head = lm_head
    d2t = own.get("d2t")
    if d2t is None:
        if n != vocab:
            missing.append("d2t")
        return
    if tuple(d2t.shape) != (n,) or d2t.dtype.is_floating_point:
        raise ConfigError(f"{where}: d2t: checkpoint shape {tuple(d2t.shape)} {d2t.dtype}; want "
                          f"({n},) integers (draft id -> target id offset)")
    ids = torch.arange(n, dtype=torch.int64) + d2t.to(torch.int64)
    if int(ids.min()) < 0 or int(ids.max()) >= vocab or ids.unique().numel() != n:
        raise ConfigError(f"{where}: d2t maps draft ids outside the target's {vocab} ids or two onto one")
    t2d = own.get("t2d")
    if t2d is not None and tuple(t2d.shape) != (vocab,):
        raise ConfigError(f"{where}: t2d: checkpoint shape {tuple(t2d.shape)} != ({vocab},)")
    if not torch.equal(ids, torch.arange(vocab)):
        layer.draft_to_target = ids.to(device)


def keep_aux_hidden(model: nn.Module, layers: tuple[int, ...], rows: int, dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor:
    """Have ``model``'s decoder stack copy, at each forward, the residual stream entering
    each of ``layers`` side by side into one buffer [rows, len(layers) * H]
    (models/common.DecoderStack.aux_out: static, so CUDA graphs captured after this write
    it); returns the buffer."""
    stack = getattr(model, "model", None)
    if stack is None or not hasattr(stack, "aux_out"):
        raise ConfigError(f"speculative_config method 'eagle3': {type(model).__name__} does not hand "
                          "back its intermediate hidden states")
    config = cast(ModelConfig, model.config)
    buf = torch.zeros(rows, len(layers) * config.hidden_size, dtype=dtype, device=device)
    stack.aux_layers = tuple(layers)
    stack.aux_out = buf
    return buf


__all__ = ["EAGLE_METHODS", "EAGLE_TARGETS", "EagleLayer", "EagleSpec", "check_eagle_target",
           "default_aux_layers", "keep_aux_hidden", "load_eagle", "read_eagle_spec"]
