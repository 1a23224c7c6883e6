"""A checkpoint's multi-token-prediction (MTP) layer as a speculative draft (GLM-4.5's and
DeepSeek-V3's ``num_nextn_predict_layers``; DeepSeek-V3's design, its paper's section 2.2).

The layer sits after the model's last layer in the checkpoint (``model.layers.{N}.*``, N =
``num_hidden_layers``) and predicts the token after next. For position t, given the target's
final hidden state h_t and the token t + 1::

    x = eh_proj(concat(enorm(embed(tok[t + 1])), hnorm(h_t)))     embedding half first
    y = x + decoder_layer(x)                                      one layer of the model's own
    logits(tok[t + 2]) = lm_head(shared_head.norm(y))             kind (its own K/V cache)

h_t is what the target's lm_head reads (its last layer's output after the final norm: what
vLLM's and SGLang's MTP drafters are handed), the embedding at position 0 is zeroed (as vLLM
feeds it), and a further draft feeds y (before ``shared_head.norm``) as the next h with its
own proposed token. The embedding and the lm_head are the target's, unless the checkpoint
carries copies under the layer (``embed_tokens``, ``shared_head.head``) that differ from them.
Of several MTP layers only the first is used (the released GLM-4.5 / 4.6 and DeepSeek-V3
have one). DeepSeek-V3's layer attends with MLA over a latent cache of its own.

engine/mtp.py runs it; this module builds and loads it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from flashpage.attention.backend import AttentionMetadata
from flashpage.config import ConfigError, ModelConfig
from flashpage.layers.attention import Attention
from flashpage.layers.linear import ColumnParallelLinear, VocabEmbedding
from flashpage.layers.mla_attention import MLAAttention, MLARotaryEmbedding
from flashpage.layers.moe import SYNC_FREE_MAX_TOKENS
from flashpage.layers.norm import RMSNorm

if TYPE_CHECKING:
    from flashpage.models.loader import ModelSource

# the families whose MTP layers we load: GLM-4.5 / 4.6 (a layer of models/glm.py's) and
# DeepSeek-V3 / R1 (models/deepseek.py's MLA layer; V2 has none)
MTP_ARCHITECTURES = ("Glm4MoeForCausalLM", "DeepseekV3ForCausalLM")
_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")


def num_mtp_layers(config: ModelConfig) -> int:
    """The checkpoint's ``num_nextn_predict_layers`` (0 when absent)."""
    n = config.raw.get("num_nextn_predict_layers") or 0
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ConfigError(f"num_nextn_predict_layers must be an integer >= 0, got {n!r}")
    return n


def check_mtp_target(config: ModelConfig) -> None:
    """A ConfigError unless ``config``'s family has MTP layers we serve and the checkpoint
    says it holds one (speculative_config method "mtp")."""
    arch = config.architecture
    if arch not in MTP_ARCHITECTURES:
        raise ConfigError(f"speculative_config method 'mtp': {arch} has no multi-token-"
                          f"prediction layers (supported: {', '.join(MTP_ARCHITECTURES)})")
    if not num_mtp_layers(config):
        raise ConfigError("speculative_config method 'mtp': the checkpoint has no multi-token-"
                          "prediction layer (config.json's num_nextn_predict_layers is 0 or absent)")
    if config.quantization_config is not None:
        raise ConfigError("speculative_config method 'mtp': the MTP layer of a quantized "
                          "checkpoint (quantization_config) is not supported yet")


