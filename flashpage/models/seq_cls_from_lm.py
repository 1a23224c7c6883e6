"""A sequence classifier's ``score`` head made at load from a causal LM's head: vLLM's
``hf_overrides`` recipe for rerankers that are language models answering "yes" or "no".

Qwen3-Reranker is a Qwen3ForCausalLM whose relevance is P("yes") over the two tokens
[no, yes] at the prompt's last token. Served with ``hf_overrides={"architectures":
["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
"is_original_qwen3_reranker": True}``, its ``score`` is one label::

    score.weight = lm_head[id("yes")] - lm_head[id("no")]        [1, hidden]
    sigmoid(h . score.weight) = softmax(h . lm_head[[no, yes]])[yes]

(method "from_2_way_softmax"). With method "no_post_processing" each listed token is one
label, its LM head row (bge-reranker-v2-gemma's ["Yes"]: sigmoid of that logit). The
LM head is ``lm_head.weight``, or ``model.embed_tokens.weight`` where the embeddings are
tied. The prompt template (Qwen3-Reranker's instruction prompt) is the user's to apply.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from flashpage.config import ModelConfig
from flashpage.models.loader import ModelLoadError


def classifier_token_ids(tokenizer: Any | None, tokens: tuple[str, ...]) -> list[int]:
    """The vocabulary id of each of ``tokens``: a vocabulary entry's own id (vLLM looks them
    up with convert_tokens_to_ids, so "Ġyes" works too), else the text's encoding, which must
    be exactly one token."""
    if tokenizer is None:
        raise ModelLoadError(
            f"classifier_from_token {list(tokens)} needs the model's tokenizer (it has none; "
            "pass tokenizer=)")
    ids = []
    vocab = tokenizer.get_vocab()
    for t in tokens:
        if t in vocab:
            ids.append(int(vocab[t]))
            continue
        enc = [int(i) for i in tokenizer.encode(t, add_special_tokens=False)]
        if len(enc) != 1:
            raise ModelLoadError(
                f"classifier_from_token {t!r} is {len(enc)} tokens {enc} in this tokenizer; "
                "each must be exactly one token")
        ids.append(enc[0])
    return ids


def score_from_lm_head(weights: Iterable[tuple[str, torch.Tensor]], config: ModelConfig,
                       token_ids: list[int] | None, where: str) -> Iterator[tuple[str, torch.Tensor]]:
    """A classifier's checkpoint weights, with ``score.weight`` built from the LM head's
    rows at ``token_ids`` (config.classifier_method) when ``token_ids`` is given; the LM
    head itself is dropped. Without ``token_ids``, an LM head in the checkpoint is a
    ModelLoadError naming the fix (the checkpoint is a causal LM)."""
    head: torch.Tensor | None = None
    embed: torch.Tensor | None = None
    for name, t in weights:
        if name == "lm_head.weight":
            if token_ids is None:
                raise ModelLoadError(
                    f"{where}: the checkpoint is a causal LM (it holds lm_head.weight, no "
                    f"score.weight) but {config.architecture} needs score.weight; to build it "
                    "from the LM head's rows pass hf_overrides with classifier_from_token, "
                    'e.g. {"classifier_from_token": ["no", "yes"], "method": "from_2_way_softmax"}')
            head = t
            continue
        if name == "score.weight" and token_ids is not None:
            raise ModelLoadError(
                f"{where}: the checkpoint has its own score.weight; classifier_from_token "
                "would replace it (drop it from hf_overrides)")
        if name == "model.embed_tokens.weight":
            embed = t
        yield name, t
    if token_ids is None:
        return
    if head is None and config.tie_word_embeddings:
        head = embed
    if head is None:
        raise ModelLoadError(
            f"{where}: classifier_from_token needs the LM head (lm_head.weight, or tied "
            "embeddings) and the checkpoint has neither")
    rows = head[token_ids].float()
    if config.classifier_method == "from_2_way_softmax":
        yield "score.weight", (rows[1] - rows[0])[None]
    else:
        yield "score.weight", rows
