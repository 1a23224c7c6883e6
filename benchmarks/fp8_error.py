"""Where fp8 weights' error comes from, on the GPU: an 8B-shaped model cut to --layers layers
(random weights, bf16), the final hidden state of each prompt's last position (LLM.embed)
from three engines in one process:

- bf16: the model as drawn;
- fp8 weights only: the bf16 engine given each quantized weight rounded to e4m3 and back
  (W8A16 emulated: the weights' rounding alone);
- fp8: quantization="fp8" (W8A8 above the decode rows: the activations rounded per token too).

Prints the cosine of each against bf16 (min / mean over prompts) and of fp8 against "fp8
weights only" (what the activations' rounding adds).

    python benchmarks/fp8_error.py --layers 2
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
from pathlib import Path

import torch

from flashpage import LLM
from flashpage.bench.common import resolve_config
from flashpage.layers.quant import dequantized_parameters

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (the repository root)
from tests.conftest import random_prompts  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="llama-3-8b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    raw = json.loads((Path(str(resolve_config(args.config))) / "config.json").read_text())
    raw["num_hidden_layers"] = args.layers
    tmp = Path(tempfile.mkdtemp())
    (tmp / "config.json").write_text(json.dumps(raw))
    prompts = random_prompts(8, 16, 200, vocab=raw["vocab_size"], seed=3)
    kw = dict(random_weights_config=str(tmp), max_model_len=1024, num_gpu_blocks=1024)

    def embed(llm: LLM) -> torch.Tensor:
        return torch.tensor([o.outputs.embedding for o in llm.embed(prompts, use_tqdm=False)])

    fp8 = LLM(quantization="fp8", **kw)
    e_fp8 = embed(fp8)
    rounded = {n: t.clone() for n, t in dequantized_parameters(fp8.engine.model)}
    del fp8
    gc.collect()
    torch.cuda.empty_cache()
    bf16 = LLM(**kw)  # the same seed: the same random weights
    e_bf16 = embed(bf16)
    with torch.no_grad():
        for n, p in bf16.engine.model.named_parameters():
            err = ((rounded[n].float() - p.float()).norm() / p.float().norm()).item()
            assert err < 0.05, f"{n}: not the same random weights ({err:.3f} apart)"
            p.copy_(rounded[n])
    e_w = embed(bf16)
    cos = torch.nn.functional.cosine_similarity
    out = {"layers": args.layers}
    for name, a, b in (("fp8 vs bf16", e_fp8, e_bf16), ("fp8 weights only vs bf16", e_w, e_bf16),
                       ("fp8 vs fp8 weights only", e_fp8, e_w)):
        c = cos(a, b, dim=-1)
        out[name] = {"min": c.min().item(), "mean": c.mean().item()}
        print(f"{name:26s} cos min {c.min().item():.4f} mean {c.mean().item():.4f}", flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