class HiddenStateDraft(nn.Module):
    """A draft layer fed the target's hidden states (engine/mtp.MTPRunner runs it): an MTP
    layer here, an EAGLE head (models/eagle.py). ``forward`` reads the previous hidden
    states from ``prev_hidden`` (set by the caller, engine/mtp.py: row i for input token i,
    [n, H]; rows past the forward's tokens are not read, so a CUDA graph's static buffer of
    its bucket's rows serves); ``from_target`` turns the target's kept states into them."""

    supports_cuda_graphs = True
    max_graph_tokens: int | None = None
    config: ModelConfig  # the layer's own shape (its K/V pool's)

    def __init__(self, target: nn.Module) -> None:
        super().__init__()
        self._target = [target]  # not a submodule: its weights are not this module's
        self.embed_tokens: nn.Module | None = None  # the checkpoint's own copy, if it differs
        self.prev_hidden: torch.Tensor | None = None

    def attention_layers(self) -> list[Attention | MLAAttention]:
        raise NotImplementedError

    def from_target(self, states: torch.Tensor) -> torch.Tensor:
        """The target's kept hidden states [n, *] -> the layer's ``prev_hidden`` [n, H]."""
        return states

    def _prev_rows(self, n: int) -> torch.Tensor:
        """The first ``n`` rows of ``prev_hidden``: a forward's n tokens' previous states."""
        prev = self.prev_hidden
        assert prev is not None and prev.shape[0] >= n, "prev_hidden: a row for each token"
        return prev[:n]

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            return cast(torch.Tensor, self.embed_tokens(input_ids))
        return cast(torch.Tensor, self._target[0].get_submodule("model.embed_tokens")(input_ids))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class MTPLayer(HiddenStateDraft):
    """One MTP layer over a target (its embedding and head shared unless the checkpoint has
    its own). ``forward`` returns y, before ``shared_head.norm``."""

    # Decode-shaped forwards are capturable, as the target's: the block's MoE runs sync-free
    # up to SYNC_FREE_MAX_TOKENS and MLA decode has static shapes (engine/mtp.MTPRunner's
    # graphs). Prompt-shaped ones (its catch-up graphs) too, but not with MLA (its prompt
    # path expands each request's latents to a host length: models/deepseek.py).
    max_graph_tokens = SYNC_FREE_MAX_TOKENS

    def __init__(self, config: ModelConfig, target: nn.Module, max_positions: int) -> None:
        super().__init__(target)
        h, eps = config.hidden_size, config.rms_norm_eps
        self.config = config
        self.index = config.num_hidden_layers  # its layer number in the checkpoint
        self.enorm = RMSNorm(h, eps)
        self.hnorm = RMSNorm(h, eps)
        self.eh_proj = ColumnParallelLinear(2 * h, h, bias=False)
        self.shared_head_norm = RMSNorm(h, eps)
        # the model's own layer at the MTP layer's index (a MoE layer in both families)
        self.block: nn.Module
        if config.is_mla:  # DeepSeek-V3: its rotary module is the target's (no parameters)
            from flashpage.models.deepseek import DeepseekDecoderLayer

            self.block = DeepseekDecoderLayer(config, self.index, cast(
                MLARotaryEmbedding, target.get_submodule("model.rotary_emb")))
        else:
            from flashpage.models.glm import _LAYERS

            self.block = _LAYERS[config.architecture](config, self.index, max_positions)
        self.head: nn.Module | None = None  # the checkpoint's own copy, if it differs

    @property
    def supports_prefill_graphs(self) -> bool:
        return not self.config.is_mla

    def attention_layers(self) -> list[Attention | MLAAttention]:
        attn = self.block.self_attn  # MLA's is the attention layer itself
        return [cast(Attention | MLAAttention, getattr(attn, "attn", attn))]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                md: AttentionMetadata) -> torch.Tensor:
        prev = self._prev_rows(input_ids.shape[0])
        e = self._embed(input_ids)
        e = e.masked_fill((positions == 0)[:, None], 0)
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(prev)], dim=-1))
        out, residual = self.block(positions, x, None, md)
        return out + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        normed = self.shared_head_norm(hidden)
        head = self.head if self.head is not None else self._target[0].get_submodule("lm_head")
        return cast(torch.Tensor, head(normed))


