"""A Qwen2-VL / Qwen2.5-VL vision tower alone (random weights, bf16): images/s of our
encoder (models/qwen2_vl.py: preprocessing on the device from resized uint8 pixels, the
tower, the merger) against transformers' vision model on the same patches in the same run,
and the TFLOP/s both reach (2 x the tower's parameters x patches; attention left out).
``--profile`` prints our call's CUDA kernels by time (torch.profiler).

    python benchmarks/vision_tower.py --config qwen2.5-vl-7b --images 26 --profile --json-out $OUT/tower.json
"""

from __future__ import annotations

import argparse
import json

import torch

from flashpage.bench.common import median_seconds, resolve_config, sync


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="qwen2.5-vl-7b")
    ap.add_argument("--images", type=int, default=26, help="images a call (a 256-request run's calls held ~26)")
    ap.add_argument("--size", type=int, default=448, help="square images of this side")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--unfused", action="store_true", help="the gated MLPs as the checkpoint has them")
    ap.add_argument("--json-out")
    args = ap.parse_args()

    import os

    from flashpage.config import ModelConfig
    from flashpage.models.qwen2_vl import QwenImageEncoder

    folder = resolve_config(args.config)
    assert folder is not None
    cfg_path = os.path.join(folder, "config.json") if os.path.isdir(folder) else folder
    vc = ModelConfig.from_hf(cfg_path).vision
    cuda = torch.cuda.is_available()  # (the CPU: a smoke run in fp32)
    dev, dtype = torch.device("cuda" if cuda else "cpu"), torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    with torch.device(dev):
        enc = QwenImageEncoder(vc).to(dtype).eval()  # type: ignore[arg-type]
    for p in enc.parameters():
        p.normal_(0, 0.02)
    if not args.unfused:
        enc.fuse()  # as load_image_encoder leaves it
    g = torch.Generator().manual_seed(0)
    images = [torch.randint(0, 256, (3, args.size, args.size), dtype=torch.uint8, generator=g)
              for _ in range(args.images)]
    kept = [enc.admit_image(im) for im in images]
    patches = sum(k.grid[0] * k.grid[1] * k.grid[2] for k in kept)
    vcfg_ = enc.config  # the tower's parameters as the checkpoint holds them (padding not counted)
    params = sum(p.numel() for n, p in enc.named_parameters() if not n.startswith("visual.merger"))
    if not args.unfused:
        params -= sum(-vcfg_.intermediate_size % 64 * vcfg_.hidden_size * 3 for _ in range(vcfg_.depth)) \
            if vcfg_.variant == "qwen2_5_vl" else 0
    flop = 2 * params * patches

    def ours() -> None:
        enc.encode(kept)

    t = median_seconds(ours, args.iters)
    res = {"config": args.config, "images": args.images, "size": args.size, "patches": patches,
           "ours_s": t, "ours_images_per_s": args.images / t, "ours_tflops": flop / t / 1e12}
    print(f"ours: {args.images} images of {args.size}^2 ({patches} patches) in {t * 1e3:.1f} ms: "
          f"{args.images / t:.0f} images/s, {flop / t / 1e12:.0f} TFLOP/s", flush=True)
    if not args.no_hf:
        import transformers

        hcfg = transformers.AutoConfig.from_pretrained(folder)
        cls = (transformers.models.qwen2_5_vl.modeling_qwen2_5_vl.Qwen2_5_VisionTransformerPretrainedModel
               if vc.variant == "qwen2_5_vl"  # type: ignore[union-attr]
               else transformers.models.qwen2_vl.modeling_qwen2_vl.Qwen2VisionTransformerPretrainedModel)
        vcfg = hcfg.vision_config
        vcfg._attn_implementation = "sdpa"
        with torch.device(dev):
            hf = cls._from_config(vcfg, dtype=dtype).eval()
        px = torch.cat([enc.pixel_values(k).patches for k in kept]).to(dev, dtype)  # type: ignore[union-attr]
        thw = torch.tensor([list(k.grid) for k in kept], device=dev)

        def theirs() -> None:
            hf(px, grid_thw=thw)

        th = median_seconds(theirs, args.iters)
        res.update(hf_s=th, hf_images_per_s=args.images / th, hf_tflops=flop / th / 1e12, speedup=th / t)
        print(f"transformers: {th * 1e3:.1f} ms: {args.images / th:.0f} images/s, {flop / th / 1e12:.0f} TFLOP/s; "
              f"ours {th / t:.2f}x", flush=True)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            ours()
            sync()
        table = prof.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=18,
                                          max_name_column_width=70)
        print(table, flush=True)
        res["profile"] = table
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
