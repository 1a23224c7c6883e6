"""Image requests end to end (LLaVA-1.5-7B shape, random weights): output tokens/s of a batch
of requests that each carry one image, against transformers' LlavaForConditionalGeneration
generate on the same workload in the same run; and the image tower alone (CLIP ViT-L/14-336
and the projector: images/s of our encoder against transformers' get_image_features).

Every request: BOS, a system text shared by all (--system tokens), its image (576 rows),
then its own question (--question tokens); --output-len tokens out, EOS ignored. Each image
is different (random pixel values), so what the prefix cache can share is the system text
before the image (the prefix hits printed: (requests - 1) x the system text's full blocks
when it is shared). transformers runs the same requests in batches of --hf-batch-size
(left-padded), its weights random too (speed does not depend on them).

    python benchmarks/vlm.py --json-out $OUT/vlm.json
    python benchmarks/vlm.py --requests 64 --hf-requests 32 --config /path/to/llava/config.json
    python benchmarks/vlm.py --config qwen2.5-vl-7b --json-out $OUT/vlm_qwen.json

Qwen2-VL / Qwen2.5-VL / Qwen3-VL configs: each request's placeholder is <|vision_start|>
<|image_pad|><|vision_end|>, its image uint8 pixels the engine preprocesses (448 x 448: 256
rows; Qwen3-VL's 16-pixel patches: 196); transformers' own class beside it, fed the patches
and grids our preprocessing makes (its processor's output) and mm_token_type_ids. Gemma 3 (--config
gemma-3-4b-it): <start_of_image>, 896 x 896 uint8 pixels, 256 rows each attending to each
other both ways; transformers' Gemma3ForConditionalGeneration beside it (token_type_ids
marking the image rows, as its processor gives them).

    python benchmarks/vlm.py --config gemma-3-4b-it --json-out $OUT/vlm_gemma.json

InternVL (--config internvl3-2b-hf, transformers' InternVLForConditionalGeneration layout):
<IMG_CONTEXT> as the placeholder (the engine puts <img> / </img> around its rows), uint8
pixels the engine tiles: 448 x 448 is one tile of 256 rows, --image-size 896 a 2 x 2 grid and
its thumbnail (1,280 rows); transformers' InternVLForConditionalGeneration beside it, fed our
tiles normalized as GotOcr2ImageProcessor does.

    python benchmarks/vlm.py --config internvl3-2b-hf --json-out $OUT/vlm_internvl.json
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import time

import torch

from flashpage.bench.common import device_name, median_seconds, resolve_config, sync
from flashpage.bench.throughput import _gpu_ms, _record_gpu_spans, _record_steps, _step_summary
from flashpage.llm import LLM
from flashpage.sampling_params import SamplingParams


def workload(n: int, system: int, question: int, vocab: int, placeholder: list[int], size: int,
             seed: int = 0, uint8: bool = False, avoid: frozenset[int] = frozenset(),
             distinct: int = 0, question_first: bool = False):
    """(prompt ids with one image placeholder each, one [3, size, size] image each: float
    pixel values (LLaVA) or uint8 pixels (Qwen2-VL, Gemma 3: preprocessed by the engine, as
    a PIL image or a decoded file would come)). ``distinct``: that many different images,
    request i taking image i mod distinct (0: each its own); ``question_first``: each
    request's own text before its image (the prefix cache then shares none of its blocks)."""
    g = torch.Generator().manual_seed(seed)

    def text(k: int) -> list[int]:
        return [t if t not in placeholder and t not in avoid else 3
                for t in torch.randint(3, vocab, (k,), generator=g).tolist()]

    shared = text(system)
    prompts = [[1, *shared, *q, *placeholder] if question_first else [1, *shared, *placeholder, *q]
               for q in (text(question) for _ in range(n))]
    pool = [torch.randint(0, 256, (3, size, size), dtype=torch.uint8, generator=g) if uint8
            else torch.randn(3, size, size, generator=g) for _ in range(distinct or n)]
    return prompts, [pool[i % len(pool)] for i in range(n)]


