"""Speculative decoding with an EAGLE head (vLLM's ``{"method": "eagle", "model": PATH}`` and
``{"method": "eagle3", "model": PATH}``, Llama-body targets, dense or MoE, 16-bit or
quantized; the head: models/eagle.py).

An EAGLE head is run exactly as an MTP layer is (engine/mtp.py): the entry at position p
reads the target's hidden state(s) at p and the token p + 1 and predicts token p + 2; it
keeps a paged K/V pool of its one attention layer indexed by the target's block ids; each
step's ``MTPProposer.fill`` catches it up on the positions the target's last step computed
(held ones under async scheduling), drafts 1 from its entry at T - 2, and drafts 2 .. k from
single-token forwards fed its own output hidden state and the last draft; CUDA graphs of
its own through ``MTPRunner`` (DraftRunner's decode and catch-up graphs). What differs:

- the target's states kept: EAGLE-1 reads its final hidden states after the final norm
  (``DecoderStack.hidden_out``, as MTP); EAGLE-3 the residual stream entering three layers
  (``DecoderStack.aux_out``, [rows, 3H]), projected to one by the head's ``fc``
  (``EagleLayer.from_target``) before each catch-up forward, eagerly;
- the head's shape is its own checkpoint's (its pool and attention backend are sized by its
  config: LLMEngine builds the proposer with engine/mtp.build_mtp_proposer), its lm_head
  EAGLE-3's own over a reduced vocabulary mapped back to the target's ids (``d2t``).

A target without EAGLE runs its stack's plain loop: nothing is kept.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from flashpage.config import ModelConfig
from flashpage.engine.spec_decode import SpeculativeConfig

if TYPE_CHECKING:
    from flashpage.models.eagle import EagleLayer


def load_eagle_head(config: SpeculativeConfig, target_config: ModelConfig, model: torch.nn.Module,
                    dtype: torch.dtype, device: torch.device, max_positions: int, rows: int
                    ) -> tuple[EagleLayer, torch.Tensor]:
    """The EAGLE head of ``config`` over the loaded ``model``, and the buffer of ``rows``
    rows the target's forwards keep the states it reads in (set before any CUDA graph is
    captured, so the graphs write it); a ConfigError names what does not fit."""
    from flashpage.models.eagle import keep_aux_hidden, load_eagle, read_eagle_spec
    from flashpage.models.mtp import keep_final_hidden

    assert config.model is not None
    spec = read_eagle_spec(config.method, config.model, target_config)
    head = load_eagle(spec, model, dtype, device, max_positions)
    if spec.aux_layers:
        states = keep_aux_hidden(model, spec.aux_layers, rows, dtype, device)
    else:
        states = keep_final_hidden(model, rows, dtype, device, method=config.method)
    return head, states


__all__ = ["load_eagle_head"]
