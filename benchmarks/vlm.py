"""Image (audio) requests end to end (LLaVA-1.5-7B shape, random weights): output tokens/s
of a batch of requests that each carry one image, against transformers' LlavaForConditionalGeneration
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

GLM-4.1V (--config glm-4.1v-9b-thinking; GLM-4.5V's config the same way): driven as Qwen2-VL
(its encoder is Qwen-VL's with GLM's tower): <|begin_of_image|><|image|><|end_of_image|> as
the placeholder, 448 x 448 uint8 pixels (256 rows), transformers' Glm4vForConditionalGeneration
fed our patches, grids and mm_token_type_ids. 128 requests and 32 for transformers by default.

    python benchmarks/vlm.py --config glm-4.1v-9b-thinking --json-out $OUT/vlm_glm4v.json

Qwen2-Audio (--config qwen2-audio-7b-instruct): each request one audio, --audio-seconds (10)
of tones and noise at 16 kHz given as (waveform, 16000), in <|audio_bos|><|AUDIO|><|audio_eos|>
(the random-weights config has no tokenizer: the two markers at the ids after <|AUDIO|>'s,
151647 / 151648, plain text tokens here); 10 s is 250 rows. transformers'
Qwen2AudioForConditionalGeneration beside it, fed the log-mel features and
feature_attention_mask its processor gives (ours, equal to WhisperFeatureExtractor's;
computed on the host before its clock starts). The encoder alone: audios/s of ours (from the
waveforms: their copy to the device and features included) against transformers' audio tower
+ projector, run as its forward runs them (it has no get_audio_features: every audio over all
1,500 positions, the padding masked as the installed version's forward masks it, named in the
output). 128 requests and 32 for transformers by default; every "image" above reads "audio".

    python benchmarks/vlm.py --config qwen2-audio-7b-instruct --json-out $OUT/vlm_audio.json

Idefics3 / SmolVLM (--config smolvlm2-500m-video-instruct: SmolVLM2-500M-Video-Instruct's
config, preprocessor and processor files written from the published ones as we know them):
<image> as the placeholder, uint8 pixels the engine tiles as Idefics3Processor does (512 x 512
is resized to 2,048 on its longest edge: 4 x 4 tiles and the global image, 17 x 64 = 1,088
rows, 1,127 prompt tokens with each tile's <fake_token_around_image><row_r_col_c> and the
newlines); transformers' SmolVLMForConditionalGeneration beside it, fed our tiles normalized
([images, tiles, 3, 512, 512] and pixel_attention_mask, as its processor gives them). A
random-weights config has no tokenizer, and the expansion needs the processor's tokens: where
the config's folder holds none, a copy of its files goes to a temporary folder with a small
tokenizer.json that puts them at SmolVLM's published ids below <image> (49152 <global-img>,
49153 - 49188 <row_r_col_c>, 49189 <fake_token_around_image>; "\\n" and "\\n\\n" at the two ids
below, stand-ins). 128 requests and 32 for transformers by default.

    python benchmarks/vlm.py --config smolvlm2-500m-video-instruct --json-out $OUT/vlm_smolvlm.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import json
import math
import tempfile
import time

import numpy as np
import torch

from flashpage.bench.common import device_name, median_seconds, resolve_config, sync
from flashpage.bench.throughput import _gpu_ms, _record_gpu_spans, _record_steps, _step_summary
from flashpage.config import QwenVisionConfig
from flashpage.llm import LLM
from flashpage.sampling_params import SamplingParams

AUDIO_RATE = 16_000  # the rate each audio is given at (Qwen2-Audio's own: no resampling)
# default request counts (ours, transformers'): the image families', and the smaller ones of
# GLM-4.1V, SmolVLM and Qwen2-Audio (a run within 2 minutes of an H200)
REQUESTS, HF_REQUESTS = (256, 128), (64, 32)


def workload(n: int, system: int, question: int, vocab: int, placeholder: list[int], size: int,
             seed: int = 0, uint8: bool = False, avoid: frozenset[int] = frozenset(),
             distinct: int = 0, question_first: bool = False, audio_seconds: float = 0.0):
    """(prompt ids with one placeholder each, one input each: a [3, size, size] image, float
    pixel values (LLaVA) or uint8 pixels (Qwen2-VL, Gemma 3: preprocessed by the engine, as
    a PIL image or a decoded file would come), or with ``audio_seconds`` an audio of that
    length at 16 kHz as (waveform, 16000): random_audio's). ``distinct``: that many different
    inputs, request i taking input i mod distinct (0: each its own); ``question_first``: each
    request's own text before its input (the prefix cache then shares none of its blocks)."""
    g = torch.Generator().manual_seed(seed)

    def text(k: int) -> list[int]:
        return [t if t not in placeholder and t not in avoid else 3
                for t in torch.randint(3, vocab, (k,), generator=g).tolist()]

    shared = text(system)
    prompts = [[1, *shared, *q, *placeholder] if question_first else [1, *shared, *placeholder, *q]
               for q in (text(question) for _ in range(n))]

    def item():
        if audio_seconds:
            return random_audio(g, audio_seconds), AUDIO_RATE
        if uint8:
            return torch.randint(0, 256, (3, size, size), dtype=torch.uint8, generator=g)
        return torch.randn(3, size, size, generator=g)

    pool = [item() for _ in range(distinct or n)]
    return prompts, [pool[i % len(pool)] for i in range(n)]


def random_audio(g: torch.Generator, seconds: float, rate: int = AUDIO_RATE) -> np.ndarray:
    """float32 mono in [-1, 1], ``seconds`` long at ``rate``: three tones of random pitch
    (100 Hz - 3 kHz), loudness and phase, and a little noise (its features are not
    silence's)."""
    n = int(round(seconds * rate))
    t = torch.arange(n, dtype=torch.float64) / rate
    hz, amp, phase = (torch.rand(3, generator=g, dtype=torch.float64) * (b - a) + a
                      for a, b in ((100.0, 3000.0), (0.05, 0.3), (0.0, 6.0)))
    x = (amp[:, None] * torch.sin(2 * math.pi * hz[:, None] * t + phase[:, None])).sum(0)
    x += 0.02 * torch.randn(n, generator=g, dtype=torch.float64)
    return x.clamp(-1.0, 1.0).to(torch.float32).numpy()


@dataclasses.dataclass
class HfAudio:
    """What transformers' Qwen2AudioProcessor gives for one audio: its log-mel features over
    the whole chunk [mel, 3000] (ours: equal to WhisperFeatureExtractor's to fp32 rounding,
    tests/engine/test_qwen2_audio_engine.py) and the frames its feature_attention_mask marks."""

    features: torch.Tensor
    frames: int


IDEFICS3_ARCHS = ("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration")


def idefics3_tokens(folder: str, image_token: int, vocab: int) -> dict[str, int]:
    """The ids an Idefics3 / SmolVLM prompt needs beside <image>, where a random-weights
    config has no tokenizer to give them: Idefics3Processor's <fake_token_around_image>,
    <global-img> and <row_r_col_c> (r, c up to 6) at SmolVLM's published layout around
    <image> (49152 <global-img>, 49153 - 49188 the rows and columns, 49189 the fake token,
    49190 <image>), and byte-level "\\n" / "\\n\\n" as stand-ins at the two ids below
    <global-img>'s (any text ids: only the count of tokens matters here)."""
    ids = {"<global-img>": image_token - 38, "<fake_token_around_image>": image_token - 1,
           "\u010a": image_token - 40, "\u010a\u010a": image_token - 39,
           **{f"<row_{r}_col_{c}>": image_token - 37 + (r - 1) * 6 + (c - 1)
              for r in range(1, 7) for c in range(1, 7)}}
    bad = {k: v for k, v in ids.items() if not 3 <= v < vocab}
    if bad:
        raise SystemExit(f"{folder}: <image> is id {image_token} in a vocabulary of {vocab}: the processor's tokens "
                         f"cannot be laid out below it as SmolVLM's are ({len(bad)} would fall outside); give the "
                         "config a tokenizer.json holding <fake_token_around_image>, <global-img> and <row_r_col_c>")
    return ids


def with_idefics3_tokenizer(config: str, tmp: str) -> str:
    """``config`` (an Idefics3 / SmolVLM config folder, or its config.json) as it is where its
    tokenizer files hold <fake_token_around_image>; else a copy of its json files in ``tmp``
    with a small tokenizer.json holding idefics3_tokens' (its added tokens, at their ids:
    what the engine reads them from) beside them."""
    import os
    import shutil

    from flashpage.models.internvl_config import _vocab

    folder = config if os.path.isdir(config) else os.path.dirname(config)
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    if (cfg.get("architectures") or [None])[0] not in IDEFICS3_ARCHS or "<fake_token_around_image>" in _vocab(folder)[0]:
        return config
    text = cfg.get("text_config") or {}
    vocab = cfg.get("vocab_size") or text.get("vocab_size")
    ids = idefics3_tokens(folder, cfg.get("image_token_id", cfg.get("image_token_index", 128257)), vocab)
    for name in os.listdir(folder):
        if name.endswith(".json"):
            shutil.copy(os.path.join(folder, name), tmp)
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": t.startswith("<")} for t, i in sorted(ids.items(), key=lambda kv: kv[1])]
    tok = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
           "pre_tokenizer": None, "post_processor": None, "decoder": None,
           "model": {"type": "WordLevel", "vocab": {"<unk>": 0, **ids}, "unk_token": "<unk>"}}
    with open(os.path.join(tmp, "tokenizer.json"), "w") as f:
        json.dump(tok, f)
    print(f"{folder} has no tokenizer holding <fake_token_around_image>: a small one written beside a copy of "
          f"its files, SmolVLM's layout below <image> (<global-img> {ids['<global-img>']}, <row_1_col_1> .. "
          f"<row_6_col_6> {ids['<row_1_col_1>']} .., <fake_token_around_image> {ids['<fake_token_around_image>']})",
          flush=True)
    return tmp