def time_tower(llm: LLM, hf, images: list[torch.Tensor], batch: int, iters: int) -> dict:
    """Images/s through our encoder (tower + projector) and transformers' get_image_features,
    batches of ``batch`` images, median of ``iters``."""
    enc = llm.engine.mm_encoder
    assert enc is not None
    dev, dtype = llm.engine.device, llm.engine.dtype
    # ours from the request's form (uint8 pixels normalized by encode on the device, or float
    # pixel values; Qwen-VL's resized uint8 as admit_image keeps them, here on the device);
    # transformers' from the pixel values its processor would give
    if hasattr(enc, "admit_image"):
        data = []
        for im in images[:batch]:
            kept = enc.admit_image(im)
            data.append(dataclasses.replace(kept, pixels=kept.pixels.to(dev)))
    else:
        data = [im.to(dev) if im.dtype == torch.uint8 else im.to(dev, dtype) for im in images[:batch]]
    theirs_kw = hf_image_kwargs(hf, [enc.pixel_values(im) for im in images[:batch]], dev, enc.config.processing)

    def ours() -> None:
        enc.encode(data)

    def theirs() -> None:
        if hasattr(hf.config, "vision_feature_layer"):  # LLaVA
            theirs_kw.update(vision_feature_layer=hf.config.vision_feature_layer,
                             vision_feature_select_strategy=hf.config.vision_feature_select_strategy)
        hf.model.get_image_features(**theirs_kw)

    with torch.inference_mode():
        out = {name: batch / median_seconds(fn, iters) for name, fn in (("ours", ours), ("transformers", theirs))}
    return out


def hf_image_kwargs(hf, pixels: list, device: torch.device, proc=None) -> dict:
    """transformers' image arguments for ``pixels`` (our encoder's pixel_values of each
    image: the float tensors its processor gives, Qwen-VL's patches and grids, or InternVL's
    uint8 tiles, normalized by ``proc``, the encoder's ImageProcessing, as GotOcr2's)."""
    dtype = next(hf.parameters()).dtype
    if hasattr(pixels[0], "grid"):  # Qwen-VL: patches of every image in one tensor, and their grids
        return {"pixel_values": torch.cat([p.patches for p in pixels]).to(device, dtype),
                "image_grid_thw": torch.tensor([list(p.grid) for p in pixels], device=device)}
    if type(pixels[0]).__name__ == "InternVLImage":  # every tile of every image, in order
        from flashpage.models.clip_image import normalize

        return {"pixel_values": normalize(torch.cat([p.pixels for p in pixels]).to(device), proc).to(dtype)}
    return {"pixel_values": torch.stack(pixels).to(device, dtype)}


@torch.inference_mode()
def hf_throughput(hf, prompts, pixels, image_token: int, batch: int, out_len: int, proc=None) -> dict:
    """transformers' generate over ``prompts`` (ids as the engine expanded them: each image's
    rows at ``image_token``), left-padded batches of ``batch``; ``pixels``: hf_image_kwargs'
    input per prompt. Gemma 3's token_type_ids and Qwen-VL's mm_token_type_ids (1 on the image
    rows, as their processors give them) are passed where the model takes them."""
    device = next(hf.parameters()).device
    takes = inspect.signature(hf.forward).parameters
    types = next((k for k in ("token_type_ids", "mm_token_type_ids") if k in takes), None)
    total, done = 0.0, 0
    for s in range(0, len(prompts), batch):
        ps = prompts[s:s + batch]
        width = max(len(p) for p in ps)
        ids = torch.zeros(len(ps), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(ps):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        sync()
        t0 = time.perf_counter()
        extra = hf_image_kwargs(hf, pixels[s:s + batch], device, proc)
        if types:
            extra[types] = (ids == image_token).long().to(device)
        hf.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                    max_new_tokens=out_len, min_new_tokens=out_len, do_sample=False, pad_token_id=0, **extra)
        sync()
        total += time.perf_counter() - t0
        done += len(ps) * out_len
    return {"requests": len(prompts), "output_tokens": done, "seconds": total, "output_tok_per_s": done / total}


