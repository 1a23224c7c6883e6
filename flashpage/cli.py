"""``flashpage generate | chat | inspect | serve | run-batch | bench``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Any

from flashpage import envs

logger = logging.getLogger("flashpage")


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="HF model folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--tokenizer", default=None, help="tokenizer folder, if not the model's")
    g.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), float32, float16, bfloat16")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    g.add_argument("--block-size", type=int, default=16, help="KV cache block size in tokens (power of two, 1-256)")
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=8192)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="at most this many tokens of one prompt a step (vLLM's; 0: up to "
                        "--max-num-batched-tokens), so long prompts advance side by side")
    g.add_argument("--num-gpu-blocks", type=int, default=None, help="KV cache size in blocks (default: from memory)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    g.add_argument("--kv-offloading-size", type=float, default=0.0, metavar="GIB",
                   help="GiB of host (CPU) memory for a second tier of the prefix cache: blocks "
                        "the GPU pool evicts are kept there and loaded back on a prefix hit "
                        "instead of recomputed (vLLM's; default 0: off)")
    g.add_argument("--kv-offloading-backend", default="native", choices=["native"],
                   help="the host tier's backend (vLLM's flag; native only)")
    g.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                   help="one block table for every layer of a model mixing sliding-window and "
                        "full-attention layers (default: KV cache groups; windowed layers give "
                        "back the blocks behind their window)")
    g.add_argument("--attention-backend", default=None,
                   help="torch_native, triton or flex (default: the fastest that runs here; "
                        "or FLASHPAGE_ATTENTION_BACKEND)")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--enable-sleep-mode", action="store_true",
                   help="vLLM's sleep mode: LLM.sleep / wake_up (the server's POST /sleep and "
                        "/wake_up with FLASHPAGE_SERVER_DEV_MODE=1) release and retake the GPU "
                        "memory of the weights and the KV cache")
    g.add_argument("--enable-prompt-embeds", action="store_true",
                   help="accept prompts given as input embeddings (vLLM's: {\"prompt_embeds\": "
                        "tensor} in LLM.generate, the completions API's prompt_embeds field)")
    g.add_argument("--allowed-local-media-path", default=None, metavar="FOLDER",
                   help="file:// image and video URLs may name files under this folder (default: none)")
    g.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                   help="http(s) image and video URLs may name only these hosts (default: any)")
    g.add_argument("--media-io-kwargs", type=_json_object, default=None, metavar="JSON",
                   help="how a video file is sampled, vLLM's: '{\"video\": {\"num_frames\": 16}}' "
                        "(default 32 frames spaced evenly; -1: every frame; \"fps\": 2 caps them to 2 a "
                        "second; needs PyAV: pip install av)")
    g.add_argument("--limit-mm-per-prompt", type=_mm_limits, default=None, metavar="JSON",
                   help="the most images (videos, audios) one prompt may hold, vLLM's form: '{\"image\": 2}' "
                        "(or image=2,video=1); {\"image\": 0} serves an image model's text alone "
                        "(a video model: Qwen2-VL, LLaVA-OneVision, InternVL: {\"image\": 0, \"video\": 0}; "
                        "Qwen2-Audio: {\"audio\": 0})")
    g.add_argument("--mm-processor-kwargs", type=_json_object, default=None, metavar="JSON",
                   help="the processors' settings, vLLM's: '{\"max_pixels\": 1003520}' "
                        "(Qwen2-VL's min_pixels / max_pixels; fps: Qwen2.5-VL's videos' frame rate; "
                        "Gemma 3's do_pan_and_scan and pan_and_scan_* crop settings)")
    g.add_argument("--mm-encoder-cache-tokens", type=int, default=None, metavar="ROWS",
                   help="image rows (encoder outputs) kept on the device for later requests of the same "
                        "image (default: --max-num-batched-tokens' worth; 0: none)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule step N+1 while the GPU runs step N (default: on with CUDA)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="auto: the model's dtype; fp8: float8_e4m3fn, half the KV bytes of bf16 "
                        "(scale 1)")
    g.add_argument("--quantization", "-q", default=None, choices=["fp8", "int4", "rtn"],
                   help="fp8: attention and MLP weights quantized at load to float8_e4m3fn with "
                        "per-row scales (half the weight bytes of bf16); int4: to 4-bit integers "
                        "in groups of 128 (RTN_GROUP_SIZE), round to nearest (a quarter); rtn: "
                        "vLLM's name for it (with RTN_NUM_BITS=4). Embeddings, LM head, norms "
                        "and MoE experts stay 16-bit. Checkpoints already in fp8 (config.json's "
                        "quantization_config; AWQ / GPTQ int4 ones too) need no flag")
    g.add_argument("--seed", type=int, default=0)
    add_vllm_compat_arguments(p)
    g.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="a Jinja chat template (a file, or the text) instead of the tokenizer's own")
    g.add_argument("--random-weights-config", default=None, metavar="CONFIG",
                   help="random weights of this config.json's shape (benchmarks; no tokenizer)")
    g.add_argument("--pooling-type", default=None, choices=["last", "mean", "cls"],
                   help="embeddings: how a prompt's hidden states are pooled (default: the model's "
                        "sentence-transformers config, else last)")
    g.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (PEFT folders) beside the base model")
    g.add_argument("--max-loras", type=int, default=1,
                   help="LoRA: the most distinct adapters in one step (their slots)")
    g.add_argument("--max-lora-rank", type=int, default=16, help="LoRA: the largest adapter rank")
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="fcfs: requests served in arrival order; priority: by each request's "
                        "priority (lower first, ties by arrival; the server's \"priority\" "
                        "field), a higher one preempting lower ones when the KV cache is full")
    g.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                   help="sampling defaults: auto (the model's generation_config.json: its "
                        "temperature, top_p, top_k, min_p, repetition_penalty for what a request "
                        "leaves unset, max_new_tokens as a cap), vllm (none), or a folder's file")
    g.add_argument("--override-generation-config", default=None, metavar="JSON", type=_json_object,
                   help='values over the generation config, e.g. \'{"temperature": 0.5}\'')
    g.add_argument("--hf-overrides", default=None, metavar="JSON", type=_json_object,
                   help="fields over the model's config.json, as vLLM, e.g. '{\"architectures\": "
                        "[\"Qwen3ForSequenceClassification\"], \"classifier_from_token\": "
                        "[\"no\", \"yes\"], \"is_original_qwen3_reranker\": true}' (a causal LM "
                        "served as a reranker: its score head built from the LM head's rows)")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, as vLLM: \'{"method": "ngram", "num_speculative_tokens": 3, '
                        '"prompt_lookup_max": 4}\' (drafts looked up in the request\'s own tokens), '
                        '\'{"model": "DRAFT_PATH", "num_speculative_tokens": 4}\' (a smaller draft '
                        'model with the same vocabulary), \'{"method": "mtp", "num_speculative_tokens": 1}\' '
                        '(the checkpoint\'s own multi-token-prediction layer: GLM-4.5, DeepSeek-V3), '
                        '\'{"method": "eagle3", "model": "EAGLE_HEAD_PATH", "num_speculative_tokens": 3}\' '
                        '(an EAGLE-1 ("eagle") or EAGLE-3 head over a Llama-family target), or '
                        '\'{"method": "medusa", "model": "MEDUSA_PATH", "num_speculative_tokens": 3}\' '
                        '(Medusa heads: a chain of one draft a head)')


def add_vllm_compat_arguments(p: argparse.ArgumentParser) -> None:
    """vLLM flags a pasted vLLM command carries, taken for what they mean here
    (``apply_vllm_compat``): one GPU, prompts always chunked, preemption by recomputation,
    our own model code."""
    g = p.add_argument_group("vLLM compatibility")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="1 only: flashpage runs on one GPU")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, help="1 only")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1, help="1 only")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="prefix caching (on by default; --no-enable-prefix-caching = --no-prefix-caching)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="prompts are always chunked here (--max-num-batched-tokens a step): "
                        "accepted, no effect")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="let transformers run a checkpoint's own tokenizer code (tokenizer_config.json's "
                        "auto_map: InternLM2's); the model's code is always flashpage's")
    g.add_argument("--swap-space", type=float, default=None,
                   help="accepted, no effect: a preempted request's KV is recomputed, not swapped")
    g.add_argument("--disable-log-stats", action="store_true", help="accepted, no effect")
    g.add_argument("--disable-log-requests", action="store_true",
                   help="accepted, no effect (requests are logged only with --enable-log-requests)")
    g.add_argument("--enable-log-requests", action="store_true",
                   help="log each request at arrival (id, route, prompt tokens, sampling "
                        "params) and at finish (finish reason, output tokens), at INFO")
    g.add_argument("--max-logprobs", type=int, default=20,
                   help="the most logprobs a request may ask for: 20 here (a smaller value is "
                        "not enforced yet; a larger one is an error)")


def apply_vllm_compat(args: argparse.Namespace) -> None:
    """Check and fold the vLLM compatibility flags into ours: a parallel size other than 1
    or --max-logprobs above 20 is a ValueError naming the flag; --no-enable-prefix-caching
    turns prefix caching off; the no-effect flags log what they do not do."""
    for flag in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        size = getattr(args, flag, 1)
        if size != 1:
            name = "--" + flag.replace("_", "-")
            raise ValueError(f"{name} {size}: flashpage runs on one GPU (1 only)")
    if getattr(args, "max_logprobs", 20) > 20:
        raise ValueError(f"--max-logprobs {args.max_logprobs}: at most 20 here")
    if getattr(args, "enable_prefix_caching", None) is False:
        args.no_prefix_caching = True
    if getattr(args, "enable_chunked_prefill", None) is False:
        logger.warning("--no-enable-chunked-prefill: prompts are always chunked here "
                       "(raise --max-num-batched-tokens to run long prompts in fewer steps)")
    if getattr(args, "swap_space", None):
        logger.info("--swap-space: no CPU swap here; a preempted request's KV is recomputed")


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def build_llm(args: argparse.Namespace) -> Any:
    from flashpage.llm import LLM

    apply_vllm_compat(args)

    return LLM(args.model, tokenizer=args.tokenizer, trust_remote_code=getattr(args, "trust_remote_code", False),
               dtype=args.dtype, device=args.device,
               block_size=args.block_size, max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
               enable_prefix_caching=not args.no_prefix_caching,
               kv_offloading_size=getattr(args, "kv_offloading_size", 0.0),
               kv_offloading_backend=getattr(args, "kv_offloading_backend", "native"),
               attention_backend=args.attention_backend, num_gpu_blocks=args.num_gpu_blocks,
               gpu_memory_utilization=args.gpu_memory_utilization,
               enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling,
               enable_sleep_mode=getattr(args, "enable_sleep_mode", False),
               kv_cache_dtype=args.kv_cache_dtype, seed=args.seed,
               quantization=getattr(args, "quantization", None),
               chat_template=getattr(args, "chat_template", None),
               random_weights_config=getattr(args, "random_weights_config", None),
               pooling_type=getattr(args, "pooling_type", None),
               speculative_config=getattr(args, "speculative_config", None),
               enable_lora=getattr(args, "enable_lora", False),
               max_loras=getattr(args, "max_loras", 1), max_lora_rank=getattr(args, "max_lora_rank", 16),
               scheduling_policy=getattr(args, "scheduling_policy", "fcfs"),
               long_prefill_token_threshold=getattr(args, "long_prefill_token_threshold", 0),
               disable_hybrid_kv_cache_manager=getattr(args, "disable_hybrid_kv_cache_manager", False),
               generation_config=getattr(args, "generation_config", "auto"),
               override_generation_config=getattr(args, "override_generation_config", None),
               hf_overrides=getattr(args, "hf_overrides", None),
               enable_prompt_embeds=getattr(args, "enable_prompt_embeds", False),
               allowed_local_media_path=getattr(args, "allowed_local_media_path", None),
               allowed_media_domains=getattr(args, "allowed_media_domains", None),
               media_io_kwargs=getattr(args, "media_io_kwargs", None),
               limit_mm_per_prompt=getattr(args, "limit_mm_per_prompt", None),
               mm_processor_kwargs=getattr(args, "mm_processor_kwargs", None),
               mm_encoder_cache_tokens=getattr(args, "mm_encoder_cache_tokens", None))


def _mm_limits(text: str) -> dict[str, int]:
    """--limit-mm-per-prompt: a JSON object ({"image": 2}) or vLLM's older image=2[,video=0]."""
    import json

    try:
        value = json.loads(text)
    except ValueError:
        value = {}
        for part in text.split(","):
            key, sep, n = part.partition("=")
            if not sep or not n.strip().isdigit():
                raise argparse.ArgumentTypeError(f"--limit-mm-per-prompt: {text!r} is neither JSON "
                                                 "nor modality=count pairs") from None
            value[key.strip()] = int(n)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"--limit-mm-per-prompt must be a JSON object, got {text!r}")
    return value