def time_tower(llm: LLM, hf, items: list, batch: int, iters: int) -> dict:
    """Inputs/s through our encoder (tower + projector) and transformers' (get_image_features;
    Qwen2-Audio's audio tower and projector: hf_audio_features), batches of ``batch`` inputs,
    median of ``iters``."""
    enc = llm.engine.mm_encoder
    assert enc is not None
    dev, dtype = llm.engine.device, llm.engine.dtype
    if getattr(enc, "modality", "image") == "audio":
        # ours from the waveforms as a request keeps them (host float32 at 16 kHz: their
        # copy to the device and log-mel features are in the time); transformers' from the
        # features its processor gives (computed on the host beforehand), on the device
        waves = [enc.admit_audio(x) for x in items[:batch]]
        audio_kw = hf_media_kwargs(hf, [hf_audio(enc, w) for w in waves], dev)

        def ours() -> None:
            enc.encode(waves)

        def theirs() -> None:
            hf_audio_features(hf, **audio_kw)

        with torch.inference_mode():
            return {name: batch / median_seconds(fn, iters) for name, fn in (("ours", ours), ("transformers", theirs))}
    # ours from the request's form (uint8 pixels normalized by encode on the device, or float
    # pixel values; Qwen-VL's resized uint8 as admit_image keeps them, here on the device);
    # transformers' from the pixel values its processor would give
    images = items
    if hasattr(enc, "admit_image"):
        data = []
        for im in images[:batch]:
            kept = enc.admit_image(im)
            if type(kept).__name__ == "Idefics3Image":  # each tile its own input
                data += [t.to(dev) for t in kept.pixels.unbind(0)]
            else:
                data.append(dataclasses.replace(kept, pixels=kept.pixels.to(dev)))
    else:
        data = [im.to(dev) if im.dtype == torch.uint8 else im.to(dev, dtype) for im in images[:batch]]
    theirs_kw = hf_media_kwargs(hf, [enc.pixel_values(im) for im in images[:batch]], dev, enc.config.processing)

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