def _steps_line(steps: dict) -> str:
    """One line of _step_summary's groups: kind count x wall ms (GPU ms) = seconds."""
    return "; ".join(f"{k} {v['steps']} x {v['ms_per_step']} ms ({v.get('gpu_ms_per_step', '-')}) = {v['seconds']} s"
                     for k, v in steps.items() if isinstance(v, dict) and "steps" in v)


def text_twins(expanded: list[list[int]], image_token: int, vocab: int, avoid: frozenset[int]) -> list[list[int]]:
    """Each expanded prompt with its image rows as random text tokens (same lengths, same
    sharing): what the images cost beyond their positions."""
    g = torch.Generator().manual_seed(2)
    twins = []
    for e in expanded:
        ids = torch.tensor(e)
        text_ids = torch.randint(3, min(image_token, vocab), ids.shape, generator=g)
        text_ids[torch.isin(text_ids, torch.tensor(sorted(avoid)))] = 3
        twins.append(torch.where(ids == image_token, text_ids, ids).tolist())
    return twins


def profile(llm: LLM, requests: list[dict], params: SamplingParams, out: str | None) -> None:
    """``requests`` run once under torch.profiler: the top 25 ops by device time and by host
    self time, and the wall time beside the device's total."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    sync()
    t0 = time.perf_counter()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(requests, params, use_tqdm=False)
        sync()
    text = (f"{len(requests)} requests in {time.perf_counter() - t0:.3f} s under the profiler\n"
            + prof.key_averages().table(sort_by="cuda_time_total", row_limit=25) + "\n"
            + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    if out:
        with open(out, "w") as f:
            f.write(text)
    else:
        print(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="llava-1.5-7b")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--system", type=int, default=96, help="shared text tokens before the image")
    ap.add_argument("--question", type=int, default=32, help="each request's own text after the image")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--hf-requests", type=int, default=64, help="0: no transformers run")
    ap.add_argument("--hf-batch-size", type=int, default=32)
    ap.add_argument("--tower-batch", type=int, default=32)
    ap.add_argument("--text-twin", action=argparse.BooleanOptionalAction, default=True,
                    help="also run the workload with the images' rows as text tokens")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--image-size", type=int, default=None,
                    help="square images of this side (default: the tower's size; 448 for Qwen2-VL)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.6,
                    help="ours; the rest is room for transformers' model in the same process")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after the runs, N image requests again under torch.profiler: the top ops by GPU "
                         "time and by host time printed (to --profile-out if given)")
    ap.add_argument("--profile-out", help="where the profile's tables go (default: stdout)")
    ap.add_argument("--distinct-images", type=int, default=0, metavar="K",
                    help="K different images over the requests (request i takes image i mod K; 0: each its own)")
    ap.add_argument("--question-first", action="store_true",
                    help="each request's own text before its image, so the prefix cache shares no block of "
                         "it (what the encoder cache can still share: --distinct-images)")
    ap.add_argument("--mm-encoder-cache-tokens", type=int, default=None,
                    help="the engine's encoder cache in rows (default: its own; 0: off)")
    ap.add_argument("--json-out")
    args = ap.parse_args()

    llm = LLM(random_weights_config=resolve_config(args.config), dtype=args.dtype,
              gpu_memory_utilization=args.gpu_memory_utilization,
              mm_encoder_cache_tokens=args.mm_encoder_cache_tokens)
    eng = llm.engine
    enc = eng.mm_encoder
    assert enc is not None, f"{args.config} takes no images"
    vc = enc.config
    kind = type(vc).__name__
    qwen = kind == "QwenVisionConfig"  # <|vision_start|><|image_pad|><|vision_end|>
    gemma = kind == "Gemma3VisionConfig"  # <start_of_image>
    internvl = kind == "InternVLVisionConfig"  # <IMG_CONTEXT>, tiled by the engine
    uint8 = qwen or gemma or internvl  # the requests carry uint8 pixels the engine preprocesses
    image_token = vc.image_token_id
    placeholder = list(getattr(enc, "placeholder_ids", [image_token]))
    size = args.image_size or getattr(vc, "image_size", 448)
    vocab = eng.model_config.vocab_size
    # ids a random text must not hold: an image's own tokens (Gemma's vocabulary has them all)
    avoid = frozenset(t for t in (image_token, getattr(vc, "boi_token_id", None), getattr(vc, "eoi_token_id", None),
                                  getattr(vc, "start_token_id", None), getattr(vc, "end_token_id", None))
                      if t is not None)
    prompts, images = workload(args.requests, args.system, args.question, vocab, placeholder, size,
                               uint8=uint8, avoid=avoid, distinct=args.distinct_images,
                               question_first=args.question_first)
    rows = enc.num_rows(enc.pixel_values(images[0]))
    # each prompt as the engine expands it (the image's rows at image_token: Gemma adds its
    # newlines and <end_of_image> around them too, InternVL <img> and </img>)
    expanded = [enc.prepare(list(p), {"image": im})[0] for p, im in zip(prompts, images, strict=True)]
    if not (kind == "VisionConfig" and not vc.grid_pinpoints or gemma or qwen or internvl) and args.hf_requests:
        print("transformers' side (end to end and the tower) is run for LLaVA-1.5, Gemma 3, Qwen-VL and InternVL only",
              flush=True)
        args.hf_requests = 0
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, detokenize=False)

    def reqs(ps, ims):
        return [{"prompt_token_ids": p, "multi_modal_data": {"image": im}} for p, im in zip(ps, ims, strict=True)]

    w_prompts, w_images = workload(8, args.system, args.question, vocab, placeholder, size, seed=1, uint8=uint8)
    llm.generate(reqs(w_prompts, w_images), params, use_tqdm=False)  # compile, warm up
    kv = eng.kv_manager
    hits0 = kv.prefix_hits
    cache = eng.runner.encoder_cache
    cache_hits0 = cache.hits if cache is not None else 0
    # the tower's share of the timed run: each encode call timed to the device's end
    enc_times: list[float] = []
    real_encode = enc.encode

    def timed_encode(data):
        sync()
        t = time.perf_counter()
        out = real_encode(data)
        sync()
        enc_times.append(time.perf_counter() - t)
        return out

    enc.encode = timed_encode  # type: ignore[method-assign]
    # each step's wall and GPU time by kind (bench throughput's summary), ours and the twin's
    timeline, spans = _record_steps(eng), _record_gpu_spans(eng)
    sync()
    t0 = time.perf_counter()
    outs = llm.generate(reqs(prompts, images), params, use_tqdm=False)
    sync()
    dt = time.perf_counter() - t0
    assert all(o.error is None for o in outs), [o.error for o in outs if o.error][:3]
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    ours = {"requests": args.requests, "output_tokens": out_tokens, "seconds": dt,
            "output_tok_per_s": out_tokens / dt, "requests_per_s": args.requests / dt,
            "prefix_hit_tokens": kv.prefix_hits - hits0,
            "encoder_cache_hits": (cache.hits - cache_hits0) if cache is not None else None,
            "encode_seconds": sum(enc_times), "encode_calls": len(enc_times),
            "prompt_tokens_each": len(expanded[0]), "rows_per_image": rows,
            "steps": _step_summary(timeline, _gpu_ms(spans)),
            # generate's admission of every request (preprocessing included) before its first step
            "before_first_step_s": timeline[0][0] - t0 if timeline else None}
    print(f"flashpage: {args.requests} image requests, {out_tokens} output tokens in {dt:.2f} s: "
          f"{ours['output_tok_per_s']:.0f} output tok/s, {ours['requests_per_s']:.2f} req/s; "
          f"prefix hits {ours['prefix_hit_tokens']} tokens; encoder cache hits {ours['encoder_cache_hits']} images; "
          f"the tower {sum(enc_times):.2f} s in {len(enc_times)} calls", flush=True)
    print(f"  {ours['before_first_step_s']:.2f} s before the first step; steps (wall / GPU ms):",
          _steps_line(ours["steps"]), flush=True)
    enc.encode = real_encode  # type: ignore[method-assign]
    result = {"device": device_name(eng.device), "config": args.config, "args": vars(args), "flashpage": ours}
    if args.text_twin:
        # the same workload with each image's rows as text tokens (same lengths, same
        # sharing): what the images cost beyond their positions (the tower, eager steps)
        twins = text_twins(expanded, image_token, vocab, avoid)
        llm.generate([{"prompt_token_ids": [1] + [7] * len(twins[0])}], params, use_tqdm=False)  # warm
        sync()
        n_steps, n_spans = len(timeline), len(spans)
        t0 = time.perf_counter()
        touts = llm.generate([{"prompt_token_ids": p} for p in twins], params, use_tqdm=False)
        sync()
        tdt = time.perf_counter() - t0
        tt = sum(len(o.outputs[0].token_ids) for o in touts)
        gpu = _gpu_ms(spans[n_spans:])
        result["text_twin"] = {"seconds": tdt, "output_tok_per_s": tt / tdt,
                               "steps": _step_summary(timeline[n_steps:], gpu)}
        print(f"the text twin (each image's {rows} rows as text tokens): {tt / tdt:.0f} output tok/s in "
              f"{tdt:.2f} s; the images cost {dt / tdt - 1:+.1%} of its time", flush=True)
        print("  steps (wall / GPU ms):", _steps_line(result["text_twin"]["steps"]), flush=True)

    if args.hf_requests:
        import transformers

        cfg = transformers.AutoConfig.from_pretrained(resolve_config(args.config))
        cls = getattr(transformers, cfg.architectures[0])  # Llava / Gemma3 / Qwen2_5_VL / ... ForConditionalGeneration
        with torch.device(eng.device):
            hf = cls._from_config(cfg, dtype=eng.dtype, attn_implementation="sdpa")
        hf.eval()
        hf.generation_config.eos_token_id = None
        tower = time_tower(llm, hf, images, args.tower_batch, 5)
        print(f"tower + projector, batches of {args.tower_batch}: ours {tower['ours']:.0f} images/s, "
              f"transformers {tower['transformers']:.0f} ({tower['ours'] / tower['transformers']:.2f}x)", flush=True)
        n = args.hf_requests
        hf_pixels = [enc.pixel_values(im) for im in images[:n]]  # its processor's output
        hf_throughput(hf, expanded[:2], hf_pixels[:2], image_token, 2, 4, vc.processing)  # warm up
        base = hf_throughput(hf, expanded[:n], hf_pixels, image_token, args.hf_batch_size, args.output_len,
                             vc.processing)
        print(f"transformers: {n} requests in batches of {args.hf_batch_size}: "
              f"{base['output_tok_per_s']:.0f} output tok/s; flashpage {ours['output_tok_per_s'] / base['output_tok_per_s']:.1f}x",
              flush=True)
        result.update(tower=tower, transformers=base,
                      speedup=ours["output_tok_per_s"] / base["output_tok_per_s"])
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)
    if args.profile:
        p_prompts, p_images = workload(args.profile, args.system, args.question, vocab, placeholder, size, seed=3,
                                       uint8=uint8, avoid=avoid)
        profile(llm, reqs(p_prompts, p_images), params, args.profile_out)
        if args.profile_out:  # the same requests' text twins beside them
            p_expanded = [enc.prepare(list(p), {"image": im})[0] for p, im in zip(p_prompts, p_images, strict=True)]
            profile(llm, [{"prompt_token_ids": t} for t in text_twins(p_expanded, image_token, vocab, avoid)],
                    params, args.profile_out + ".twin")


if __name__ == "__main__":
    main()
