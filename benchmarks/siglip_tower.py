"""A CLIP / SigLIP vision tower's forms side by side (benchmarks/vision_tower.py is Qwen-VL's):
images/s of our tower (random weights of a real
config's vision_config, e.g. Gemma 3's SigLIP-so400m at 896 x 896: 4,096 patches, head_dim
72, MLP width 4,304) with fc1's tanh GELU fused into its GEMM or not (models/clip_vision.FUSED_GELU),
each attention backend of torch's SDPA forced in turn, the q / k / v projections as one GEMM,
and the MLP's width zero-padded to a multiple of 128 (4,352: same outputs);
transformers' tower (its SiglipVisionModel / CLIPVisionModel, same weights) timed in the same
run as the baseline; then the top kernels of the default form (torch.profiler)::

    python benchmarks/siglip_tower.py --config gemma-3-4b-it --batch 16 --json-out $OUT/tower.json
"""

from __future__ import annotations

import argparse
import contextlib
import json

import torch
import torch.nn.functional as F

from flashpage.bench.common import device_name, median_seconds, resolve_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="gemma-3-4b-it")
    ap.add_argument("--batch", type=int, default=16, help="images a call")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' tower")
    ap.add_argument("--json-out")
    args = ap.parse_args()

    import transformers
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashpage.config import ModelConfig
    from flashpage.models import clip_vision
    from flashpage.models.multimodal import image_encoder_shell

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    path = resolve_config(args.config)
    cfg = ModelConfig.from_hf(path)
    torch.manual_seed(0)
    with torch.device(device):
        enc = image_encoder_shell(cfg)
    assert enc is not None, f"{args.config} takes no images"
    enc = enc.to(dtype).eval()
    for p in enc.parameters():
        p.data.normal_(0, 0.02)
    tower = enc.vision_tower
    size = enc.config.image_size
    pixels = torch.randn(args.batch, 3, size, size, device=device, dtype=dtype)

    def ours() -> None:
        tower(pixels)

    results: dict[str, float] = {}

    def timed(name: str, ctx=None) -> None:
        with torch.inference_mode(), (ctx or contextlib.nullcontext()):
            try:
                results[name] = args.batch / median_seconds(ours, args.iters)
            except RuntimeError as e:  # a backend that cannot take the shape
                print(f"{name}: {str(e).splitlines()[0][:120]}")
                return
        print(f"{name}: {results[name]:.1f} images/s", flush=True)

    clip_vision.FUSED_GELU = False
    timed("unfused GELU")
    clip_vision.FUSED_GELU = True
    timed("fused GELU (default)")
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        timed(f"fused GELU, SDPA {name} only", sdpa_kernel([backend]))

    # q, k, v as one GEMM (the weights concatenated for the run), their outputs strided views
    attn_cls = type(tower.encoder.layers[0].self_attn)
    plain_forward = attn_cls.forward
    for layer in tower.encoder.layers:
        a = layer.self_attn
        a.qkv_w = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
        a.qkv_b = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])

    def fused_qkv(self, x: torch.Tensor) -> torch.Tensor:
        n, t, h = x.shape
        qkv = F.linear(x, self.qkv_w, self.qkv_b).view(n, t, 3, self.num_heads, self.head_dim)
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
        o = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(o.transpose(1, 2).reshape(n, t, h))

    attn_cls.forward = fused_qkv
    timed("fused GELU, one qkv GEMM")
    attn_cls.forward = plain_forward

    # the MLP's width zero-padded to a multiple of 128 (fc1's extra rows 0 with bias 0: GELU(0)
    # = 0; fc2's extra columns 0), the same outputs
    width = tower.encoder.layers[0].mlp.fc1.out_features
    padded = -(-width // 128) * 128
    if padded != width:
        for layer in tower.encoder.layers:
            m = layer.mlp
            for lin, dim in ((m.fc1, 0), (m.fc2, 1)):
                pad = [0, 0, 0, padded - width] if dim == 0 else [0, padded - width]
                lin.weight = torch.nn.Parameter(F.pad(lin.weight.data, pad), requires_grad=False)
            m.fc1.bias = torch.nn.Parameter(F.pad(m.fc1.bias.data, [0, padded - width]), requires_grad=False)
        timed(f"fused GELU, MLP padded to {padded}")
        clip_vision.FUSED_GELU = False
        timed(f"unfused GELU, MLP padded to {padded}")
        clip_vision.FUSED_GELU = True

    if not args.no_hf:
        hcfg = transformers.AutoConfig.from_pretrained(path)
        vcfg = getattr(hcfg, "vision_config", hcfg)
        cls = transformers.SiglipVisionModel if vcfg.model_type.startswith("siglip") else transformers.CLIPVisionModel
        with torch.device(device):
            hf = cls._from_config(vcfg, dtype=dtype, attn_implementation="sdpa").eval()
        with torch.inference_mode():
            results["transformers"] = args.batch / median_seconds(lambda: hf(pixel_values=pixels), args.iters)
        print(f"transformers: {results['transformers']:.1f} images/s", flush=True)

    table = ""
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
            ours()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=15)
        print(table)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"device": device_name(device), "config": args.config, "batch": args.batch,
                       "images_per_s": results, "profile": table}, f, indent=1)


if __name__ == "__main__":
    main()