def hf_audio(enc, wave: torch.Tensor) -> HfAudio:
    """Qwen2AudioProcessor's output for one admitted waveform (on the host)."""
    from flashpage.models.audio_features import log_mel
    from flashpage.models.qwen2_audio_config import feature_frames

    f = enc.config.features
    return HfAudio(log_mel([wave], f)[0], feature_frames(wave.shape[0], f))


def hf_audio_mask_kind(hf) -> str:
    """How the installed transformers' Qwen2AudioModel.forward masks the encoder's padded
    positions: "bidirectional" (transformers 5.2x: create_bidirectional_mask over a 2-D
    mask) or "additive" (earlier: a [B, 1, T, T] mask of -inf at the padding's keys)."""
    return _mask_kind_of(type(hf.model))


@functools.cache
def _mask_kind_of(cls: type) -> str:  # (read once: not in the timed calls)
    return "bidirectional" if "create_bidirectional_mask" in inspect.getsource(cls.forward) else "additive"


def hf_audio_features(hf, input_features: torch.Tensor, feature_attention_mask: torch.Tensor) -> torch.Tensor:
    """transformers' audio tower and projector on a processor's features, as its
    Qwen2AudioModel.forward runs them before merging the rows into the prompt (it has no
    get_audio_features): every audio over all max_source_positions positions, the padding's
    keys masked as that forward masks them (hf_audio_mask_kind)."""
    m = hf.model
    tower = m.audio_tower
    lengths, _ = tower._get_feat_extract_output_lengths(feature_attention_mask.sum(-1))
    b, _, frames = input_features.shape
    t = (frames - 2) // 2 + 1
    keep = torch.arange(t, device=lengths.device)[None, :] < lengths[:, None]  # [B, T]
    dtype = tower.conv1.weight.dtype
    if hf_audio_mask_kind(hf) == "bidirectional":
        from transformers.masking_utils import create_bidirectional_mask

        mask = create_bidirectional_mask(config=tower.config, attention_mask=keep.long(),
                                         inputs_embeds=torch.zeros(b, t, 1, dtype=dtype, device=keep.device))
    else:
        mask = torch.zeros(b, 1, t, t, dtype=dtype, device=keep.device)
        mask.masked_fill_(~keep[:, None, None, :], float("-inf"))
    return m.multi_modal_projector(tower(input_features, attention_mask=mask).last_hidden_state)