def _mtp_tensors(path: str, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors whose names start with ``prefix``, read alone (not the
    whole checkpoint)."""
    from safetensors import safe_open

    from flashpage.models.loader import safetensors_files

    for file in safetensors_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                if name.startswith(prefix):
                    yield name, f.get_tensor(name)


def load_mtp(source: ModelSource, target: nn.Module, dtype: torch.dtype, device: torch.device,
             max_positions: int, seed: int = 0) -> MTPLayer:
    """The first MTP layer of ``source`` (random for a random source), in ``dtype`` on
    ``device``, over ``target`` (the loaded model); a ConfigError names what is missing."""
    from flashpage.models.deepseek import DeepseekForCausalLM
    from flashpage.models.glm import GlmForCausalLM
    from flashpage.models.loader import init_random_

    config = source.config
    check_mtp_target(config)
    if source.kind == "gguf":
        raise ConfigError("speculative_config method 'mtp': a GGUF file's MTP layer is not read")
    with torch.device(device):
        mtp = MTPLayer(config, target, max_positions)
    mtp.to(dtype)
    if source.kind == "random":
        init_random_(mtp, seed + 1)
        return mtp.eval()
    assert source.path is not None
    prefix = f"model.layers.{mtp.index}."
    own: dict[str, torch.Tensor] = {}
    block: list[tuple[str, torch.Tensor]] = []
    for name, t in _mtp_tensors(source.path, prefix):
        rest = name[len(prefix):]
        if rest.startswith(_OWN):
            own[rest] = t
        else:
            block.append((name, t))
    if not own and not block:
        raise ConfigError(f"speculative_config method 'mtp': {source.path} holds no tensors of the "
                          f"MTP layer ({prefix}*), though num_nextn_predict_layers is "
                          f"{num_mtp_layers(config)}")
    with torch.no_grad():
        missing = []
        for ours, hf in (("enorm.weight", "enorm.weight"), ("hnorm.weight", "hnorm.weight"),
                         ("eh_proj.weight", "eh_proj.weight"),
                         ("shared_head_norm.weight", "shared_head.norm.weight")):
            param = mtp.get_parameter(ours)
            if hf not in own:
                missing.append(prefix + hf)
            elif tuple(own[hf].shape) != tuple(param.shape):
                raise ConfigError(f"{prefix}{hf}: checkpoint shape {tuple(own[hf].shape)} != "
                                  f"{tuple(param.shape)}")
            else:
                param.copy_(own[hf])
        shared: list[tuple[str, torch.Tensor, str]] = [
            ("embed_tokens.weight", cast(torch.Tensor, target.get_parameter("model.embed_tokens.weight")),
             "embed_tokens"),
            ("shared_head.head.weight", cast(torch.Tensor, target.get_parameter("lm_head.weight")), "head")]
        for hf, mine, attr in shared:
            copy = own.get(hf)
            if copy is None or (copy.shape == mine.shape and torch.equal(copy.to(mine), mine)):
                continue  # the target's (shared)
            if tuple(copy.shape) != tuple(mine.shape):
                raise ConfigError(f"{prefix}{hf}: checkpoint shape {tuple(copy.shape)} != the target's "
                                  f"{tuple(mine.shape)}")
            with torch.device(device):
                m: nn.Module = (VocabEmbedding(mine.shape[0], mine.shape[1]) if attr == "embed_tokens"
                                else ColumnParallelLinear(mine.shape[1], mine.shape[0], bias=False))
            m.to(dtype)
            cast(torch.Tensor, m.weight).copy_(copy)
            setattr(mtp, attr, m)
        # the decoder layer through the family's own loading (merged q/k/v and gate/up, the
        # experts, the routers' correction biases), on a stand-in holding just this layer
        family: type[nn.Module] = DeepseekForCausalLM if config.is_mla else GlmForCausalLM
        loader: Any = family.__new__(family)
        nn.Module.__init__(loader)
        loader.config = replace(config, num_hidden_layers=mtp.index + 1)
        stack = nn.Module()
        stack.layers = nn.ModuleDict({str(mtp.index): mtp.block})
        loader.model = stack  # type: ignore[assignment]
        try:
            loaded = loader.load_weights(iter(block))
        except ValueError as e:
            raise ConfigError(f"speculative_config method 'mtp': {e}") from None
        expected = {prefix + n for n in mtp.block.state_dict() if "rotary_emb." not in n}
        pieces: Any = getattr(loader, "_pieces", lambda name: [])
        gone = sorted({n for n in expected - loaded if not pieces(n)}
                      | set(getattr(loader, "missing_pieces", [])))
        missing += gone
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ConfigError(f"speculative_config method 'mtp': {source.path}: {len(missing)} weight(s) "
                          f"of the MTP layer missing from the checkpoint: {shown}")
    return mtp.eval()


def keep_final_hidden(model: nn.Module, rows: int, dtype: torch.dtype,
                      device: torch.device, method: str = "mtp") -> torch.Tensor:
    """Have ``model``'s decoder stack copy each forward's final hidden states into one
    buffer of ``rows`` rows (models/common.DecoderStack.hidden_out: a static buffer, so CUDA
    graphs captured after this write it at each replay); returns the buffer."""
    stack = getattr(model, "model", None)
    if stack is None or not hasattr(stack, "hidden_out"):
        raise ConfigError(f"speculative_config method {method!r}: {type(model).__name__} does not hand "
                          "back its final hidden states")
    config = cast(ModelConfig, model.config)
    buf = torch.zeros(rows, config.hidden_size, dtype=dtype, device=device)
    stack.hidden_out = buf
    return buf


__all__ = ["MTP_ARCHITECTURES", "HiddenStateDraft", "MTPLayer", "check_mtp_target", "keep_final_hidden", "load_mtp",
           "num_mtp_layers"]
