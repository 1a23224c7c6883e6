"""The offline API people know from vLLM: ``LLM(model).generate(prompts, SamplingParams)``."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import torch

from flashpage.beam_search import BeamSearch, BeamSearchOutput, run_beam_search
from flashpage.config import EngineConfig
from flashpage.encoder.config import is_encoder_model
from flashpage.engine.llm_engine import LLMEngine
from flashpage.engine.multimodal import as_text_parts, template_reads_parts
from flashpage.lora.request import LoRARequest
from flashpage.outputs import RequestOutput
from flashpage.pooling import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingParams,
    ScoringOutput,
    ScoringRequestOutput,
)
from flashpage.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger("flashpage")

Prompt = str | list[int] | dict[str, Any]


def _check_text_only(conversation: list[dict[str, Any]]) -> None:
    """A ValueError for a message's non-text content part (image_url, input_audio, ...) to a
    model that takes none: a text model (or a multimodal checkpoint's text model alone,
    models/multimodal.py), whose chat template would render an image part as its
    placeholder tokens with no image behind them."""
    for i, msg in enumerate(conversation):
        content = msg.get("content") if isinstance(msg, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise ValueError(f"message {i}: content part {j} has type {kind!r}: only text "
                                 "parts are supported (no image, audio or file input)")


class LLM:
    """An engine plus a loop. ``model=None`` is the default model (SmolLM2-135M-Instruct).

    Example::

        llm = LLM()
        out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
        print(out[0].outputs[0].text)
    """

    def __init__(self, model: str | None = None, *, tokenizer: str | None = None,
                 dtype: str = "auto", device: str = "auto", block_size: int = 16,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 max_model_len: int | None = None, enable_prefix_caching: bool = True,
                 kv_offloading_size: float = 0.0, kv_offloading_backend: str = "native",
                 attention_backend: str | None = None, num_gpu_blocks: int | None = None,
                 gpu_memory_utilization: float = 0.9, kv_cache_memory: int | None = None,
                 enforce_eager: bool = False, async_scheduling: bool | None = None,
                 enable_sleep_mode: bool = False,
                 kv_cache_dtype: str = "auto", chat_template: str | None = None,
                 seed: int = 0, random_weights_config: str | None = None,
                 pooling_type: str | None = None, quantization: str | None = None,
                 speculative_config: dict[str, Any] | str | None = None,
                 enable_lora: bool = False, max_loras: int = 1, max_lora_rank: int = 16,
                 scheduling_policy: str = "fcfs", generation_config: str = "auto",
                 long_prefill_token_threshold: int = 0,
                 disable_hybrid_kv_cache_manager: bool = False,
                 override_generation_config: dict[str, Any] | None = None,
                 hf_overrides: dict[str, Any] | None = None,
                 enable_prompt_embeds: bool = False, allowed_local_media_path: str | None = None,
                 allowed_media_domains: list[str] | None = None,
                 media_io_kwargs: dict[str, Any] | None = None,
                 limit_mm_per_prompt: dict[str, int] | None = None,
                 mm_processor_kwargs: dict[str, Any] | None = None,
                 mm_encoder_cache_tokens: int | None = None, trust_remote_code: bool = False) -> None:
        cfg = EngineConfig(
            model=model, dtype=dtype, device=device, block_size=block_size,
            num_gpu_blocks=num_gpu_blocks, gpu_memory_utilization=gpu_memory_utilization,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, enable_prefix_caching=enable_prefix_caching,
            kv_offloading_size=kv_offloading_size, kv_offloading_backend=kv_offloading_backend,
            attention_backend=attention_backend, enforce_eager=enforce_eager,
            enable_sleep_mode=enable_sleep_mode,
            async_scheduling=async_scheduling, kv_cache_dtype=kv_cache_dtype, seed=seed,
            chat_template=chat_template, pooling_type=pooling_type, quantization=quantization,
            speculative_config=speculative_config, enable_lora=enable_lora, max_loras=max_loras,
            max_lora_rank=max_lora_rank, scheduling_policy=scheduling_policy,
            long_prefill_token_threshold=long_prefill_token_threshold,
            disable_hybrid_kv_cache_manager=disable_hybrid_kv_cache_manager,
            generation_config=generation_config,
            override_generation_config=override_generation_config, hf_overrides=hf_overrides,
            enable_prompt_embeds=enable_prompt_embeds, allowed_local_media_path=allowed_local_media_path,
            allowed_media_domains=allowed_media_domains, media_io_kwargs=media_io_kwargs,
            limit_mm_per_prompt=limit_mm_per_prompt,
            mm_processor_kwargs=mm_processor_kwargs, mm_encoder_cache_tokens=mm_encoder_cache_tokens,
            trust_remote_code=trust_remote_code)
        if kv_cache_memory is not None:
            cfg.cpu_kv_cache_bytes = kv_cache_memory
        if is_encoder_model(random_weights_config or model):
            if hf_overrides is not None:
                raise ValueError("hf_overrides apply to decoder models; this is an encoder model "
                                 "(flashpage/encoder/), whose config.json is read as it is")
            if kv_offloading_size:
                raise ValueError("kv_offloading_size applies to decoder models; this is an encoder "
                                 "model (flashpage/encoder/), which keeps no KV cache")
            if enable_prompt_embeds:
                raise ValueError("enable_prompt_embeds applies to decoder models; this is an "
                                 "encoder model (flashpage/encoder/), which takes token ids")
            from flashpage.encoder.engine import EncoderEngine

            # duck-typed: the subset of LLMEngine that LLM and the server's AsyncEngine call
            self.engine = cast(LLMEngine, EncoderEngine(cfg, random_config=random_weights_config,
                                                        tokenizer=tokenizer))
        else:
            self.engine = LLMEngine(cfg, random_config=random_weights_config, tokenizer=tokenizer)

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (between ``generate`` calls; an encoder model has none
        to forget). True when done."""
        reset = getattr(self.engine, "reset_prefix_cache", None)
        return reset() if reset is not None else True

    # ---------------------------------------------------------------- sleep mode (vLLM's)
    def sleep(self, level: int = 1) -> None:
        """Give the GPU memory of the weights and the KV cache back (needs
        ``enable_sleep_mode=True``; no request running). ``level=1``: the weights are kept
        in host memory (pinned), the KV cache's contents discarded; ``level=2``: the weights
        are discarded too (``reload_weights()`` or ``load_weights(...)`` after waking).
        See flashpage/engine/sleep.py."""
        self._sleep_engine("sleep").sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Allocate again what ``tags`` name: "weights", "kv_cache", or both (None). Waking
        the weights alone leaves room to update them (``load_weights``) before the KV cache
        takes its memory; generating needs both."""
        self._sleep_engine("wake_up").wake_up(tags)

    def is_sleeping(self) -> bool:
        """True while the weights or the KV cache are released by ``sleep``."""
        check = getattr(self.engine, "is_sleeping", None)
        return bool(check()) if check is not None else False

    def load_weights(self, weights: Any) -> set[str]:
        """Copy an iterable of (checkpoint name, tensor) into the weights in place (an RLHF
        trainer's update): HF names, merged into our stacked qkv_proj / gate_up_proj by the
        model's loader; a name with no place or a wrong shape is a ValueError naming it. The
        prefix cache is reset. Returns the parameter names this call completed."""
        return self._sleep_engine("load_weights").load_weights(weights)

    def reload_weights(self) -> None:
        """Read the checkpoint from disk into the weights again (after ``sleep(level=2)``
        and ``wake_up``, or to undo ``load_weights``). The prefix cache is reset."""
        self._sleep_engine("reload_weights").reload_weights()

    def _sleep_engine(self, what: str) -> LLMEngine:
        if not hasattr(self.engine, "sleep_state"):
            raise ValueError(f"{what}: not supported for encoder models (flashpage/encoder/)")
        return self.engine

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` samples with when given no SamplingParams (vLLM's): the model's
        generation_config.json defaults (flashpage/generation_config.py), else SamplingParams()."""
        defaults = getattr(self.engine, "generation_defaults", None)  # (an encoder: none)
        return SamplingParams(**defaults.sampling_kwargs()) if defaults is not None else SamplingParams()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (text, token ids, or vLLM's dicts {"prompt": text} /
        {"prompt_token_ids": [...]} / {"prompt_embeds": tensor [tokens, hidden]} (needs
        ``enable_prompt_embeds``; engine/prompt_embeds.py), each with an optional
        "cache_salt": prefix-cache blocks shared only among prompts of the same salt, and
        for a model that takes images (LLaVA) "multi_modal_data": {"image": a PIL image,
        pixel values [3, S, S] or a list of them}, one per <image> in the prompt, and
        "mm_processor_kwargs": vLLM's per-prompt processor settings over the engine-wide
        ones (Qwen2-VL's {"max_pixels": ...}; config.request_mm_processing)).

        Outputs come back in prompt order. A prompt that cannot run (empty, too long,
        token ids outside the vocabulary, a LoRA adapter that cannot be loaded, ...) gets an
        output whose ``error`` says why; the others still complete. ``lora_request``: one
        adapter for every prompt, or one (or None) per prompt (needs ``enable_lora``).
        ``priority``: one integer per prompt, lower served first (needs
        ``scheduling_policy="priority"``; priorities change the order, not the outputs).
        """
        self._check_task("generate")
        plist = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(plist)
        else:
            params = list(sampling_params)
            if len(params) != len(plist):
                raise ValueError(f"got {len(params)} SamplingParams for {len(plist)} prompts")
        priorities = self._per_prompt_priorities(priority, len(plist))
        return self._run(plist, params, use_tqdm, _per_prompt_loras(lora_request, len(plist)),
                         priorities)

    def embed(self, prompts: Prompt | Sequence[Prompt], pooling_params: PoolingParams | None = None,
              *, use_tqdm: bool = True,
              lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
              priority: Sequence[int] | None = None) -> list[EmbeddingRequestOutput]:
        """Embed every prompt (text, token ids, or {"prompt_token_ids": [...]}): its hidden
        states pooled the model's way (flashpage/pooling.py), as vLLM's LLM.embed. Outputs
        in prompt order; a prompt that cannot run has ``error`` set and no outputs.
        ``outputs.embedding`` is a list of floats (made on first read); ``outputs.data`` the
        same vector as a float32 numpy array, without the list.
        ``priority``: one integer per prompt, as in ``generate`` (the order, not the vectors)."""
        self._check_task("embed")
        plist = _as_prompt_list(prompts)
        params = [pooling_params or PoolingParams()] * len(plist)
        priorities = self._per_prompt_priorities(priority, len(plist))
        outs = self._run(plist, params, use_tqdm, _per_prompt_loras(lora_request, len(plist)),
                         priorities)
        return [EmbeddingRequestOutput(o.request_id, o.prompt_token_ids,
                                       EmbeddingOutput(o.embedding) if o.embedding is not None else None,
                                       o.finished, o.error) for o in outs]

    def score(self, text_1: Prompt | Sequence[Prompt], text_2: Prompt | Sequence[Prompt], *,
              use_tqdm: bool = True,
              priority: Sequence[int] | None = None) -> list[ScoringRequestOutput]:
        """vLLM's LLM.score: ``text_1`` against each of ``text_2`` (one item against many),
        or each pair (equal lengths). Embedding models: the cosine of the two embeddings,
        each distinct text embedded once. Cross-encoders (flashpage/encoder/, and one-label
        decoder classifiers): one forward over each pair joined by the tokenizer (its pair
        encoding: encoder/engine.py join_pair), the head's logit through a sigmoid. A pair
        with a refused text has ``error`` set. ``priority``: one integer per pair (per
        output), as in ``generate``; a text in several pairs is embedded at the lowest value
        (the most urgent) of them."""
        left, right = _as_prompt_list(text_1), _as_prompt_list(text_2)
        if len(left) != 1 and len(left) != len(right):
            raise ValueError(f"text_1 has {len(left)} items and text_2 {len(right)}: give text_1 "
                             "one item, or both the same number")
        per_pair = self._per_prompt_priorities(priority, len(right), "pair")
        if "score" in getattr(self.engine, "supported_tasks", ()):
            return self._cross_score(left, right, per_pair, use_tqdm)
        keys = [repr(p) for p in left + right]
        unique = list(dict.fromkeys(keys))
        urgent: dict[str, int] = {}
        for j, prio in enumerate(per_pair):
            for k in (keys[0 if len(left) == 1 else j], keys[len(left) + j]):
                urgent[k] = min(urgent.get(k, prio), prio)
        embs = self.embed([(left + right)[keys.index(k)] for k in unique], use_tqdm=use_tqdm,
                          priority=[urgent.get(k, 0) for k in unique])
        by_key = dict(zip(unique, embs, strict=True))
        out = []
        for j in range(len(right)):
            a = by_key[keys[0 if len(left) == 1 else j]]
            b = by_key[keys[len(left) + j]]
            if a.outputs is None or b.outputs is None:
                out.append(ScoringRequestOutput(str(j), None, True, a.error or b.error))
                continue
            cos = float(np.dot(a.outputs.data.astype(np.float64), b.outputs.data.astype(np.float64)))
            out.append(ScoringRequestOutput(str(j), ScoringOutput(cos)))
        return out

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams, *,
                    lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search: each prompt's ``params.beam_width`` likeliest continuations
        by length-penalized log-probability, best first (flashpage/beam_search.py: every live
        beam a one-token request each step, the prefix cache sharing their blocks). A prompt
        that cannot run gets an output whose ``error`` says why; the others still complete."""
        self._check_task("generate")
        plist = _as_prompt_list(prompts)
        loras = _per_prompt_loras(lora_request, len(plist)) or [None] * len(plist)
        ids: list[list[int]] = []
        for p in plist:
            raw = prompt_parts(p)[0]
            if isinstance(raw, torch.Tensor):
                raise ValueError("beam_search takes text or token-id prompts, not prompt_embeds")
            if isinstance(p, dict) and p.get("multi_modal_data") is not None:
                raise ValueError("beam_search takes text or token-id prompts, not images "
                                 "(multi_modal_data)")
            ids.append(self.engine.tokenize(raw) if isinstance(raw, str) else list(raw))
        engine = self.engine
        search = BeamSearch(ids, params, engine.eos_token_ids, engine.max_model_len)
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=params.max_tokens, desc="beam search", unit="step", dynamic_ncols=True)

        def step(reqs: list[tuple[int, list[int]]]) -> list[RequestOutput]:
            if bar is not None:
                bar.update(1)
            return self._run([r[1] for r in reqs], [search.step_params] * len(reqs), False,
                             [loras[r[0]] for r in reqs])

        try:
            run_beam_search(search, step)
        finally:
            if bar is not None:
                bar.close()
        tok = engine.tokenizer
        return search.results(
            (lambda t: str(tok.decode(t, skip_special_tokens=True))) if tok is not None else None)

    def _cross_score(self, left: list[Prompt], right: list[Prompt], priorities: list[int],
                     use_tqdm: bool) -> list[ScoringRequestOutput]:
        """A cross-encoder's score of each pair: one request per pair (engine.encode_pair)."""
        self._check_task("score")
        encode_pair = self.engine.encode_pair  # type: ignore[attr-defined]

        def text(p: Prompt) -> str | list[int]:
            raw = prompt_parts(p)[0]
            if isinstance(raw, torch.Tensor):
                raise ValueError("score takes text or token-id prompts, not prompt_embeds")
            return raw

        pairs: list[Prompt] = [encode_pair(text(left[0 if len(left) == 1 else j]), text(b))
                               for j, b in enumerate(right)]
        outs = self._run(pairs, [PoolingParams(task="score")] * len(pairs), use_tqdm, None, priorities)
        return [ScoringRequestOutput(str(j), ScoringOutput(float(o.embedding[0]))
                                     if o.embedding is not None else None,
                                     True, o.error) for j, o in enumerate(outs)]

    def classify(self, prompts: Prompt | Sequence[Prompt], *, use_tqdm: bool = True,
                 priority: Sequence[int] | None = None) -> list[ClassificationRequestOutput]:
        """vLLM's LLM.classify: a sequence classifier's class probabilities per prompt
        (BertForSequenceClassification, XLMRobertaForSequenceClassification; the decoders'
        Qwen2ForSequenceClassification, LlamaForSequenceClassification, ... read at the last
        prompt token), softmax over its labels (one label: the sigmoid; config's problem_type
        may say otherwise: config.classifier_activation); ``self.engine.model_config.labels``
        names them. A prompt that cannot run has ``error`` set and no outputs."""
        self._check_task("classify")
        plist = _as_prompt_list(prompts)
        priorities = self._per_prompt_priorities(priority, len(plist))
        outs = self._run(plist, [PoolingParams(task="classify")] * len(plist), use_tqdm, None, priorities)
        return [ClassificationRequestOutput(o.request_id, o.prompt_token_ids,
                                            ClassificationOutput(o.embedding.tolist())
                                            if o.embedding is not None else None,
                                            True, o.error) for o in outs]

    def _check_task(self, task: str) -> None:
        """The engine refuses what its model does not do (generation on an encoder or a
        sequence classifier, embedding on a cross-encoder or classifier, classify on a
        model without a classification head) with a ValueError saying what it does instead."""
        self.engine.check_task(task)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | None = None, *, use_tqdm: bool = True,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None,
             tools: list[dict[str, Any]] | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
             priority: Sequence[int] | None = None,
             mm_processor_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list) and generate.
        ``tools``: OpenAI function definitions the template shows the model (as vLLM's; the
        server reads calls back, server/tools.py). ``continue_final_message``: the last
        (assistant) message is continued rather than a new turn opened (with
        add_generation_prompt False); ``chat_template_kwargs``: more for the template (e.g.
        ``{"enable_thinking": False}``), as vLLM's. ``priority``: one per conversation, as
        in ``generate``. A model that takes images (LLaVA) reads image parts as vLLM's chat
        does: ``image_url`` (a base64 data URL) and ``image_pil`` (a PIL image); a model
        that takes videos (Qwen2-VL / Qwen3-VL, LLaVA-OneVision, InternVL) also ``video_url`` (a video
        file, decoded and sampled as ``media_io_kwargs`` says: engine/video_io.py) and
        ``{"type": "video", "video": frames}`` (an array (T, H, W, 3), a list of PIL images
        or of image URLs; engine/multimodal.chat_images); a model that takes audio
        (Qwen2-Audio) ``audio_url`` and ``input_audio`` parts (an audio file: its URL, or
        {"data": base64, "format": "wav"}; engine/audio_io.py). ``mm_processor_kwargs``:
        the processor's settings for these conversations' images, as vLLM's (``generate``'s)."""
        self._check_task("generate")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        extra = dict(chat_template_kwargs or {}, continue_final_message=continue_final_message)
        prompts: list[Prompt] = [self._chat_prompt(c, add_generation_prompt, tools, extra,  # type: ignore[arg-type]
                                                   mm_processor_kwargs) for c in convs]
        if mm_processor_kwargs is not None:
            prompts = [{**(p if isinstance(p, dict) else {"prompt_token_ids": p}),
                        "mm_processor_kwargs": mm_processor_kwargs} for p in prompts]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request,
                             priority=priority)

    def _chat_prompt(self, conversation: list[dict[str, Any]], add_generation_prompt: bool,
                     tools: list[dict[str, Any]] | None, extra: dict[str, Any],
                     mm_processor_kwargs: dict[str, Any] | None = None) -> Prompt:
        """One conversation's prompt: its ids, and with image parts (a model that takes
        images) its images as multi_modal_data, each part the template's placeholder (a
        video's frames sampled first where the processor is asked to: SmolVLM2's)."""
        encoder = getattr(self.engine, "mm_encoder", None)
        if encoder is None:
            return self.chat_prompt_ids(conversation, add_generation_prompt, tools, **extra)
        from flashpage.engine.multimodal import chat_images, place_images, placeholder_ids

        video_ids = getattr(encoder, "video_placeholder_ids", None)
        video_text = getattr(encoder, "video_placeholder_text", None)  # InternVL's <video>
        if video_ids is None and video_text is None and _has_parts(conversation, ("video", "video_url")):
            # refused before any file is read
            raise ValueError("video content parts given, but this model takes no video input "
                             "(Qwen2-VL / Qwen2.5-VL / Qwen3-VL, LLaVA-OneVision, InternVL, SmolVLM2 and GLM-4.1V do)")
        takes_audio = getattr(encoder, "modality", "image") == "audio"
        if not takes_audio and _has_parts(conversation, ("audio_url", "input_audio")):
            raise ValueError("audio content parts given, but this model takes no audio input (Qwen2-Audio does)")
        if takes_audio and _has_parts(conversation, ("image_url", "image_pil", "video", "video_url")):
            raise ValueError("image or video content parts given, but this model takes audio alone")
        conv, parts, images, videos, audios = chat_images(conversation, self.engine.config.media_policy)
        if not images and not videos and not audios:
            return self.chat_prompt_ids(conv, add_generation_prompt, tools, **extra)
        tok = self.engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise ValueError("this model has no chat template")
        template = tok.chat_template if isinstance(tok.chat_template, str) else None
        if audios:  # Qwen2-Audio: "Audio k: <|audio_bos|><|AUDIO|><|audio_eos|>" where the template prints text
            conv = place_images(conv, parts, template, "", audio_placeholder=encoder.placeholder_text)
            ids = tok.apply_chat_template(conv, tools=tools, add_generation_prompt=add_generation_prompt,
                                          tokenize=True, return_dict=False, **extra)
            return {"prompt_token_ids": list(ids), "multi_modal_data": {"audio": audios}}
        if video_text is None and video_ids is not None:
            video_text = tok.decode(video_ids)
        conv = place_images(conv, parts, template, tok.decode(placeholder_ids(encoder)), video_text)
        data: dict[str, Any] = {"image": images} if images else {}
        if videos:
            data["video"] = videos
            sample = getattr(encoder, "sample_videos", None)
            if sample is not None:  # SmolVLM2's do_sample_frames, before the frames' text is written
                data = sample(data, mm_processor_kwargs)
        expand = getattr(encoder, "expand_videos", None)
        if videos and expand is not None:
            # InternVL: a video's "FrameN: ..." text is written into the rendered template and
            # tokenized with it (as its processor's apply_chat_template does)
            text = tok.apply_chat_template(conv, tools=tools, add_generation_prompt=add_generation_prompt,
                                           tokenize=False, **extra)
            ids = tok.encode(expand(text, data), add_special_tokens=False)
        else:
            ids = tok.apply_chat_template(conv, tools=tools, add_generation_prompt=add_generation_prompt,
                                          tokenize=True, return_dict=False, **extra)
        return {"prompt_token_ids": list(ids), "multi_modal_data": data}

    def chat_prompt_ids(self, conversation: list[dict[str, Any]], add_generation_prompt: bool = True,
                        tools: list[dict[str, Any]] | None = None, **template_kw: Any) -> list[int]:
        _check_text_only(conversation)
        tok = self.engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise ValueError("this model has no chat template")
        if getattr(self.engine, "mm_encoder", None) is not None and template_reads_parts(tok.chat_template):
            conversation = as_text_parts(conversation)  # an image model's template reads parts
        ids = tok.apply_chat_template(conversation, tools=tools, add_generation_prompt=add_generation_prompt,
                                      tokenize=True, return_dict=False, **template_kw)
        return list(ids)

    def _per_prompt_priorities(self, priority: Sequence[int] | None, n: int,
                               what: str = "prompt") -> list[int]:
        """vLLM's ``priority``: a list with one integer per prompt (per ``what``); checked
        whole before any request is added (a wrong one is the caller's mistake, not a
        prompt's)."""
        if priority is None:
            return [0] * n
        if isinstance(priority, int) or not isinstance(priority, Sequence):
            raise ValueError(f"priority must be a list with one integer per {what}, got {priority!r}")
        if len(priority) != n:
            raise ValueError(f"got {len(priority)} priorities for {n} {what}s")
        for p in priority:
            self.engine.check_priority(p)
        return list(priority)

    def _run(self, prompts: list[Prompt], params: Sequence[SamplingParams | PoolingParams],
             use_tqdm: bool, loras: Sequence[LoRARequest | None] | None = None,
             priorities: Sequence[int] | None = None) -> list[RequestOutput]:
        engine = self.engine
        check_awake = getattr(engine, "check_awake", None)  # (an encoder engine never sleeps)
        if check_awake is not None:
            check_awake()  # asleep: one error for the call, naming the wake_up that fixes it
        results: dict[str, RequestOutput] = {}
        order: list[str] = []
        loras = loras if loras is not None else [None] * len(prompts)
        priorities = priorities if priorities is not None else [0] * len(prompts)
        for i, (p, sp, lora, prio) in enumerate(zip(prompts, params, loras, priorities, strict=True)):
            rid = f"gen-{id(self)}-{engine._counter}-{i}"
            order.append(rid)
            try:
                ids_or_text, salt = prompt_parts(p)
                mm = {k: p[k] for k in ("multi_modal_data", "mm_processor_kwargs")
                      if isinstance(p, dict) and p.get(k) is not None}
                engine.add_request(rid, ids_or_text, sp, lora_request=lora, priority=prio,
                                   cache_salt=salt, **mm)
            except ValueError as e:
                ids_or_text = p if not isinstance(p, dict) else p.get("prompt_token_ids", [])
                logger.warning("request %d refused: %s", i, e)
                ids = [] if isinstance(ids_or_text, str) else list(cast(list[int], ids_or_text))
                results[rid] = RequestOutput(rid, p if isinstance(p, str) else None, ids,
                                             [], finished=True, error=str(e))
        engine._counter += 1
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(prompts) - len(results), desc="generate", unit="req",
                       dynamic_ncols=True)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step(final_only=True):
                    if out.finished:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
            pending = [rid for rid in order if rid not in results]
            if pending:  # interrupted: leave nothing behind in the cache
                engine.abort_request(pending)
        return [results[rid] for rid in order]