def hf_media_kwargs(hf, pixels: list, device: torch.device, proc=None) -> dict:
    """transformers' image (audio) arguments for ``pixels`` (our encoder's pixel_values of
    each image: the float tensors its processor gives, Qwen-VL's patches and grids, or
    InternVL's uint8 tiles, normalized by ``proc``, the encoder's ImageProcessing, as
    GotOcr2's; or each audio's HfAudio: input_features and feature_attention_mask)."""
    dtype = next(hf.parameters()).dtype
    if isinstance(pixels[0], HfAudio):
        frames = torch.tensor([a.frames for a in pixels])
        width = pixels[0].features.shape[-1]
        return {"input_features": torch.stack([a.features for a in pixels]).to(device, dtype),
                "feature_attention_mask": (torch.arange(width)[None, :] < frames[:, None]).long().to(device)}
    if type(pixels[0]).__name__ == "Idefics3Image":  # [B, tiles, 3, M, M], padded with zero tiles
        from flashpage.models.clip_image import normalize

        most = max(p.pixels.shape[0] for p in pixels)
        m = pixels[0].pixels.shape[-1]
        values = torch.zeros(len(pixels), most, 3, m, m, dtype=dtype, device=device)
        mask = torch.zeros(len(pixels), most, m, m, dtype=torch.bool, device=device)
        for i, p in enumerate(pixels):
            n = p.pixels.shape[0]
            values[i, :n] = normalize(p.pixels.to(device), proc).to(dtype)
            mask[i, :n] = True
        return {"pixel_values": values, "pixel_attention_mask": mask}
    if hasattr(pixels[0], "patches"):  # Qwen-VL: patches of every image in one tensor, and their grids
        return {"pixel_values": torch.cat([p.patches for p in pixels]).to(device, dtype),
                "image_grid_thw": torch.tensor([list(p.grid) for p in pixels], device=device)}
    if type(pixels[0]).__name__ == "InternVLImage":  # every tile of every image, in order
        from flashpage.models.clip_image import normalize

        return {"pixel_values": normalize(torch.cat([p.pixels for p in pixels]).to(device), proc).to(dtype)}
    return {"pixel_values": torch.stack(pixels).to(device, dtype)}


