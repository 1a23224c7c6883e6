"""flashpage: a small LLM inference and serving engine built around paged attention."""

from __future__ import annotations

from flashpage.sampling_params import (
    BeamSearchParams,
    GuidedDecodingParams,
    SamplingParams,
    StructuredOutputsParams,
)

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "StructuredOutputsParams", "GuidedDecodingParams",
           "PoolingParams", "RequestOutput", "CompletionOutput", "LoRARequest", "__version__"]


def __getattr__(name: str):  # lazy: importing flashpage must not load torch models
    if name == "LLM":
        from flashpage.llm import LLM

        return LLM
    if name == "LoRARequest":
        from flashpage.lora.request import LoRARequest

        return LoRARequest
    if name == "PoolingParams":
        from flashpage.pooling import PoolingParams

        return PoolingParams
    if name in ("RequestOutput", "CompletionOutput"):
        from flashpage import outputs

        return getattr(outputs, name)
    raise AttributeError(name)