def _per_prompt_loras(lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
                      n: int) -> list[LoRARequest | None] | None:
    """vLLM's ``lora_request``: one for all prompts, or one (or None) per prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    loras = list(lora_request)
    if len(loras) != n:
        raise ValueError(f"got {len(loras)} LoRA requests for {n} prompts")
    return loras


_PROMPT_KEYS = ("prompt", "prompt_token_ids", "prompt_embeds")
# a prompt dict's keys beside its one prompt key
_PROMPT_EXTRAS = {"cache_salt", "multi_modal_data", "mm_processor_kwargs"}


def prompt_parts(p: Prompt) -> tuple[str | list[int] | torch.Tensor, str | None]:
    """A prompt's text, token ids or input embeddings, and its cache salt: vLLM's prompt
    dicts ({"prompt": text}, {"prompt_token_ids": [...]} or {"prompt_embeds": tensor},
    each with an optional "cache_salt")."""
    if not isinstance(p, dict):
        return p, None
    unknown = set(p) - {*_PROMPT_KEYS, *_PROMPT_EXTRAS}
    given = [k for k in _PROMPT_KEYS if k in p]
    if unknown or len(given) != 1:
        raise ValueError(f"a prompt dict takes one of 'prompt' (text), 'prompt_token_ids' or "
                         f"'prompt_embeds', and optionally 'cache_salt', 'multi_modal_data' and "
                         f"'mm_processor_kwargs'; "
                         f"got keys {sorted(p)}")
    if given[0] == "prompt_embeds" and not isinstance(p["prompt_embeds"], torch.Tensor):
        raise ValueError(f"prompt_embeds must be a torch.Tensor [num_tokens, hidden_size], "
                         f"got {type(p['prompt_embeds']).__name__}")
    return cast(str | list[int] | torch.Tensor, p[given[0]]), p.get("cache_salt")


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    plist = list(prompts)
    if plist and all(isinstance(t, int) and not isinstance(t, bool) for t in plist):
        return [cast(list[int], plist)]  # one prompt given as token ids
    return cast(list[Prompt], plist)


def _has_parts(conversation: list[dict[str, Any]], kinds: tuple[str, ...]) -> bool:
    """Whether a conversation holds a content part of one of these types."""
    return any(isinstance(p, dict) and p.get("type") in kinds
               for m in conversation if isinstance(m.get("content"), list) for p in m["content"])