@torch.inference_mode()
def hf_throughput(hf, prompts, pixels, image_token: int, batch: int, out_len: int, proc=None) -> dict:
    """transformers' generate over ``prompts`` (ids as the engine expanded them: each image's
    (audio's) rows at ``image_token``), left-padded batches of ``batch``; ``pixels``:
    hf_media_kwargs' input per prompt. Gemma 3's token_type_ids and Qwen-VL's / GLM-4.1V's
    mm_token_type_ids (1 on the image rows, as their processors give them) are passed where
    the model takes them."""
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
        extra = hf_media_kwargs(hf, pixels[s:s + batch], device, proc)
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
    """Each expanded prompt with its image's (audio's) rows as random text tokens (same
    lengths, same sharing): what the images cost beyond their positions."""
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
    ap.add_argument("--requests", type=int, default=None,
                    help=f"default {REQUESTS[0]}; {REQUESTS[1]} for GLM-4.1V, SmolVLM and Qwen2-Audio")
    ap.add_argument("--system", type=int, default=96, help="shared text tokens before the image (audio)")
    ap.add_argument("--question", type=int, default=32, help="each request's own text after the image (audio)")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--hf-requests", type=int, default=None,
                    help=f"0: no transformers run (default {HF_REQUESTS[0]}; {HF_REQUESTS[1]} for GLM-4.1V, SmolVLM "
                         "and Qwen2-Audio)")
    ap.add_argument("--hf-batch-size", type=int, default=32)
    ap.add_argument("--tower-batch", type=int, default=32)
    ap.add_argument("--text-twin", action=argparse.BooleanOptionalAction, default=True,
                    help="also run the workload with the images' (audios') rows as text tokens")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--image-size", type=int, default=None,
                    help="square images of this side (default: the tower's size; 448 for Qwen2-VL, GLM-4.1V)")
    ap.add_argument("--audio-seconds", type=float, default=10.0,
                    help="Qwen2-Audio: each request's audio, this long at 16 kHz (at most 30)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.6,
                    help="ours; the rest is room for transformers' model in the same process")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after the runs, N image (audio) requests again under torch.profiler: the top ops by "
                         "GPU time and by host time printed (to --profile-out if given)")
    ap.add_argument("--profile-out", help="where the profile's tables go (default: stdout)")
    ap.add_argument("--distinct-images", type=int, default=0, metavar="K",
                    help="K different images (audios) over the requests (request i takes input i mod K; 0: "
                         "each its own)")
    ap.add_argument("--question-first", action="store_true",
                    help="each request's own text before its image, so the prefix cache shares no block of "
                         "it (what the encoder cache can still share: --distinct-images)")
    ap.add_argument("--mm-encoder-cache-tokens", type=int, default=None,
                    help="the engine's encoder cache in rows (default: its own; 0: off)")
    ap.add_argument("--json-out")
    args = ap.parse_args()

    config = resolve_config(args.config)
    assert config is not None
    tmp = tempfile.TemporaryDirectory()  # Idefics3 / SmolVLM: a small tokenizer beside a copy of the config
    llm = LLM(random_weights_config=with_idefics3_tokenizer(config, tmp.name), dtype=args.dtype,
              gpu_memory_utilization=args.gpu_memory_utilization,
              mm_encoder_cache_tokens=args.mm_encoder_cache_tokens)
    eng = llm.engine
    enc = eng.mm_encoder
    assert enc is not None, f"{args.config} takes no images nor audio"
    vc = enc.config
    kind = type(vc).__name__
    modality = getattr(enc, "modality", "image")  # "audio": Qwen2-Audio
    audio = modality == "audio"
    # Qwen2-VL / 2.5-VL / 3-VL and GLM-4.1V / 4.5V (Glm4vVisionConfig): <|vision_start|>
    # <|image_pad|><|vision_end|> (<|begin_of_image|><|image|><|end_of_image|>), patches and grids
    qwen = isinstance(vc, QwenVisionConfig)
    gemma = kind == "Gemma3VisionConfig"  # <start_of_image>
    internvl = kind == "InternVLVisionConfig"  # <IMG_CONTEXT>, tiled by the engine
    idefics3 = kind == "Idefics3VisionConfig"  # <image>, tiled by the engine, each tile its own input
    newer = audio or idefics3 or kind == "Glm4vVisionConfig"  # the families with the smaller default counts
    if args.requests is None:
        args.requests = REQUESTS[newer]
    if args.hf_requests is None:
        args.hf_requests = HF_REQUESTS[newer]
    uint8 = qwen or gemma or internvl or idefics3  # the requests carry uint8 pixels the engine preprocesses
    token = vc.audio_token_id if audio else vc.image_token_id  # the rows' id in the expanded prompt
    vocab = eng.model_config.vocab_size
    placeholder = list(getattr(enc, "placeholder_ids", [token]))
    if audio and placeholder == [token] and token + 2 < vocab:
        # a random-weights config has no tokenizer files, so no <|audio_bos|> / <|audio_eos|>
        # ids: the published tokenizer's, the two after <|AUDIO|>'s (151647 / 151648), here
        # plain text tokens around the audio as the chat template writes them
        placeholder = [token + 1, token, token + 2]
    size = args.image_size or getattr(vc, "image_size", 448)
    # ids a random text must not hold: the placeholders' and every other special id the
    # encoder's config names (videos', Gemma's, InternVL's, Idefics3's <row_r_col_c> ...: a
    # video token without a video is refused)
    named = [getattr(vc, f.name) for f in dataclasses.fields(vc) if f.name.endswith(("_token_id", "_ids"))]
    avoid = frozenset({*placeholder, *(t for x in named for t in (x if isinstance(x, tuple) else (x,))
                                       if isinstance(t, int))})
    seconds = args.audio_seconds if audio else 0.0
    prompts, items = workload(args.requests, args.system, args.question, vocab, placeholder, size,
                              uint8=uint8, avoid=avoid, distinct=args.distinct_images,
                              question_first=args.question_first, audio_seconds=seconds)
    # each prompt as the engine expands it (the image's rows at image_token: Gemma adds its
    # newlines and <end_of_image> around them too, InternVL <img> and </img>, Idefics3 each
    # tile's <fake_token_around_image><row_r_col_c>)
    expanded = [enc.prepare(list(p), {modality: x})[0] for p, x in zip(prompts, items, strict=True)]
    rows = expanded[0].count(token)  # (every input here is of one size)
    if not (kind == "VisionConfig" and not vc.grid_pinpoints or gemma or qwen or internvl or idefics3 or audio) \
            and args.hf_requests:
        print("transformers' side (end to end and the tower) is run for LLaVA-1.5, Gemma 3, Qwen-VL, GLM-4.1V, "
              "InternVL, Idefics3 / SmolVLM and Qwen2-Audio only", flush=True)
        args.hf_requests = 0
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, detokenize=False)

    def reqs(ps, xs):
        return [{"prompt_token_ids": p, "multi_modal_data": {modality: x}} for p, x in zip(ps, xs, strict=True)]

    w_prompts, w_items = workload(min(8, args.requests), args.system, args.question, vocab, placeholder, size, seed=1, uint8=uint8,
                                  avoid=avoid, audio_seconds=seconds)
    llm.generate(reqs(w_prompts, w_items), params, use_tqdm=False)  # compile, warm up
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
    outs = llm.generate(reqs(prompts, items), params, use_tqdm=False)
    sync()
    dt = time.perf_counter() - t0
    assert all(o.error is None for o in outs), [o.error for o in outs if o.error][:3]
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    ours = {"requests": args.requests, "output_tokens": out_tokens, "seconds": dt,
            "output_tok_per_s": out_tokens / dt, "requests_per_s": args.requests / dt,
            "prefix_hit_tokens": kv.prefix_hits - hits0,
            "encoder_cache_hits": (cache.hits - cache_hits0) if cache is not None else None,
            "encode_seconds": sum(enc_times), "encode_calls": len(enc_times),
            "prompt_tokens_each": len(expanded[0]), f"rows_per_{modality}": rows,
            "steps": _step_summary(timeline, _gpu_ms(spans)),
            # generate's admission of every request (preprocessing included) before its first step
            "before_first_step_s": timeline[0][0] - t0 if timeline else None}
    print(f"flashpage: {args.requests} {modality} requests, {out_tokens} output tokens in {dt:.2f} s: "
          f"{ours['output_tok_per_s']:.0f} output tok/s, {ours['requests_per_s']:.2f} req/s; "
          f"prefix hits {ours['prefix_hit_tokens']} tokens; encoder cache hits {ours['encoder_cache_hits']} "
          f"{modality}s; the tower {sum(enc_times):.2f} s in {len(enc_times)} calls", flush=True)
    print(f"  {ours['before_first_step_s']:.2f} s before the first step; steps (wall / GPU ms):",
          _steps_line(ours["steps"]), flush=True)
    enc.encode = real_encode  # type: ignore[method-assign]
    result = {"device": device_name(eng.device), "config": args.config, "modality": modality, "args": vars(args),
              "flashpage": ours}
    if args.text_twin:
        # the same workload with each image's rows as text tokens (same lengths, same
        # sharing): what the images cost beyond their positions (the tower, eager steps)
        twins = text_twins(expanded, token, vocab, avoid)
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
        print(f"the text twin (each {modality}'s {rows} rows as text tokens): {tt / tdt:.0f} output tok/s in "
              f"{tdt:.2f} s; the {modality}s cost {dt / tdt - 1:+.1%} of its time", flush=True)
        print("  steps (wall / GPU ms):", _steps_line(result["text_twin"]["steps"]), flush=True)

    if args.hf_requests:
        import transformers

        cfg = transformers.AutoConfig.from_pretrained(config)
        # Llava / Gemma3 / Qwen2_5_VL / Glm4v / Qwen2Audio / ... ForConditionalGeneration
        cls = getattr(transformers, cfg.architectures[0])
        with torch.device(eng.device):
            hf = cls._from_config(cfg, dtype=eng.dtype, attn_implementation="sdpa")
        hf.eval()
        hf.generation_config.eos_token_id = None
        tower_batch = min(args.tower_batch, len(items))
        tower = time_tower(llm, hf, items, tower_batch, 5)
        note = ""
        if audio:  # transformers has no get_audio_features: its forward's own steps (hf_audio_features)
            tower["transformers_path"] = f"audio_tower + multi_modal_projector, {hf_audio_mask_kind(hf)} mask"
            note = f" (transformers: {tower['transformers_path']}, as its forward runs them)"
        print(f"tower + projector, batches of {tower_batch}: ours {tower['ours']:.0f} {modality}s/s, "
              f"transformers {tower['transformers']:.0f} ({tower['ours'] / tower['transformers']:.2f}x){note}",
              flush=True)
        n = args.hf_requests
        # its processor's output for each request's input
        hf_inputs = [hf_audio(enc, enc.admit_audio(x)) if audio else enc.pixel_values(x) for x in items[:n]]
        proc = getattr(vc, "processing", None)
        hf_throughput(hf, expanded[:2], hf_inputs[:2], token, 2, 4, proc)  # warm up
        base = hf_throughput(hf, expanded[:n], hf_inputs, token, args.hf_batch_size, args.output_len, proc)
        print(f"transformers: {n} requests in batches of {args.hf_batch_size}: "
              f"{base['output_tok_per_s']:.0f} output tok/s; flashpage {ours['output_tok_per_s'] / base['output_tok_per_s']:.1f}x",
              flush=True)
        result.update(tower=tower, transformers=base,
                      speedup=ours["output_tok_per_s"] / base["output_tok_per_s"])
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)
    if args.profile:
        p_prompts, p_items = workload(args.profile, args.system, args.question, vocab, placeholder, size, seed=3,
                                      uint8=uint8, avoid=avoid, audio_seconds=seconds)
        profile(llm, reqs(p_prompts, p_items), params, args.profile_out)
        if args.profile_out:  # the same requests' text twins beside them
            p_expanded = [enc.prepare(list(p), {modality: x})[0] for p, x in zip(p_prompts, p_items, strict=True)]
            profile(llm, [{"prompt_token_ids": t} for t in text_twins(p_expanded, token, vocab, avoid)],
                    params, args.profile_out + ".twin")


if __name__ == "__main__":
    main()