def add_lora_module_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters a request selects by naming one as its model: name=path "
                        "or JSON {\"name\": ..., \"path\": ...} (needs --enable-lora)")


def parse_lora_modules(items: list[str]) -> list[Any]:
    """--lora-modules' name=path (or vLLM's JSON form) items -> LoRARequests, ids 1, 2, ..."""
    import json

    from flashpage.lora.request import LoRARequest

    out = []
    for i, item in enumerate(items):
        if item.lstrip().startswith("{"):
            try:
                d = json.loads(item)
                name, path = d["name"], d["path"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"--lora-modules: {item!r} is not JSON with name and path") from None
        else:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules: {item!r} is not name=path")
        out.append(LoRARequest(name, i + 1, path))
    return out


def sampling_params(args: argparse.Namespace) -> Any:
    from flashpage.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                          seed=args.sample_seed, stop=args.stop, ignore_eos=args.ignore_eos)


def cmd_generate(args: argparse.Namespace) -> int:
    params = sampling_params(args)  # before loading the model: a bad flag fails at once
    llm = build_llm(args)
    if args.chat:
        prompts: list[Any] = [llm.chat_prompt_ids([{"role": "user", "content": p}]) for p in args.prompt]
    else:
        prompts = list(args.prompt)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(args.prompt, outs, strict=True):
        if out.error:
            print(f"error: {out.error}", file=sys.stderr)
            return 2
        o = out.outputs[0]
        if len(args.prompt) > 1:
            print(f"### {prompt}")
        print(o.text)
        m = out.metrics
        if args.verbose and m is not None and m.finished_time is not None:
            dt = m.finished_time - m.arrival_time
            print(f"[{len(o.token_ids)} tokens, finish={o.finish_reason}, {dt:.2f}s, "
                  f"{len(o.token_ids) / max(dt, 1e-9):.1f} tok/s]", file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    """Interactive chat; tokens are printed as they are produced."""
    params = sampling_params(args)
    llm = build_llm(args)
    engine = llm.engine
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    one_shot = args.message is not None
    while True:
        if one_shot:
            user = args.message
        else:
            try:
                user = input("you> ")
            except EOFError:
                print()
                return 0
            if user.strip() in ("/exit", "/quit"):
                return 0
            if not user.strip():
                continue
        history.append({"role": "user", "content": user})
        ids = llm.chat_prompt_ids(history)
        rid = engine.add_request(None, ids, params)
        if not one_shot:
            print("assistant> ", end="", flush=True)
        reply = ""
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.request_id == rid:
                        delta = out.new_text[0]
                        reply += delta
                        print(delta, end="", flush=True)
        except KeyboardInterrupt:
            engine.abort_request(rid)
        print()
        history.append({"role": "assistant", "content": reply})
        if one_shot:
            return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from flashpage.inspect import run_inspect

    return run_inspect(args)


def add_tool_arguments(p: argparse.ArgumentParser) -> None:
    from flashpage.server.tools import PARSERS

    p.add_argument("--tool-call-parser", default=None, choices=sorted(PARSERS),
                   help="how the model writes tool calls, as vLLM names them (hermes: Qwen2.5, "
                        "Hermes; llama3_json: Llama 3.1+; mistral; pythonic, llama4_pythonic: Llama 3.2 / 4; "
                        "qwen3_coder, qwen3_xml: Qwen3-Coder; deepseek_v3: DeepSeek-V3 / R1; deepseek_v31: "
                        "DeepSeek-V3.1; kimi_k2: Kimi K2; glm45: GLM-4.5 / 4.6; granite: Granite 3.x; jamba: Jamba; "
                        "internlm: InternLM2 / 2.5; granite-20b-fc: granite-20b-functioncalling; phi4_mini_json: "
                        "Phi-4-mini; xlam: Salesforce xLAM; hunyuan_a13b: Hunyuan-A13B; seed_oss: Seed-OSS; "
                        "minimax: MiniMax-M1; openai: GPT-OSS's harmony calls, with openai_gptoss's "
                        "channels in front)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model decide when to call tools (tool_choice "auto"; needs '
                        "--tool-call-parser)")
    from flashpage.server.reasoning import REASONING_PARSERS

    p.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="answer a reasoning model's <think> ... </think> apart, as a chat "
                        "message's reasoning (vLLM's names: deepseek_r1: DeepSeek-R1, QwQ; "
                        "qwen3; deepseek_v3: DeepSeek-V3.1; glm45; openai_gptoss: GPT-OSS's harmony "
                        "analysis channel); structured outputs then start after the thinking "
                        "(<think> formats; with openai_gptoss they need --structured-outputs-in-reasoning)")
    p.add_argument("--structured-outputs-in-reasoning", action="store_true",
                   help="with --reasoning-parser: structured outputs cover the thinking too "
                        "(vLLM's enable_in_reasoning)")


