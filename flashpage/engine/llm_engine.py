"""LLMEngine: requests in, one scheduler step and one forward pass per ``step()``, outputs out.

``add_request`` validates and tokenizes (a bad request raises ValueError naming the
problem, and nothing else is touched); ``step`` schedules, runs the model, samples,
detokenizes, applies stop strings and returns a RequestOutput for every request that
changed. ``n > 1`` is handled as n child requests sharing the prompt's cached blocks.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from flashpage import envs
from flashpage.attention.backend import AttentionBackend
from flashpage.attention.registry import backend_reasons, select_backend
from flashpage.config import (
    ConfigError,
    EngineConfig,
    ModelConfig,
    QwenVisionConfig,
    dtype_bytes,
    request_mm_processing,
    resolve_kv_cache_dtype,
    with_mm_processor_kwargs,
)
from flashpage.engine import cumem
from flashpage.engine.cuda_graph import PREFILL_MAX_TOKENS
from flashpage.engine.cumem import CuMemPool
from flashpage.engine.draft_model import DraftRunner, build_draft_proposer, check_draft_config
from flashpage.engine.encoder_cache import EncoderCache
from flashpage.engine.kv_offload import KVOffloader
from flashpage.engine.medusa import build_medusa_proposer, load_medusa_heads
from flashpage.engine.model_runner import ModelRunner
from flashpage.engine.mtp import build_mtp_proposer, mtp_kv_bytes_per_token
from flashpage.engine.multimodal import (
    MultiModalInput,
    chain_digest,
    check_limits,
    count_items,
    enc_token_name,
)
from flashpage.engine.output import ChildRequest, ParentRequest, child_params
from flashpage.engine.prompt_embeds import EMBEDS_PLACEHOLDER_ID, check_prompt_embeds, digest
from flashpage.engine.sampler import PendingSample, needs_known_tokens
from flashpage.engine.scheduler import Scheduler, check_priority
from flashpage.engine.sequence import Request, RequestStatus, prompt_text_and_ids
from flashpage.engine.sleep import EngineBusyError, EngineSleepingError, SleepState, check_tags
from flashpage.engine.spec_decode import NgramProposer, SpecStats, SpeculativeConfig, unpack_checked
from flashpage.engine.tokenizer import IncrementalDetokenizer, load_tokenizer
from flashpage.generation_config import load_generation_defaults
from flashpage.kv_cache.hybrid import GroupLayout, HybridKVCacheManager, group_layers
from flashpage.kv_cache.kv_cache_manager import KVCacheManager
from flashpage.layers import ops
from flashpage.layers.linear import set_row_gemv, tune_skinny_gemms
from flashpage.layers.moe import set_fused_moe
from flashpage.layers.quant import moe_kernel_keeps, quantized_linears
from flashpage.lora.request import LoRARequest
from flashpage.models.loader import (
    ModelLoadError,
    ModelSource,
    adapt_weights,
    check_loaded,
    checkpoint_weights,
    init_random_,
    load_model,
    resolve_model,
)
from flashpage.outputs import RequestMetrics, RequestOutput
from flashpage.pooling import PoolingParams, PoolingState, pooling_type_of
from flashpage.sampling_params import SamplingParams, StructuredOutputsError

if TYPE_CHECKING:
    from flashpage.lora.manager import LoRAManager
    from flashpage.models.gemma3_vision import Gemma3ImageEncoder
    from flashpage.models.idefics3 import Idefics3ImageEncoder
    from flashpage.models.internvl import InternVLImageEncoder
    from flashpage.models.llava import LlavaImageEncoder
    from flashpage.models.medusa import MedusaHeads
    from flashpage.models.mtp import HiddenStateDraft
    from flashpage.models.pixtral import PixtralImageEncoder
    from flashpage.models.qwen2_audio import Qwen2AudioEncoder
    from flashpage.models.qwen2_vl import QwenImageEncoder
    from flashpage.structured.compiler import GuideCompiler
    from flashpage.structured.guide import CompiledGuide

logger = logging.getLogger("flashpage")

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
           "fp16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16}


def resolve_device(device: str) -> torch.device:
    """A device with an index for CUDA ("cuda" -> "cuda:N", the current one): other
    threads (the server's engine loop) must select exactly this device."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device 'cuda' requested but no CUDA GPU is available")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use auto, float32, float16 or bfloat16")
    return _DTYPES[dtype]


@dataclass
class _Inflight:
    """A launched step: the requests that get a token, in the sampler's row order."""

    requests: list[Request]
    pending: PendingSample


class LLMEngine:
    def __init__(self, config: EngineConfig, *, random_config: str | None = None,
                 tokenizer: str | None = None) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        torch.manual_seed(config.seed)
        t0 = time.perf_counter()
        self.source: ModelSource = resolve_model(config.model, random_config, config.hf_overrides)
        if config.mm_processor_kwargs:  # vLLM's: the image processor's settings overridden
            self.source = replace(self.source, config=with_mm_processor_kwargs(
                self.source.config, config.mm_processor_kwargs))
        # a classifier reads its last token, as HF's *ForSequenceClassification (its folder's
        # sentence-transformers Pooling, if it had one, is not what its head was trained on)
        default_pooling = "last" if self.source.config.is_classifier else pooling_type_of(
            self.source.path if self.source.kind == "hf" else None)
        self.pooling_type = config.pooling_type or default_pooling
        self.model_config: ModelConfig = self.source.config
        mc = self.model_config
        self.generation_defaults = load_generation_defaults(
            config.generation_config, self.source.path if self.source.kind == "hf" else None,
            config.override_generation_config)
        if self.generation_defaults.sampling or self.generation_defaults.max_tokens:
            logger.info("sampling defaults from %s: %s (--generation-config vllm: none)",
                        self.generation_defaults.source or "override_generation_config",
                        self.generation_defaults.sampling_kwargs())
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        self.skinny_report: dict[str, Any] = {}
        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        backend_cls, why = select_backend(config.attention_backend, mc, self.device, self.dtype,
                                          kv_cache_dtype=self.kv_dtype)
        logger.info("attention backend: %s", why)
        self.backend_name = backend_cls.name
        # before the model: a classifier made from a causal LM's head (hf_overrides'
        # classifier_from_token) needs its tokens' ids to build its score head
        self.tokenizer = load_tokenizer(self.source, tokenizer, config.trust_remote_code)
        token_ids = None
        if mc.classifier_from_token and self.source.kind != "random":
            from flashpage.models.seq_cls_from_lm import classifier_token_ids

            token_ids = classifier_token_ids(self.tokenizer, mc.classifier_from_token)
        self._classifier_token_ids = token_ids  # reload_weights builds score from them again
        fused_moe = (backend_cls.name == "triton" and self.device.type == "cuda"
                     and envs.fused_moe())
        # an MXFP4 checkpoint's experts stay MXFP4 where the fused MoE kernel reads them
        mxfp4_kernel = mc.mxfp4_experts and (
            envs.mxfp4() == "kernel" or (envs.mxfp4() == "auto" and fused_moe))
        if mc.mxfp4_experts:
            logger.info("MXFP4 experts: %s", "kept in MXFP4 for the fused MoE kernel"
                        if mxfp4_kernel else f"dequantized to {self.dtype} at load")
        # a block-fp8 checkpoint's routed experts stay e4m3 where the fused fp8 MoE kernel
        # reads them (models/fp8_checkpoint.py decides per layer: whole 128-blocks)
        fp8_moe_kernel = moe_kernel_keeps("fp8", self.device, fused_moe)
        # an AWQ / GPTQ checkpoint's routed experts stay packed where the fused int4 MoE
        # kernel reads them (models/int4_checkpoint.py decides per layer); the same two
        # choices decide whether online quantization quantizes a 16-bit model's experts
        int4_moe_kernel = moe_kernel_keeps("int4", self.device, fused_moe)
        # sleep mode's fixed-address memory (engine/cumem.py): the weights and the KV cache
        # made in it, so that sleep keeps the CUDA graphs
        self._cumem: CuMemPool | None = None
        if config.enable_sleep_mode and self.device.type == "cuda" and envs.sleep_fixed_addresses():
            if cumem.available():
                self._cumem = CuMemPool(self.device)
            else:
                logger.info("sleep mode: no pluggable CUDA allocator in this torch; the CUDA "
                            "graphs are captured again on each wake_up")
        with self._cumem.use("weights") if self._cumem is not None else nullcontext():
            self.model = load_model(self.source, self.dtype, self.device,
                                    max_positions=self.max_model_len, seed=config.seed,
                                    quantization=config.quantization, classifier_token_ids=token_ids,
                                    mxfp4_kernel=mxfp4_kernel, fp8_moe_kernel=fp8_moe_kernel,
                                    int4_moe_kernel=int4_moe_kernel)
        # a model's multimodal encoder (engine/multimodal.py): LLaVA's CLIP tower and
        # projector (models/llava.py), Qwen2-VL's (models/qwen2_vl.py), a Pixtral tower's
        # (models/pixtral.py), Gemma 3's, InternVL's (models/internvl.py) or Idefics3's /
        # SmolVLM's (models/idefics3.py), before the KV
        # cache takes what memory is left
        self.mm_encoder: LlavaImageEncoder | QwenImageEncoder | PixtralImageEncoder | Gemma3ImageEncoder \
            | InternVLImageEncoder | Idefics3ImageEncoder | Qwen2AudioEncoder | None = None
        self.mm_limits = check_limits(config.limit_mm_per_prompt)
        # Qwen2-VL / Qwen2.5-VL / Qwen3-VL, LLaVA-OneVision, InternVL and SmolVLM2 take videos too;
        # Qwen2-Audio takes audio
        takes: tuple[str, ...]
        if mc.audio is not None:
            takes = ("audio",)
        elif isinstance(mc.vision, QwenVisionConfig) or getattr(mc.vision, "takes_video", False):
            takes = ("image", "video")
        else:
            takes = ("image", "video") if getattr(mc.vision, "video_token_id", None) is not None \
                else ("image",)
        encoded = mc.vision is not None or mc.audio is not None
        if encoded and all(self.mm_limits.get(k) == 0 for k in takes):
            logger.info("limit_mm_per_prompt allows no %s: %s is served as its text model alone "
                        "(its %s not loaded)", " nor ".join(takes), mc.multimodal_architecture,
                        "audio encoder" if mc.audio is not None else "vision tower")
        elif encoded:  # its module's load_image_encoder (models/multimodal.IMAGE_MODULES)
            import importlib

            from flashpage.models.multimodal import image_module

            name = image_module(mc)
            loader = importlib.import_module(f"flashpage.models.{name}").load_image_encoder
            # a Pixtral tower reads its break / end rows from the text model's embedding
            text = (self.model,) if name == "pixtral" else ()
            self.mm_encoder = loader(self.source, self.dtype, self.device, *text, config.seed)
            if hasattr(self.mm_encoder, "tokenize") and self.tokenizer is not None:
                tok = self.tokenizer  # Qwen3-VL's video timestamps, Gemma 3's pan-and-scan text
                self.mm_encoder.tokenize = lambda text: list(tok.encode(text, add_special_tokens=False))
        if self.mm_encoder is not None and not getattr(self.model, "supports_prompt_embeds", False):
            raise ConfigError(f"{mc.multimodal_architecture}: its text model "
                              f"({mc.architecture}) takes no input embeddings, which its "
                              "images' (audio's) rows are (engine/multimodal.py)")
        if config.enable_prompt_embeds and not getattr(self.model, "supports_prompt_embeds", False):
            raise ConfigError(f"enable_prompt_embeds: {mc.architecture}'s forward does not take "
                              "input embeddings (engine/prompt_embeds.py lists the families that do)")
        # Our fused kernels (norms, SiLU·mul, rotary + cache write) go with our attention.
        ops.set_fused_ops(self.model, backend_cls.name == "triton")
        self.spec_config = SpeculativeConfig.parse(config.speculative_config)
        if config.enable_sleep_mode and (mc.vision is not None or mc.audio is not None):
            raise ValueError("enable_sleep_mode with an image model (LLaVA, Qwen2-VL, Gemma 3) or an audio "
                             "model (Qwen2-Audio) is not supported yet (its encoder's memory is not released)")
        if config.enable_sleep_mode and self.spec_config is not None:
            raise ValueError("enable_sleep_mode with speculative_config is not supported yet (a "
                             "draft's weights and KV pool are not released): drop one of them")
        if self.spec_config is not None and mc.is_classifier:
            raise ValueError(f"speculative_config: this model ({mc.architecture}) is a sequence "
                             "classifier; it does not generate, so it has nothing to speculate")
        self.draft: tuple[ModelSource, torch.nn.Module, type[AttentionBackend]] | None = None
        if self.spec_config is not None and self.spec_config.method == "draft_model":
            self.draft = self._load_draft(self.spec_config)
        # the checkpoint's multi-token-prediction layer as the draft (engine/mtp.py), or an
        # EAGLE head run the same way (engine/eagle.py): a draft layer fed the target's
        # hidden states, kept in mtp_hidden
        self.mtp: HiddenStateDraft | None = None
        self.mtp_hidden: torch.Tensor | None = None
        if self.spec_config is not None and self.spec_config.method == "mtp":
            self.mtp, self.mtp_hidden = self._load_mtp(backend_cls.name == "triton")
        elif self.spec_config is not None and self.spec_config.method in ("eagle", "eagle3"):
            self.mtp, self.mtp_hidden = self._load_eagle(backend_cls.name == "triton")
        # Medusa heads (engine/medusa.py): read the target's final hidden states too (kept
        # in mtp_hidden), but run no forward of a draft layer and keep no K/V pool
        self.medusa: MedusaHeads | None = None
        if self.spec_config is not None and self.spec_config.method == "medusa":
            self.medusa, self.mtp_hidden = self._load_medusa()
        set_fused_moe(self.model, fused_moe)
        if self.mtp is not None:
            set_fused_moe(self.mtp, fused_moe)
        # LoRA slots (flashpage/lora/): on the device before the KV cache takes what is left
        self.lora: LoRAManager | None = None
        if config.enable_lora:
            from flashpage.lora.manager import LoRAManager

            # in sleep mode's fixed-address memory they sleep with the weights (level 2 too:
            # they are no parameter of the model, so their bytes are kept)
            with self._cumem.use("weights") if self._cumem is not None else nullcontext():
                self.lora = LoRAManager(self.model, config.max_loras, config.max_lora_rank,
                                        max(config.max_num_batched_tokens, config.max_num_seqs),
                                        self.device, self.dtype)
        if config.chat_template is not None:
            self._set_chat_template(config.chat_template)
        self.eos_token_ids = self._eos_ids()
        # A window every attention layer shares (the draft's too): blocks behind it go back
        # to the pool as requests advance (kv_cache_manager), so a request holds about
        # window / block_size + 1 of them.
        self.release_window, slack = self._release_window()
        # Layers mixing one window with full attention (Gemma 2/3, Cohere2, GPT-OSS, ...):
        # KV cache groups, each its own tables over one pool (kv_cache/hybrid.py)
        self.kv_layout = self._kv_groups()
        self.num_blocks = config.num_gpu_blocks or self._num_blocks()
        self.kv_manager: KVCacheManager | HybridKVCacheManager
        if self.kv_layout is not None:
            self.kv_manager = HybridKVCacheManager(self.num_blocks, config.block_size,
                                                   config.enable_prefix_caching, self.kv_layout.windows,
                                                   self.kv_layout.chunks)
        else:
            self.kv_manager = KVCacheManager(self.num_blocks, config.block_size,
                                             config.enable_prefix_caching,
                                             sliding_window=self.release_window, window_slack=slack)
        kv = self.kv_manager
        if config.max_model_len is None and kv.max_blocks_held(
                self.max_model_len, config.max_num_batched_tokens) > kv.num_usable_blocks:
            capacity = kv.num_usable_blocks * config.block_size
            logger.info("max_model_len lowered from %d to %d: what the KV cache holds",
                        self.max_model_len, capacity)
            self.max_model_len = capacity
        self.scheduler = Scheduler(config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, self.kv_manager,
                                   watermark=config.kv_watermark,
                                   max_loras=config.max_loras if config.enable_lora else 0,
                                   policy=config.scheduling_policy,
                                   long_prefill_token_threshold=config.long_prefill_token_threshold)
        backend = backend_cls(mc, self.device, self.dtype)
        pool = self._cumem
        self.runner = ModelRunner(self.model, mc, backend, self.kv_manager, self.num_blocks,
                                  config.block_size, self.device, self.dtype, self.kv_dtype,
                                  layout=self.kv_layout,
                                  kv_memory=(lambda: pool.use("kv_cache")) if pool is not None else None)
        self.runner.lora = self.lora
        self.runner.mm_encoder = self.mm_encoder
        self.runner.mm_encode_rows = self.config.max_num_batched_tokens
        enc: Any = self.mm_encoder
        if hasattr(enc, "max_rows"):  # Gemma 3's crops: refused before they are resized
            enc.max_rows = self.max_model_len
        if self.mm_encoder is not None and self._encoder_cache_rows():
            self.runner.encoder_cache = EncoderCache(self._encoder_cache_rows())
        # KV cache offloading (engine/kv_offload.py): a host tier behind the prefix cache,
        # attached once the draft's pool (if any) exists: a host block holds both
        self.offload: KVOffloader | None = None
        if config.kv_offloading_size:
            self._check_offloading()
        # Decode-batch GEMMs: ours where it beats cuBLAS (fp8: W8A8) on this GPU (timed now,
        # before the graphs capture whichever is chosen); only beside our fused kernels.
        # (fp8: quantization="fp8", or an fp8 checkpoint's e4m3 weights kept as they are)
        fp8 = bool(quantized_linears(self.model))
        if (self.device.type == "cuda" and backend_cls.name == "triton"
                and envs.skinny_gemm(default=fp8) and self.dtype in (torch.float16, torch.bfloat16)):
            t1 = time.perf_counter()
            rows = (1, 2, 4, 8, 16) if fp8 else (1, 2, 4, 8)
            self.skinny_report = tune_skinny_gemms(
                self.model, tuple(b for b in rows if b <= config.max_num_seqs), dtype=self.dtype)
            logger.info("decode GEMMs timed against cuBLAS in %.1fs", time.perf_counter() - t1)
        # One-row linears may take our GEMV (FLASHPAGE_GEMV, read when graphs are captured).
        set_row_gemv(self.model, self.device.type == "cuda" and backend_cls.name == "triton")
        self._prompt_graph_backend = backend_cls.supports_prefill_graphs
        self._recapture_graphs = False  # sleep mode dropped the graphs; wake_up captures again
        if (self.device.type == "cuda" and backend_cls.supports_cuda_graphs
                and getattr(self.model, "supports_cuda_graphs", True) and not config.enforce_eager):
            self._capture_graphs(backend_cls.supports_prefill_graphs)
        self._children: dict[str, ChildRequest] = {}
        self._parents: dict[str, ParentRequest] = {}
        self._counter = 0
        self.async_scheduling = (self.device.type == "cuda" if config.async_scheduling is None
                                 else config.async_scheduling)
        # speculative decoding (engine/spec_decode.py): a step's drafts come from the last
        # step's tokens, so while a request drafts (its drafting not backed off) a step is
        # read back before the next is scheduled; otherwise scheduling stays asynchronous
        self.proposer: NgramProposer | None = None
        if self.draft is not None:  # engine/draft_model.py
            assert self.spec_config is not None
            source, model, draft_backend = self.draft
            assert isinstance(self.kv_manager, KVCacheManager)  # no KV cache groups with a draft
            self.proposer = build_draft_proposer(
                self.spec_config, source, mc, model, draft_backend(source.config, self.device, self.dtype),
                self.kv_manager, self.num_blocks, config.block_size, self.device, self.kv_dtype,
                self.max_model_len)
            if (self.device.type == "cuda" and not config.enforce_eager and draft_backend.supports_cuda_graphs
                    and getattr(model, "supports_cuda_graphs", True)):
                self._capture_draft_graphs(self.proposer.runner)
        elif self.mtp is not None:  # engine/mtp.py (an EAGLE head: engine/eagle.py)
            assert self.spec_config is not None and self.mtp_hidden is not None
            assert isinstance(self.kv_manager, KVCacheManager)  # no KV cache groups with a draft
            layer_cfg = self.mtp.config  # the layer's own shape (an MTP layer's: the target's)
            self.proposer = build_mtp_proposer(
                self.spec_config, self.mtp, mc, self.runner, self.mtp_hidden,
                backend_cls(layer_cfg, self.device, self.dtype), self.kv_manager, self.num_blocks,
                config.block_size, self.device, self.kv_dtype, self.max_model_len)
            if (self.device.type == "cuda" and not config.enforce_eager and backend_cls.supports_cuda_graphs
                    and getattr(self.mtp, "supports_cuda_graphs", True)):
                self._capture_draft_graphs(self.proposer.runner, "MTP layer" if self.spec_config.method
                                           == "mtp" else "EAGLE head")
        elif self.medusa is not None:  # engine/medusa.py: the heads run eagerly, no graphs of their own
            assert self.spec_config is not None and self.mtp_hidden is not None
            self.proposer = build_medusa_proposer(self.spec_config, self.medusa, self.runner,
                                                  self.mtp_hidden, self.max_model_len)
        elif self.spec_config is not None:
            self.proposer = NgramProposer(self.spec_config, self.max_model_len)
        if config.kv_offloading_size:
            self._attach_offloading(config.kv_offloading_size)
        self._inflight: _Inflight | None = None  # the launched step not yet read back
        self._sync_ids: set[str] = set()  # requests whose sampling needs every token known
        self._guides: GuideCompiler | None = None  # structured outputs, built on first use
        # sleep mode (engine/sleep.py): the storages of the weights and of the KV cache
        self.sleep_state = SleepState(self.model, self.runner.kv_caches, self.device, self._cumem) \
            if config.enable_sleep_mode else None
        if self.device.type == "cuda":
            t1 = time.perf_counter()
            self.warm_up()
            logger.info("warmed up (kernels compiled) in %.1fs", time.perf_counter() - t1)
        logger.info("loaded %s (%s, %s) on %s in %.1fs; KV cache: %d blocks of %d tokens (%s)",
                    mc.architecture, mc.attention_kind, str(self.dtype).replace("torch.", ""),
                    self.device, time.perf_counter() - t0, self.num_blocks, config.block_size,
                    str(self.kv_dtype).replace("torch.", ""))

    def _capture_graphs(self, backend_prompt_graphs: bool) -> None:
        """CUDA graphs (engine/cuda_graph.py): decode-only steps; where the backend's prompt
        path and the model's are sync-free (not MLA's context expansion nor the MoE's prompt
        path), short prompt-only steps whole and the other steps of up to 1024 tokens in
        pieces around attention. Each kind logged with its time and the memory it reserved."""
        cfg, runner = self.config, self.runner
        prompt_graphs = backend_prompt_graphs and getattr(self.model, "supports_prefill_graphs", True)
        pieces_mode = envs.piecewise_graphs()
        piecewise = backend_prompt_graphs and pieces_mode != "off" and (
            getattr(self.model, "supports_piecewise_graphs", True) or pieces_mode == "all")
        spec_k = self.spec_config.num_speculative_tokens if self.spec_config is not None else 0
        max_tokens = min(cfg.max_num_batched_tokens, self.max_model_len,
                         getattr(self.model, "max_graph_tokens", None) or 1 << 30)
        # (name, capture, what turns the kind off if its capture fails: None = fatal)
        kinds: list[tuple[str, Callable[[], None], str | None]] = []
        # A sequence classifier's requests are all pooling ones: every step reads hidden
        # states, which the decode and prompt-only graphs do not hand back (and it never
        # decodes); the piecewise graphs alone serve it.
        whole_step_graphs = not self.model_config.is_classifier
        if whole_step_graphs:
            kinds.append(("decode", lambda: runner.capture_decode_graphs(
                min(cfg.max_num_seqs, 512), self.max_model_len), None))
        if whole_step_graphs and prompt_graphs and envs.prefill_graphs():
            kinds.append(("prompt-only (up to 4 requests)",
                          lambda: runner.capture_prefill_graphs(max_tokens, self.max_model_len,
                                                                rows_per_seq=1 + spec_k),
                          "prefill_graphs"))
        if piecewise:
            kinds.append(("piecewise (attention eager)",
                          lambda: runner.capture_piecewise_graphs(max_tokens), "piecewise"))
        for name, capture, attr in kinds:
            # torch.cuda.graph empties the allocator's cache as it starts; empty it first so the
            # figure is what the graphs keep, not minus the profile run's freed blocks
            torch.cuda.empty_cache()
            t0, m0 = time.perf_counter(), torch.cuda.memory_reserved(self.device)
            try:
                capture()
                torch.cuda.synchronize(self.device)
            except Exception as e:
                if attr is None:
                    raise
                # the newer graph kinds: a failed capture leaves their steps eager, not the engine down
                setattr(runner, attr, None)
                logger.warning("%s CUDA graphs off (their steps run eagerly): capture failed: %s", name, e)
                continue
            logger.info("captured %s CUDA graphs in %.1fs (%.0f MiB reserved)", name,
                        time.perf_counter() - t0, (torch.cuda.memory_reserved(self.device) - m0) / 2**20)

    def _capture_draft_graphs(self, runner: DraftRunner | None, name: str = "draft model") -> None:
        """Decode graphs for the draft's single-token forwards (a draft model's,
        engine/draft_model.py, or the MTP layer's, engine/mtp.py: ``name``), at the target's
        batch buckets and in its graphs' pool; then, where the draft's prompt path is
        sync-free, graphs of its catch-ups of up to 1 + k tokens a request. A failed capture
        leaves the draft eager (the catch-up graphs' alone its catch-ups), with a warning."""
        assert runner is not None
        pool = self.runner.graphs.pool if self.runner.graphs is not None else None
        max_bs = min(self.config.max_num_seqs, 512)
        torch.cuda.empty_cache()
        t0, m0 = time.perf_counter(), torch.cuda.memory_reserved(self.device)
        try:
            pool = runner.capture_graphs(max_bs, self.max_model_len, pool)
            torch.cuda.synchronize(self.device)
        except Exception as e:
            runner.graphs = None
            logger.warning("%s CUDA graphs off (the draft runs eagerly): capture failed: %s", name, e)
            return
        logger.info("captured %s decode CUDA graphs in %.1fs (%.0f MiB reserved)",
                    name, time.perf_counter() - t0, (torch.cuda.memory_reserved(self.device) - m0) / 2**20)
        if not (runner.backend.supports_prefill_graphs and getattr(runner.model, "supports_prefill_graphs", True)):
            return
        k = self.spec_config.num_speculative_tokens if self.spec_config is not None else 1
        torch.cuda.empty_cache()
        t0, m0 = time.perf_counter(), torch.cuda.memory_reserved(self.device)
        try:
            runner.capture_catchup_graphs(max_bs, self.max_model_len, 1 + k, pool)
            torch.cuda.synchronize(self.device)
        except Exception as e:
            runner.catchup = None
            logger.warning("%s catch-up CUDA graphs off (its catch-ups of several tokens "
                           "a request run eagerly): capture failed: %s", name, e)
            return
        logger.info("captured %s catch-up CUDA graphs in %.1fs (%.0f MiB reserved)",
                    name, time.perf_counter() - t0, (torch.cuda.memory_reserved(self.device) - m0) / 2**20)

    def placeholder_token_ids(self) -> set[int]:
        """An image model's placeholder ids (its image / video tokens and their markers): a
        prompt holding one needs its image, so made-up prompts (warm_up's, the benchmarks'
        random ids) leave them out. Empty for a text model."""
        enc = self.mm_encoder
        if enc is None:
            return set()
        vc = enc.config
        ids = {getattr(vc, "image_token_id", None), *getattr(enc, "placeholder_ids", ())}
        for name in ("video_token_id", "boi_token_id", "eoi_token_id", "vision_start_token_id",
                     "vision_end_token_id", "audio_token_id", "audio_bos_token_id", "audio_eos_token_id"):
            ids.add(getattr(vc, name, None))
        return {i for i in ids if isinstance(i, int)}

    def warm_up(self) -> None:
        """Run a few throwaway requests so the kernels of every step kind compile now, not
        inside the first users' time to first token: prompts alone, decodes (graphs), a
        chunk beside decodes, a prompt over a cached prefix, a prompt step of the whole token
        budget; each step kind with a token count that is a multiple of 16 and one that is not (Triton specializes integer
        arguments on divisibility by 16 and compiles each case apart). Leaves no trace:
        no blocks, cached prefixes or counts."""
        if self.has_unfinished_requests():
            raise RuntimeError("warm_up() needs an idle engine")
        vocab = self.model_config.vocab_size
        chunk = max(1, min(self.config.max_num_batched_tokens // 2, self.max_model_len // 2, 512))
        params: SamplingParams | PoolingParams = SamplingParams(
            temperature=0.0, max_tokens=3, ignore_eos=True, detokenize=False)
        if self.model_config.is_classifier:  # prompts only: a classifier never decodes
            params = PoolingParams(task="classify")
        avoid = self.placeholder_token_ids()

        def plain(ids: list[int]) -> list[int]:
            return [next(u % vocab for u in range(t, t + len(avoid) + 1) if u % vocab not in avoid)
                    if t in avoid else t for t in ids]

        prompt = plain([i % vocab for i in range(1, chunk + 1)])
        a = max(1, chunk // 4)
        self.add_request("__warmup_0", prompt[:a], params)
        self.add_request("__warmup_1", prompt[:a][::-1], params)
        for _ in range(2):  # the prompts, then a decode step
            self.step()
        self.add_request("__warmup_2", prompt[: max(1, chunk - 3)], params)  # a chunk beside decodes
        while self.has_unfinished_requests():
            self.step()
        # again with the other residues mod 16; __warmup_3 reuses __warmup_0's cached prefix
        self.add_request("__warmup_3", prompt[: max(1, a - 1)], params)
        self.step()
        self.add_request("__warmup_4", prompt[::-1][:a], params)
        while self.has_unfinished_requests():
            self.step()
        # One prompt step of the whole token budget: the largest prompt steps' GEMMs run kernels
        # of their own, which CUDA loads on first use (from disk on a fresh machine). Without
        # it the first process on an H200 spent ~1 s more in its timed prompt steps (runs
        # 82-83: 236 against 181 ms a step at 8192 tokens).
        # Then one of full - 3 tokens (the other residue mod 16): sizes past the chunk
        # choose kernels of their own (an MoE of 128 experts takes 64-row blocks only past
        # 512 tokens), which run 193 saw compile inside a timed prompt step of gpt-oss-120b.
        full = min(self.config.max_num_batched_tokens, self.max_model_len - 3)
        if full > chunk and self.kv_manager.num_free_blocks * self.config.block_size >= 2 * full:
            for i, n in enumerate(dict.fromkeys((full, max(chunk + 1, full - 3)))):
                self.add_request(f"__warmup_{5 + i}",  # no prefix of the other
                                 plain([(7 * j + 3 + i) % vocab for j in range(n)]), params)
                while self.has_unfinished_requests():
                    self.step()
        # the sampling kernel's fp32 variant (after penalties or a top-k/top-p filter)
        self.runner.sampler.warm_up(self.device)
        self.kv_manager.reset_prefix_cache()
        if self.proposer is not None:
            self.proposer.stats = SpecStats()
        kv = self.kv_manager
        kv.prefix_queries = kv.prefix_hits = kv.pool.num_evictions = kv.host_hits = 0
        if kv.host is not None:
            kv.host.num_stores = kv.host.num_loads = kv.host.num_evictions = kv.host.num_dropped = 0
        self.scheduler.num_preemptions = self.scheduler.num_steps = 0

    # ------------------------------------------------------------------ setup helpers
    def _set_chat_template(self, template: str) -> None:
        """Replace the tokenizer's chat template: ``template`` is a file holding one, or the
        Jinja text itself; a syntax error is named now, not at the first chat."""
        if self.tokenizer is None:
            raise ValueError("chat_template needs a tokenizer (this model has none)")
        source = "chat_template"
        if "{" not in template and os.path.isfile(template):
            source = template
            with open(template, encoding="utf-8") as f:
                template = f.read()
        import jinja2

        try:
            jinja2.Environment().parse(template)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"{source} is not a valid Jinja template: {e.message} (line {e.lineno})") from None
        self.tokenizer.chat_template = template

    def _bad_word_ids(self, words: list[str]) -> list[list[int]]:
        """SamplingParams.bad_words -> token ids: each word as written (leading spaces
        dropped) and after a space, as a tokenizer writes a word inside a sentence (vLLM's)."""
        if self.tokenizer is None:
            raise ValueError("bad_words need a tokenizer (this model has none)")
        out: list[list[int]] = []
        for w in words:
            for text in (w.lstrip(), " " + w.lstrip()):
                ids = [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]
                if ids and ids not in out and all(t < self.model_config.vocab_size for t in ids):
                    out.append(ids)
        return out

    def _eos_ids(self) -> tuple[int, ...]:
        ids = set(self.model_config.eos_token_id)
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        if isinstance(tok_eos, int):
            ids.add(tok_eos)
        ids.update(self.generation_defaults.eos_token_ids)
        return tuple(sorted(ids))

    def _load_draft(self, spec: SpeculativeConfig) -> tuple[ModelSource, torch.nn.Module,
                                                            type[AttentionBackend]]:
        """The draft model of ``spec`` (speculative decoding, engine/draft_model.py) loaded
        beside the target, with the attention backend it runs on (the one requested, else
        the default for its shapes); a ValueError names what does not fit."""
        assert spec.model is not None
        try:
            source = resolve_model(spec.model)
        except ModelLoadError as e:
            raise ValueError(f"speculative_config model {spec.model!r} cannot be loaded: {e}") from None
        check_draft_config(source.config, self.model_config)
        backend_cls, why = select_backend(self.config.attention_backend, source.config, self.device,
                                          self.dtype, kv_cache_dtype=self.kv_dtype)
        logger.info("draft model %s: attention backend %s", spec.model, why)
        model = load_model(source, self.dtype, self.device, max_positions=self.max_model_len,
                           seed=self.config.seed, quantization=self.config.quantization)
        ops.set_fused_ops(model, backend_cls.name == "triton")
        return source, model, backend_cls

    def _load_mtp(self, fused: bool) -> tuple[HiddenStateDraft, torch.Tensor]:
        """The checkpoint's MTP layer (models/mtp.py) over the loaded target, and the buffer
        the target's forwards keep their final hidden states in (set before any CUDA graph
        is captured, so the graphs write it); a ConfigError names what is missing."""
        from flashpage.models.mtp import keep_final_hidden, load_mtp

        cfg = self.config
        mtp = load_mtp(self.source, self.model, self.dtype, self.device, self.max_model_len,
                       seed=cfg.seed)
        ops.set_fused_ops(mtp, fused)
        k = self.spec_config.num_speculative_tokens if self.spec_config is not None else 1
        # the most tokens one forward runs: a step's budget, or a padded graph's
        rows = max(cfg.max_num_batched_tokens, PREFILL_MAX_TOKENS,
                   min(cfg.max_num_seqs, 512) * (1 + k))
        hidden = keep_final_hidden(self.model, rows, self.dtype, self.device)
        logger.info("speculative decoding with the checkpoint's MTP layer (model.layers.%d)",
                    self.model_config.num_hidden_layers)
        return mtp, hidden

    def _load_eagle(self, fused: bool) -> tuple[HiddenStateDraft, torch.Tensor]:
        """The EAGLE head of the speculative config (models/eagle.py) over the loaded target,
        and the buffer the target's forwards keep the states it reads in (its final hidden
        states, or EAGLE-3's three layers'); a ConfigError names what does not fit."""
        from flashpage.engine.eagle import load_eagle_head

        cfg, spec = self.config, self.spec_config
        assert spec is not None
        rows = max(cfg.max_num_batched_tokens, PREFILL_MAX_TOKENS,
                   min(cfg.max_num_seqs, 512) * (1 + spec.num_speculative_tokens))
        head, states = load_eagle_head(spec, self.model_config, self.model, self.dtype, self.device,
                                       self.max_model_len, rows)
        # the head's pool and attention are of its own shape: the target's backend must run it
        why_not = backend_reasons(self.backend_name, head.config, self.device, self.dtype,
                                  self.kv_dtype)
        if why_not:
            raise ConfigError(f"speculative_config method {spec.method!r}: attention backend "
                              f"{self.backend_name!r} cannot run the EAGLE head: {'; '.join(why_not)}")
        ops.set_fused_ops(head, fused)
        logger.info("speculative decoding with the %s head %s", "EAGLE-3" if spec.method == "eagle3"
                    else "EAGLE", spec.model)
        return head, states

    def _load_medusa(self) -> tuple[MedusaHeads, torch.Tensor]:
        """The Medusa heads of the speculative config (models/medusa.py), and the buffer the
        target's forwards keep their final hidden states in; a ConfigError names what does
        not fit."""
        cfg, spec = self.config, self.spec_config
        assert spec is not None
        rows = max(cfg.max_num_batched_tokens, PREFILL_MAX_TOKENS,
                   min(cfg.max_num_seqs, 512) * (1 + spec.num_speculative_tokens))
        heads, states = load_medusa_heads(spec, self.model_config, self.model, self.dtype,
                                          self.device, rows)
        logger.info("speculative decoding with %d Medusa heads of %d (%s)",
                    spec.num_speculative_tokens, heads.spec.num_heads, spec.model)
        return heads, states

    def _attach_offloading(self, size_gib: float) -> None:
        """The host tier over every cache tensor a block id indexes: the target's, and a
        draft model's / MTP layer's / EAGLE head's pool beside it (the same block ids)."""
        caches: list[tuple[torch.Tensor, torch.Tensor] | torch.Tensor] = list(self.runner.kv_caches)
        draft = getattr(self.proposer, "runner", None)
        if isinstance(draft, DraftRunner):
            caches += [layer.kv_cache for layer in draft.model.attention_layers()]  # type: ignore[operator]
        self.offload = KVOffloader(caches, size_gib, self.device)
        assert isinstance(self.kv_manager, KVCacheManager)  # _check_offloading: no groups
        self.kv_manager.attach_host(self.offload.host)
        logger.info("KV offloading: %d host blocks of %d bytes (%.2f GiB%s)",
                    self.offload.num_blocks, self.offload.block_bytes,
                    self.offload.num_blocks * self.offload.block_bytes / (1 << 30),
                    ", pinned" if self.offload.pin else "")

    def _check_offloading(self) -> None:
        """A ConfigError naming what KV offloading does not cover here: it needs prefix
        caching and one block table whose every layer holds every token (no sliding-window
        release, no KV cache groups)."""
        cfg, mc = self.config, self.model_config
        why = None
        if not cfg.enable_prefix_caching:
            why = "it is a second tier of the prefix cache, which is off (--no-prefix-caching)"
        elif self.kv_layout is not None:
            why = (f"this model ({mc.architecture}) mixes sliding-window and full-attention "
                   "layers (KV cache groups); --disable-hybrid-kv-cache-manager keeps one table")
        elif self.release_window is not None:
            why = (f"this model ({mc.architecture}) attends within a sliding window of "
                   f"{self.release_window} tokens, whose blocks are given back as requests advance")
        if why is not None:
            raise ConfigError(f"kv_offloading_size (--kv-offloading-size) is not supported here: {why}")

    def _release_window(self) -> tuple[int | None, int]:
        """The sliding window behind which the KV cache gives blocks back, and the slack
        kept behind a step's first query: (None, 0) unless every attention layer of the
        model (and of its draft) attends within one same window."""
        configs = [self.model_config]
        if self.draft is not None:
            configs.append(self.draft[0].config)
        wins = {c.attention_window(i) for c in configs for i in range(c.num_hidden_layers)}
        if len(wins) != 1 or None in wins or any(c.is_mla for c in configs):
            return None, 0
        # A draft model catches up on up to k + 1 positions before the target's step
        # (accepted drafts and the bonus token; one more in flight under async scheduling).
        slack = (self.spec_config.num_speculative_tokens + 2
                 if (self.draft is not None or self.mtp is not None)
                 and self.spec_config is not None else 0)
        return wins.pop(), slack

    def _kv_groups(self) -> GroupLayout | None:
        """KV cache groups when the model's attention layers mix one sliding window (or one
        attention chunk size: Llama 4) with full attention; None (one table for all layers) otherwise, with a draft model (its
        cache shares the target's tables), or when disable_hybrid_kv_cache_manager says so."""
        mc = self.model_config
        if (self.config.disable_hybrid_kv_cache_manager or self.draft is not None
                or self.mtp is not None or mc.is_mla):
            return None
        return group_layers([mc.attention_window(i) for i in range(mc.num_hidden_layers)],
                            [mc.attention_chunk(i) for i in range(mc.num_hidden_layers)])

    def _num_blocks(self) -> int:
        mc, cfg = self.model_config, self.config
        kv_dtype = str(self.kv_dtype).replace("torch.", "")
        per_token = mc.kv_bytes_per_token(kv_dtype)
        lay = self.kv_layout
        if lay is not None:  # a block is one layer's slot in each of num_slots tensors
            per_token = mc.kv_bytes_per_token(kv_dtype, per_layer=True) * lay.num_slots
        if self.draft is not None:  # its pool has a block for each of the target's
            per_token += self.draft[0].config.kv_bytes_per_token(kv_dtype)
        if self.mtp is not None:  # the MTP layer's (EAGLE head's) pool likewise: one layer
            per_token += mtp_kv_bytes_per_token(self.mtp.config, kv_dtype)
        per_block = per_token * cfg.block_size
        if self.device.type == "cuda":
            # weights replaced at load (fp8 / int4 linears' and MoE experts' 16-bit tensors,
            # hold_fp8 / hold_int4) sit freed in the allocator's cache: not used, count them free
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            # the text model's step or the encoder's batch, whichever is larger: they run in turn
            reserve = max(self._activation_bytes(), self._encoder_bytes())
            budget = int(total * cfg.gpu_memory_utilization) - (total - free) - reserve
        else:
            budget = cfg.cpu_kv_cache_bytes
        # Never more blocks than max_num_seqs full-length requests could use (behind a
        # released window: its span and a step's tokens), and the null block.
        per_req = -(-self.max_model_len // cfg.block_size)
        window = self.release_window
        if window is not None:
            span = window + cfg.max_num_batched_tokens + 64
            per_req = min(per_req, -(-span // cfg.block_size) + 1)
        if lay is not None:  # the full groups' whole runs, the windowed groups' spans
            reach = max((lay.windows[g] or lay.chunk(g) or 0) for g in range(lay.num_groups))
            span = -(-(reach + cfg.max_num_batched_tokens + 64) // cfg.block_size) + 1
            per_req = sum(min(per_req, span) if lay.releases(g) else per_req
                          for g in range(lay.num_groups))
        cap = cfg.max_num_seqs * per_req + 1 + (window is not None or lay is not None)
        n = min(budget // per_block, cap)
        if n < 1:
            raise ValueError(
                f"no memory left for the KV cache (needs {per_block} bytes per block); "
                "raise gpu_memory_utilization or lower max_num_batched_tokens")
        return int(n)

    def _encoder_bytes(self) -> int:
        """What an encoder batch (at most max_num_batched_tokens rows, or one input longer
        than that: the runner's batches, engine/multimodal.encode_pending) adds while it
        runs, by the encoder's own estimate, and the usual slack."""
        fn = getattr(self.mm_encoder, "activation_bytes", None)
        if fn is None:
            return 0
        # and the encoder cache's rows of finished requests (engine/encoder_cache.py), with
        # Qwen3-VL's deepstack features
        deep = len(getattr(getattr(self.mm_encoder, "config", None), "deepstack_visual_indexes", ()) or ())
        row = self.model_config.hidden_size * (1 + deep) * dtype_bytes(str(self.dtype).replace("torch.", ""))
        return int(fn(self.config.max_num_batched_tokens)) + self._encoder_cache_rows() * row + (512 << 20)

    def _encoder_cache_rows(self) -> int:
        """The encoder cache's capacity in rows (0: none)."""
        n = self.config.mm_encoder_cache_tokens
        return self.config.max_num_batched_tokens if n is None else n

    def _activation_bytes(self) -> int:
        mc, cfg = self.model_config, self.config
        nbytes = dtype_bytes(str(self.dtype).replace("torch.", ""))
        if mc.is_mla:  # per-head q and the K/V a prompt chunk expands its latents into
            heads = mc.num_attention_heads * (2 * (mc.qk_nope_head_dim + mc.qk_rope_head_dim)
                                              + mc.v_head_dim)
        else:
            heads = 4 * mc.num_attention_heads * mc.head_dim
        width = 4 * mc.hidden_size + 3 * max(mc.intermediate_size, mc.moe_intermediate_size) \
            + heads
        logits = mc.num_labels if mc.is_classifier else mc.vocab_size  # a classifier's: its labels
        return cfg.max_num_batched_tokens * width * nbytes * 2 \
            + cfg.max_num_seqs * logits * 12 + (512 << 20)

    # ------------------------------------------------------------------ requests
    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompt token ids instead of text")
        return list(self.tokenizer.encode(prompt, add_special_tokens=True))

    def add_request(self, request_id: str | None, prompt: str | list[int] | torch.Tensor,
                    params: SamplingParams | PoolingParams | None = None,
                    arrival_time: float | None = None,
                    lora_request: LoRARequest | None = None, priority: int = 0,
                    cache_salt: str | None = None, multi_modal_data: Any = None,
                    mm_processor_kwargs: dict[str, Any] | None = None) -> str:
        """Queue a request; raises ValueError (naming the problem) if it can never run.
        PoolingParams: an embedding request (flashpage/pooling.py): its prompt's pooled hidden
        states come back as ``RequestOutput.embedding``. ``lora_request``: the LoRA adapter
        it runs with (read and checked here the first time its id is seen). ``priority``:
        with the priority scheduling policy, lower values are served first (as vLLM's).
        ``cache_salt``: its prefix-cache blocks are shared only with requests of the same
        salt (vLLM's; a non-empty string). A tensor prompt: its input embeddings
        [tokens, hidden] (engine/prompt_embeds.py; needs enable_prompt_embeds).
        ``multi_modal_data``: vLLM's {"image": image or [images]} for a model that takes
        images (LLaVA: engine/multimodal.py), one per ``<image>`` in the prompt;
        ``mm_processor_kwargs``: vLLM's per-request processor settings over the engine-wide
        ones (Qwen2-VL's pixel bounds and fps, Gemma 3's pan-and-scan, SmolVLM2's frame
        sampling: config.request_mm_processing)."""
        self.check_awake()
        self.check_priority(priority)
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {cache_salt!r}")
        pooling = params if isinstance(params, PoolingParams) else None
        self.check_task(pooling.task if pooling is not None else "generate")
        if pooling is not None:
            pooling.validate(self.model_config.hidden_size)
            # one greedy token nobody reads: the scheduler and async scheduling as for any request
            params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
        params = params or SamplingParams()
        assert isinstance(params, SamplingParams)
        params.validate()
        if request_id is None:
            request_id = str(self._counter)
            self._counter += 1
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        embeds: torch.Tensor | None = None
        mm_inputs: list[MultiModalInput] | None = None
        if isinstance(prompt, torch.Tensor):  # engine/prompt_embeds.py
            if multi_modal_data is not None or mm_processor_kwargs:
                what = "multi_modal_data" if multi_modal_data is not None else "mm_processor_kwargs"
                raise ValueError(f"{what} with prompt_embeds: give the prompt as text or "
                                 "token ids with its <image> placeholders")
            embeds = self._check_embeds_request(prompt, params, pooling)
            text, ids = None, [EMBEDS_PLACEHOLDER_ID] * embeds.shape[0]
        else:
            # an encoder that expands a text prompt before it is tokenized (InternVL's: a
            # video's "FrameN: <img>...</img>" text, as its processor writes it; the remote-code
            # layout's "<image>", as vLLM takes it)
            expand = getattr(self.mm_encoder, "expand_text", None)
            if (expand is not None and isinstance(multi_modal_data, dict) and "video" in multi_modal_data
                    and _takes_video(self.mm_encoder)):
                from flashpage.engine.video_io import decode_sources

                # its frames' count writes the text: a video file decoded and sampled first
                multi_modal_data = {**multi_modal_data, "video": decode_sources(
                    multi_modal_data["video"], self.config.media_policy)}
                sample = getattr(self.mm_encoder, "sample_videos", None)
                if sample is not None:  # SmolVLM2's do_sample_frames (the same picks again: none lost)
                    multi_modal_data = sample(multi_modal_data, mm_processor_kwargs)
            tokenize: Callable[[str], list[int]] = self.tokenize if expand is None or multi_modal_data is None \
                else (lambda s: self.tokenize(expand(s, multi_modal_data)))
            text, ids = prompt_text_and_ids(prompt, tokenize)
            ids, mm_inputs = self._multimodal_inputs(ids, multi_modal_data, params, pooling,
                                                     mm_processor_kwargs)
            if params.truncate_prompt_tokens is not None and len(ids) > params.truncate_prompt_tokens:
                ids = ids[-params.truncate_prompt_tokens:]  # the text no longer matches: not kept
                text = None
            self._validate_ids(ids)
        embeds_digest = digest(embeds) if embeds is not None else \
            (chain_digest(mm_inputs) if mm_inputs else None)
        vocab = self.model_config.vocab_size
        for name, ids_ in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids", params.allowed_token_ids or ())):
            for t in ids_:
                if t >= vocab:
                    raise ValueError(f"{name} token id {t} is outside the vocabulary [0, {vocab})")
        if pooling is not None and len(ids) > self.max_pooled_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens but max_model_len is {self.max_model_len}: "
                f"a {pooling.task} request takes up to {self.max_pooled_len}")
        if pooling is None and len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens but max_model_len is {self.max_model_len}: "
                "no room for any output token")
        bad_word_ids = self._bad_word_ids(params.bad_words) if params.bad_words else []
        guide = self.compile_guide(params) if pooling is None else None
        if lora_request is not None:
            self.add_lora(lora_request)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        # an embeds prompt's ids are placeholders: its output says none (as vLLM's, empty)
        shown_ids = ids if embeds is None else []
        parent = ParentRequest(request_id, text, shown_ids, params, [], RequestMetrics(arrival), pooling)
        mrope = None  # M-RoPE's 3-D prompt positions (engine/mrope.py), shared by the samples
        if mm_inputs and self.model_config.mrope_section:
            from flashpage.engine.mrope import prompt_positions

            mrope = prompt_positions(len(ids), mm_inputs)
        for i in range(params.n):
            sample = params if params.n == 1 else child_params(params, i)
            rid = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(rid, ids, sample, self.eos_token_ids, arrival, lora_request, priority,
                          cache_salt, embeds, embeds_digest, mm_inputs)
            req.bad_word_ids = bad_word_ids
            if mrope is not None:
                req.mrope_positions, req.mrope_delta = mrope
            if guide is not None:
                from flashpage.structured.guide import GuideState

                req.guide = GuideState(guide, allow_eos=not sample.ignore_eos)
            if pooling is not None:
                req.pooling = PoolingState(self.pooling_type, *self._pooling_head(pooling),
                                           params=pooling)
            try:
                self.scheduler.add_request(req)
            except ValueError:
                self.scheduler.abort_requests([c.request.request_id for c in parent.children])
                raise
            detok = (IncrementalDetokenizer(self.tokenizer, shown_ids, params.skip_special_tokens)
                     if self.tokenizer is not None and params.detokenize else None)
            child = ChildRequest(req, request_id, i, detok)
            parent.children.append(child)
            if needs_known_tokens(sample):
                self._sync_ids.add(rid)
        self._parents[request_id] = parent
        for c in parent.children:
            self._children[c.request.request_id] = c
        return request_id

    @property
    def max_pooled_len(self) -> int:
        """The longest prompt an embed / classify / score request takes: all of max_model_len
        (vLLM's rule), its one ignored token never being written to the KV cache."""
        return self.max_model_len

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        """What this model does: a decoder generates and embeds; a sequence classifier
        classifies, and scores a pair when it has one label (check_task says so otherwise)."""
        return ("classify", "score") if self.model_config.is_classifier else ("generate", "embed")

    def check_task(self, task: str) -> None:
        """A ValueError unless this model does ``task`` ("generate", "embed", "score",
        "classify"), saying what it does instead (as EncoderEngine.check_task)."""
        mc = self.model_config
        if not mc.is_classifier:
            if task == "classify":
                raise ValueError(f"this model ({mc.architecture}) is not a sequence classifier: "
                                 "classify needs one (a *ForSequenceClassification checkpoint: "
                                 "Qwen2ForSequenceClassification, BertForSequenceClassification, ...)")
            if task == "score":
                raise ValueError(f"this model ({mc.architecture}) has no classification head to "
                                 "score a pair with (LLM.score and /score take the cosine of its "
                                 "embeddings instead)")
            return
        if task == "generate":
            raise ValueError(f"this model ({mc.architecture}) is a sequence classifier: use classify "
                             "(LLM.classify, /classify) or score (one label: LLM.score, /score, "
                             "/rerank); it has no LM head to generate with")
        if task == "embed":
            raise ValueError(f"this model ({mc.architecture}) is a sequence classifier: use classify "
                             "(LLM.classify, /classify); it does not embed (as vLLM's classifiers)")
        if task == "score" and mc.num_labels != 1:
            raise ValueError(f"this classifier has {mc.num_labels} labels; only a one-label "
                             "classifier gives a score (LLM.classify, /classify give its class "
                             "probabilities)")

    def encode_pair(self, text_1: str | list[int], text_2: str | list[int]) -> list[int]:
        """A one-label classifier's input for one pair (LLM.score): the two texts joined by
        the tokenizer's pair encoding (encoder/engine.py join_pair, family "decoder"), or with
        ModelConfig.use_pad_token false (a classifier made from an LM head, vLLM's default for
        one) as the one text text_1 + text_2 (family "concat")."""
        from flashpage.encoder.engine import join_pair

        return join_pair(self.tokenizer, self.model_config.pair_family, text_1, text_2)

    def _pooling_head(self, params: PoolingParams) -> tuple[Any, str]:
        """(head, activation) for PoolingState: a classifier's score head on the pooled
        vector, and what turns its logits into the output; no head for an embedding."""
        if params.task == "embed":
            return None, "identity"
        return self._classify, self.model_config.score_activation

    def _classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """A classifier's score head: pooled vectors [n, hidden] fp32 -> logits [n, num_labels]
        (one callable for every request, so a step's finishing requests share one batch)."""
        return self.model.classify(pooled.to(self.dtype))  # type: ignore[operator]

    def check_priority(self, priority: object) -> None:
        """A ValueError unless ``priority`` is an integer this engine takes: any under the
        priority scheduling policy, 0 only under fcfs (vLLM's rule and words)."""
        check_priority(priority, self.config.scheduling_policy)

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Read and check an adapter now (add_request does it the first time an id comes);
        a ValueError names the problem. As vLLM's ``add_lora``."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        if self.lora is None:
            raise ValueError(f"LoRA adapter {lora_request.lora_name!r} requested, but the engine "
                             "was started without enable_lora (LLM(..., enable_lora=True), "
                             "flashpage serve --enable-lora)")
        self.lora.add(lora_request, lambda: {r.lora_int_id for r in self.scheduler.requests.values()})

    def remove_lora(self, lora_id: int) -> bool:
        """Forget adapter ``lora_id`` (vLLM's ``remove_lora``): False if it was not loaded.
        Requests running with it finish with it."""
        if self.lora is None:
            return False
        return self.lora.remove(lora_id, {r.lora_int_id for r in self.scheduler.requests.values()})

    def compile_guide(self, params: SamplingParams) -> CompiledGuide | None:
        """The request's structured-outputs guide (compiled once per spec and cached), or
        None; a StructuredOutputsError (a ValueError) naming what is wrong with the spec.
        Another thread may call it ahead of add_request (the server does, so that a new
        spec's compile, up to ~0.2 s, does not hold up every request's steps); add_request
        then finds it cached."""
        spec = params.structured_outputs
        if spec is None:
            return None
        if self.tokenizer is None:
            raise StructuredOutputsError("structured outputs need a tokenizer (this model has none)")
        if self._guides is None:
            from flashpage.structured.compiler import GuideCompiler

            self._guides = GuideCompiler(self.tokenizer, self.model_config.vocab_size,
                                         self.eos_token_ids)
        return self._guides.compile(spec)

    @property
    def embeds_width(self) -> int:
        """The width of a prompt_embeds row: what the model's token embedding gives."""
        return self.model_config.word_embed_proj_dim or self.model_config.hidden_size

    def _check_embeds_request(self, prompt: torch.Tensor, params: SamplingParams,
                              pooling: PoolingParams | None) -> torch.Tensor:
        """A prompt given as input embeddings, truncated as truncate_prompt_tokens says and
        checked (engine/prompt_embeds.py); a ValueError names what it cannot do."""
        embeds = check_prompt_embeds(prompt, self.embeds_width, self.max_model_len, self.dtype,
                                     enabled=self.config.enable_prompt_embeds,
                                     keep_last=params.truncate_prompt_tokens)
        if pooling is not None:
            raise ValueError(f"prompt_embeds with a {pooling.task} request: only generation "
                             "takes a prompt given as embeddings")
        if params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs with prompt_embeds: an embeds prompt has no "
                             "prompt token ids to score")
        return embeds

    def _multimodal_inputs(self, ids: list[int], data: Any, params: SamplingParams,
                           pooling: PoolingParams | None, mm_kwargs: Any = None
                           ) -> tuple[list[int], list[MultiModalInput] | None]:
        """A prompt's ids with its images' placeholders expanded, and its multimodal inputs
        (engine/multimodal.py); a ValueError names what cannot be done: images for a model
        that takes none, an <image> without an image, counts that differ, per-request
        ``mm_kwargs`` the processor does not read or above the engine's bounds, ..."""
        enc, mc = self.mm_encoder, self.model_config
        # vLLM's per-request mm_processor_kwargs: checked even without data (a bad key named)
        modalities = [k for k in ("image", "video", "audio") if isinstance(data, dict) and k in data]
        vision = request_mm_processing(mc, mm_kwargs, modalities) if mm_kwargs is not None else None
        if data is None:
            image = getattr(enc.config, "image_token_id", None) if enc is not None else None
            if image is not None and image in ids:
                raise ValueError(f"the prompt has image tokens ({enc_token_name(enc)}, id "
                                 f"{image}) but no image was given "
                                 "(multi_modal_data={\"image\": ...})")
            audio = getattr(enc.config, "audio_token_id", None) if enc is not None else None
            if audio is not None and audio in ids:
                raise ValueError(f"the prompt has audio tokens ({enc_token_name(enc)}, id {audio}) but no "
                                 "audio was given (multi_modal_data={\"audio\": (waveform, sampling_rate)})")
            video = getattr(enc.config, "video_token_id", None) if enc is not None else None
            if video is not None and video in ids:
                name = getattr(enc, "video_token_name", "<|video_pad|>")
                raise ValueError(f"the prompt has video tokens ({name}, id {video}) but no video "
                                 "was given (multi_modal_data={\"video\": frames})")
            return ids, None
        for modality, limit in self.mm_limits.items():
            n = count_items(data, modality)
            if n > limit:
                raise ValueError(f"{n} {modality} item(s) in one prompt, but limit_mm_per_prompt allows "
                                 f"{limit} ({{{modality!r}: {limit}}})")
        given = "audio" if isinstance(data, dict) and "audio" in data else "image"
        if enc is None:
            what = (f"{mc.multimodal_architecture} is served as its text model alone "
                    "(models/multimodal.py)" if mc.multimodal_architecture
                    else f"{mc.architecture} is a text-only model")
            raise ValueError(f"multi_modal_data given, but this model takes no {given} input: {what}")
        if given == "audio" and getattr(enc, "modality", "image") != "audio":
            raise ValueError(f"multi_modal_data[\"audio\"] given, but this model "
                             f"({mc.multimodal_architecture or mc.architecture}) takes no audio input "
                             "(Qwen2-Audio does)")
        if pooling is not None:
            raise ValueError(f"multi_modal_data with a {pooling.task} request: only generation "
                             "takes images and audio")
        if self.spec_config is not None:
            raise ValueError("multi_modal_data with speculative decoding: its draft would see "
                             "the image placeholders without the image; serve without "
                             "speculative_config for image requests")
        if isinstance(data, dict) and "video" in data and _takes_video(enc):
            from flashpage.engine.video_io import decode_sources

            # a video given as a file (path, URL, bytes): decoded and sampled (engine/video_io.py)
            data = {**data, "video": decode_sources(data["video"], self.config.media_policy)}
        if vision is not None:  # Qwen2-VL's pixel bounds or Gemma 3's pan-and-scan: its encoder's
            prepare: Any = enc.prepare  # (the two encoders that take a request's settings)
            ids, inputs = prepare(ids, data, vision)
        else:
            ids, inputs = enc.prepare(ids, data)
        trunc = params.truncate_prompt_tokens
        if trunc is not None and len(ids) > trunc:
            raise ValueError(f"truncate_prompt_tokens={trunc} would cut this image prompt of "
                             f"{len(ids)} tokens (its images' placeholders included)")
        return ids, inputs

    def _validate_ids(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.model_config.vocab_size
        for i, t in enumerate(ids):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(
                    f"prompt token id {t!r} at position {i} is outside the vocabulary [0, {vocab})")

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for pid in ids:
            parent = self._parents.pop(pid, None)
            if parent is None:
                continue
            child_ids = [c.request.request_id for c in parent.children]
            self.scheduler.abort_requests(child_ids)
            for cid in child_ids:
                self._children.pop(cid, None)
                self._sync_ids.discard(cid)

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's ``reset_prefix_cache``: benchmarks that must
        not hit the last run's prompts). Only while no request holds a block: False (and
        nothing forgotten) otherwise."""
        if self._inflight is not None or self.has_unfinished_requests():
            return False
        if self.runner.encoder_cache is not None:  # and the images' encoder outputs
            self.runner.encoder_cache.clear()
        return self.kv_manager.reset_prefix_cache()

    def get_num_unfinished_requests(self) -> int:
        return len(self._parents)

    # ------------------------------------------------------------------ step
    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """One scheduler step. Returns an output for every request that got a token (or,
        with ``final_only``, only for requests that finished: cheaper for offline use).

        With async scheduling the step launched here is read back by the NEXT call (its
        outputs come one call later): meanwhile the host schedules and prepares that next
        step, and the device feeds the sampled tokens into it without a round trip. A
        request that stops on a token thereby gets one more token computed, discarded.
        """
        outputs: list[RequestOutput] = []
        if self.proposer is not None and self.proposer.backoff is not None:
            self.proposer.backoff.tick()
        if self._inflight is not None and (
                not self.async_scheduling or self._sync_ids or self._inflight.pending.drafted
                or (self.proposer is not None and self.proposer.wants_tokens(self.scheduler.running))):
            outputs = self._read_back(self._inflight, final_only)  # penalties, drafts: tokens first
            self._inflight = None
        if self.proposer is not None:
            self.proposer.propose(self.scheduler.running)
        out = self.scheduler.schedule()
        if self.offload is not None:  # host-tier copies: before the forward reuses or reads blocks
            self.offload.flush()
            if not out.scheduled and self.kv_manager.has_loads_in_flight and self._inflight is None:
                self.offload.wait_for_a_load()  # everyone waits for the host: no spinning
        if self.proposer is not None:  # a draft model's drafts, now that they have slots
            self.proposer.fill(out)
        if self.lora is not None and out.scheduled:  # the step's adapters into slots
            self.lora.activate((r.lora_int_id for r, _ in out.scheduled),
                               {r.lora_int_id for r in self.scheduler.running})
        now = time.monotonic()
        for req, _ in out.scheduled:
            child = self._children.get(req.request_id)
            if child is not None:
                m = self._parents[child.parent_id].metrics
                if m.first_scheduled_time is None:
                    m.first_scheduled_time = now
                    m.num_cached_tokens = max(req.num_cached_tokens, 0)
                    m.num_host_cached_tokens = req.num_host_cached_tokens
        sampled_reqs, pending = self.runner.execute(out)
        self.scheduler.advance(out, sampled_reqs)
        previous, self._inflight = self._inflight, (
            _Inflight(sampled_reqs, pending) if pending is not None else None)
        if previous is not None:
            outputs += self._read_back(previous, final_only)
        if self._inflight is not None and not self.async_scheduling:
            outputs += self._read_back(self._inflight, final_only)
            self._inflight = None
        return outputs

    def _read_back(self, step: _Inflight, final_only: bool) -> list[RequestOutput]:
        """Wait for a launched step's tokens; append them, stop requests, detokenize."""
        result = step.pending.result()
        if step.pending.pooled is not None:  # the step's pooled outputs, copied with its tokens
            step.pending.pooled.deliver()
        reqs = step.requests
        checked = step.pending.drafted
        tokens, drafted, starts = result.token_ids, None, dict[str, int]()
        if checked and self.proposer is not None:  # speculative decoding (engine/spec_decode.py)
            tokens, drafted, starts = unpack_checked(reqs, tokens, checked, self.proposer.stats)
            self.proposer.learn(checked)
        finished = {r.request_id for r in self.scheduler.resolve(reqs, tokens, drafted)}
        now = time.monotonic()
        touched: dict[str, None] = {}
        for i, req in enumerate(reqs):
            child = self._children.get(req.request_id)
            # Skipped: aborted, or finished by an earlier token while this one was computed.
            if child is None or (req.is_finished() and req.request_id not in finished):
                continue
            touched[child.parent_id] = None
            if drafted is not None and req.request_id in drafted:
                got = checked[req.request_id]  # type: ignore[index]
                lps = None if got.logprobs is None else \
                    got.logprobs + ([result.logprobs[i]] if got.drawn is None else [])
                if child.add_tokens(drafted[req.request_id] + [tokens[i]], starts[req.request_id],
                                    req.request_id in finished, lps):  # a stop string
                    self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
            else:
                lp = result.logprobs[i]
                if lp is not None:
                    child.logprobs.append(lp)
                    child.cumulative_logprob += lp.logprob
                if child.add_token(tokens[i], req.request_id in finished):  # a stop string
                    self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
            m = self._parents[child.parent_id].metrics
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now
        if final_only:
            return [self._make_output(pid, now) for pid in touched if self._parents[pid].is_done()]
        return [self._make_output(pid, now) for pid in touched]

    def _make_output(self, parent_id: str, now: float) -> RequestOutput:
        parent = self._parents[parent_id]
        out = parent.output(now)
        if out.finished:
            del self._parents[parent_id]
            for c in parent.children:
                self._children.pop(c.request.request_id, None)
                self._sync_ids.discard(c.request.request_id)
        return out

    # ------------------------------------------------------------------ sleep mode
    def check_awake(self) -> None:
        """An EngineSleepingError (a ValueError) while the weights or the KV cache sleep, or
        the weights were discarded and not loaded since; it names the call that fixes it."""
        if self.sleep_state is not None:
            self.sleep_state.check_awake()

    def is_sleeping(self) -> bool:
        """vLLM's ``is_sleeping``: the weights or the KV cache (or both) are released."""
        return self.sleep_state is not None and self.sleep_state.is_sleeping

    def sleep(self, level: int = 1) -> None:
        """vLLM's ``sleep``: give the device memory of the weights and the KV cache back
        (engine/sleep.py). Level 1 keeps the weights in host memory; level 2 discards them
        (load_weights or reload_weights after waking). The KV cache's contents are
        discarded either way: the prefix cache is reset. Only while no request runs
        (EngineBusyError otherwise)."""
        state = self._sleep_mode("sleep")
        if isinstance(level, bool) or level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (weights kept on the host) or 2 (weights "
                             f"discarded), got {level!r}")
        if level == 2 and (why := self._weights_update_unsupported()) is not None:
            raise ValueError(f"sleep(level=2) discards the weights, and this engine cannot load "
                             f"them again: {why}; use sleep(level=1)")
        self._check_idle("sleep")
        if not self.kv_manager.reset_prefix_cache():  # cached K/V would read as zeros after
            raise RuntimeError("sleep: KV blocks are held with no request in flight (a leak); "
                               "not sleeping")
        if not state.keeps_graphs:
            self._drop_graphs()
        if self.runner.encoder_cache is not None:  # its rows' device memory back too
            self.runner.encoder_cache.clear()
        state.sleep(level)
        logger.info("asleep (level %d): %.1f MiB of weights%s and %.1f MiB of KV cache released%s",
                    level, state.nbytes("weights") / 2**20, " (kept on the host)" if level == 1 else "",
                    state.nbytes("kv_cache") / 2**20,
                    "; the CUDA graphs kept" if state.keeps_graphs and self.runner.graphs is not None else "")

    def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's ``wake_up``: allocate again what ``tags`` name ("weights", "kv_cache";
        None: both), in the same tensor objects; the weights come back from the host (level
        1) or are zeros until load_weights / reload_weights (level 2), the KV cache zeroed. In
        fixed-address memory (CUDA, engine/cumem.py) the CUDA graphs were kept; otherwise,
        once both are awake, those dropped by ``sleep`` are captured again (the storages'
        addresses changed). Waking what is awake does nothing."""
        state = self._sleep_mode("wake_up")
        state.wake_up(check_tags(tags))
        if not state.is_sleeping and self._recapture_graphs:
            self._recapture_graphs = False
            self._capture_graphs(self._prompt_graph_backend)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy (checkpoint name, tensor) pairs into the model in place (an RLHF trainer's
        update; vLLM's ``model.load_weights``): names as the model's checkpoint has them
        (HF's q_proj, k_proj, v_proj go into our qkv_proj, gate_proj and up_proj into
        gate_up_proj; the family's own loader maps them), any subset, in any number of calls.
        A name with no place or a shape that does not fit is a ValueError naming it (the
        pairs before it are already copied). The prefix cache is reset: its K/V came from
        the old weights. Returns the parameter names completed by this call."""
        why = self._weights_update_unsupported()
        if why is not None:
            raise ValueError(f"load_weights: {why}")
        self._check_weights_awake("load_weights")
        self._check_idle("load_weights")

        def checked() -> Iterable[tuple[str, torch.Tensor]]:
            for i, item in enumerate(weights):
                if (not isinstance(item, tuple) or len(item) != 2 or not isinstance(item[0], str)
                        or not isinstance(item[1], torch.Tensor)):
                    raise ValueError(f"load_weights: item {i} is not a (name, tensor) pair: "
                                     f"{type(item).__name__}")
                yield item

        try:
            with torch.no_grad():
                loaded: set[str] = self.model.load_weights(  # type: ignore[operator]
                    adapt_weights(self.source, checked(), self._classifier_token_ids, "load_weights"))
        finally:
            self._weights_changed()
        return loaded

    def reload_weights(self) -> None:
        """Read the model's checkpoint from disk into the weights again, in place (after
        sleep(level=2), or to undo load_weights); random weights are drawn again from the
        seed. The prefix cache is reset."""
        why = self._weights_update_unsupported()
        if why is not None:
            raise ValueError(f"reload_weights: {why}")
        self._check_weights_awake("reload_weights")
        self._check_idle("reload_weights")
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                if self.source.kind == "random":
                    init_random_(self.model, self.config.seed)
                else:
                    weights = adapt_weights(self.source, checkpoint_weights(self.source, self.model),
                                            self._classifier_token_ids)
                    check_loaded(self.source, self.model,
                                 self.model.load_weights(weights))  # type: ignore[operator]
        finally:
            self._weights_changed()
        logger.info("weights reloaded from %s in %.1fs", self.source.path or "the seed",
                    time.perf_counter() - t0)

    def _sleep_mode(self, what: str) -> SleepState:
        if self.sleep_state is None:
            raise ValueError(f"{what}: sleep mode is off; start the engine with "
                             "enable_sleep_mode=True (flashpage serve --enable-sleep-mode)")
        return self.sleep_state

    def _check_idle(self, what: str) -> None:
        """EngineBusyError while requests are in flight; a launched step whose requests all
        finished (async scheduling) is read back and dropped first."""
        if self.has_unfinished_requests():
            raise EngineBusyError(f"{what}: {len(self._parents)} request(s) still in flight; "
                                  "wait for them to finish (or abort them) first")
        if self._inflight is not None:
            self._read_back(self._inflight, final_only=True)
            self._inflight = None

    def _check_weights_awake(self, what: str) -> None:
        if self.sleep_state is not None and self.sleep_state.group("weights").asleep:
            raise EngineSleepingError(f"{what}: the weights are asleep; call "
                                      "wake_up(tags=['weights']) first")

    def _weights_update_unsupported(self) -> str | None:
        """Why the weights cannot be written from checkpoint tensors here, or None."""
        mc = self.model_config
        if self.config.quantization is not None:
            return (f"the weights were quantized at load (quantization={self.config.quantization!r}) "
                    "and checkpoint tensors would be copied into them unquantized")
        if mc.quantization_config is not None:
            return "the model's checkpoint is quantized (fp8 / AWQ / GPTQ): its held weights are not 16-bit"
        if mc.mxfp4_experts:
            return "the model's experts are MXFP4 (their reader is not run on update yet)"
        if mc.vision is not None or mc.audio is not None:
            return ("the model's vision tower or audio encoder (models/llava.py, qwen2_vl.py, pixtral.py, "
                    "gemma3_vision.py, qwen2_audio.py) is not written by weight updates yet")
        return None

    def _weights_changed(self) -> None:
        """After any write of the weights: the cached prefixes' K/V (and images' encoder
        outputs) came from the old ones."""
        self.kv_manager.reset_prefix_cache()
        if self.runner.encoder_cache is not None:
            self.runner.encoder_cache.clear()
        if self.sleep_state is not None:
            self.sleep_state.weights_discarded = False

    def _drop_graphs(self) -> None:
        """Drop the captured CUDA graphs (their memory pool goes with them): they hold the
        addresses of storages sleep is about to release. wake_up captures them again."""
        runner = self.runner
        if self.device.type != "cuda" or (runner.graphs is None and runner.prefill_graphs is None
                                          and runner.piecewise is None):
            return
        runner.graphs = runner.prefill_graphs = runner.piecewise = None
        self._recapture_graphs = True

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, Any]:
        kv = self.kv_manager.stats()
        out: dict[str, Any] = {
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "num_preemptions": self.scheduler.num_preemptions,
            "kv_cache": kv,
        }
        if self.proposer is not None:
            out["spec_decode"] = self.proposer.stats.as_dict()
        if self.lora is not None:
            out["lora"] = self.lora.stats()
        cache = self.runner.encoder_cache
        if cache is not None:
            out["encoder_cache"] = {"queries": cache.queries, "hits": cache.hits, "rows": cache.rows,
                                    "capacity": cache.capacity}
        return out


def _takes_video(enc: Any) -> bool:
    """Whether a multimodal encoder reads multi_modal_data["video"] (its video token)."""
    return getattr(enc, "video_placeholder_ids", None) is not None or \
        getattr(enc, "video_placeholder_text", None) is not None or \
        getattr(getattr(enc, "config", None), "video_token_id", None) is not None
