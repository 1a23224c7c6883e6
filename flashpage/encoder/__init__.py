"""Encoder-only models: BERT / XLM-RoBERTa / ModernBERT / NomicBERT embedding models,
cross-encoder rerankers and classifiers (model.py, modernbert.py, nomic_bert.py).

Kept apart from the decoder engine (no KV cache, no scheduler, no Triton kernels): an
encoder reads each prompt whole, in one bidirectional forward, and keeps nothing after it.
``LLM(model=<encoder folder>)`` and ``flashpage serve`` build an ``EncoderEngine``
(engine.py) instead of an LLMEngine when config.json names an encoder (config.py).
"""

from __future__ import annotations

from flashpage.encoder.config import EncoderConfig, is_encoder_model

__all__ = ["EncoderConfig", "is_encoder_model"]