def add_http_arguments(p: argparse.ArgumentParser) -> None:
    """vLLM's HTTP flags: CORS (its defaults: every origin, method and header, no
    credentials), TLS, a root path behind a proxy, uvicorn's log level."""
    g = p.add_argument_group("HTTP")
    g.add_argument("--allowed-origins", type=_json_list, default=["*"], metavar="JSON",
                   help='CORS origins, a JSON list (default ["*"])')
    g.add_argument("--allowed-methods", type=_json_list, default=["*"], metavar="JSON")
    g.add_argument("--allowed-headers", type=_json_list, default=["*"], metavar="JSON")
    g.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    g.add_argument("--ssl-keyfile", default=None)
    g.add_argument("--ssl-certfile", default=None)
    g.add_argument("--ssl-ca-certs", default=None)
    g.add_argument("--root-path", default=None,
                   help="the path prefix a proxy serves the app under (FastAPI's root_path)")
    g.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])


def _json_list(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from e
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"a JSON list of strings is needed, got {text!r}")
    return value


def cmd_serve(args: argparse.Namespace) -> int:
    from flashpage.server.api_server import run_server

    return run_server(args)


def cmd_run_batch(args: argparse.Namespace) -> int:
    try:
        from flashpage.server.run_batch import run
    except ImportError as e:
        raise RuntimeError("flashpage run-batch runs the server's request handlers, which need "
                           f"the serve extra: pip install 'flashpage[serve]' ({e})") from None
    return run(args)


def cmd_bench(args: argparse.Namespace) -> int:
    import importlib

    module = {"memory": "flashpage.bench.memory", "throughput": "flashpage.bench.throughput",
              "latency": "flashpage.bench.latency", "serve": "flashpage.bench.serve"}[args.what]
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        print(f"error: `flashpage bench {args.what}` is not available here: {e}", file=sys.stderr)
        return 2
    return int(mod.main(args.rest) or 0)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=envs.log_level(), format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    try:
        return int(args.func(args) or 0)
    except (ValueError, RuntimeError, OSError) as e:
        logging.getLogger("flashpage").debug("failed after %.1fs", time.perf_counter() - t0, exc_info=True)
        print(f"error: {e}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    """The ``flashpage`` command line: a subcommand each, its handler in ``func``."""
    parser = argparse.ArgumentParser(prog="flashpage", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="generate text for one or more prompts")
    p.add_argument("prompt", nargs="+")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("-v", "--verbose", action="store_true", help="print token counts and speed")
    add_engine_arguments(p)
    add_sampling_arguments(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="chat with the model (interactive, streaming)")
    p.add_argument("message", nargs="?", default=None, help="one message to answer, then exit")
    p.add_argument("--system", default=None, help="system prompt")
    add_engine_arguments(p)
    add_sampling_arguments(p)
    p.set_defaults(func=cmd_chat)

    from flashpage.inspect import add_inspect_arguments

    p = sub.add_parser("inspect", help="attention kind and KV cache cost of a model")
    add_inspect_arguments(p)
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    p.add_argument("model_path", nargs="?", default=None, help="model (same as --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--files-dir", default=None,
                   help="where the Files / Batches API keeps uploaded files and batch results "
                        "(default: in memory; FLASHPAGE_FILES_MAX_BYTES bounds them either way)")
    add_http_arguments(p)
    add_tool_arguments(p)
    add_lora_module_arguments(p)
    add_engine_arguments(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("run-batch", help="run a file of OpenAI Batch API requests offline "
                       "(vLLM's run-batch)")
    p.add_argument("-i", "--input-file", required=True,
                   help="JSON Lines, a request a line ({\"custom_id\", \"method\": \"POST\", "
                        "\"url\": \"/v1/chat/completions\", \"body\"}): a path, an http(s) URL, "
                        "or - for stdin")
    p.add_argument("-o", "--output-file", required=True,
                   help="the results, a line per request in input order: a path, an http(s) "
                        "URL (PUT there at the end), or - for stdout")
    p.add_argument("--output-tmp-dir", default=None,
                   help="where the output is kept before it is PUT to an http(s) -o (vLLM's; "
                        "default: the system's temporary folder)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name request bodies may give (default: as serve names it; "
                        "the --model argument itself is taken too)")
    add_tool_arguments(p)
    add_lora_module_arguments(p)
    add_engine_arguments(p)
    p.set_defaults(func=cmd_run_batch)

    p = sub.add_parser("bench", help="benchmarks: memory, throughput, latency, serve")
    p.add_argument("what", choices=["memory", "throughput", "latency", "serve"])
    p.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own arguments")
    p.set_defaults(func=cmd_bench)
    return parser


if __name__ == "__main__":
    sys.exit(main())
