"""What e4m3 rounding alone does to a model, emulated exactly in fp32 on the CPU: the bound
the fp8 GPU tests are held to (tests/models/test_fp8_weights.py).

    python benchmarks/fp8_emulation.py hidden   # 8B-shaped, 2 layers: cosine of the final
                                                # hidden states against fp32, weights rounded,
                                                # activations rounded (per token), both
    python benchmarks/fp8_emulation.py ranks    # the tiny head128_gqa checkpoint, teacher-forced:
                                                # which bf16 tokens W8A16 / W8A8 move, by margin

"hidden" uses transformers' Llama (N(0, 0.02) weights, norms at 1, as init_random_), the
rounding through pre-hooks (activations) and replaced weights; "ranks" runs our engine on the
CPU with every fp8 linear through ``quant.w8a8_linear_ref`` (W8A8) or as it runs there (W8A16).
Session 17: hidden 0.992 / 0.992 / 0.984 mean (0.986 / 0.989 / 0.977 min); ranks: tokens
with margins up to 2.26 nats moved by either, 65% / 55% kept on top.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from flashpage.layers.quant import (
    dequantize_fp8_rowwise,
    quantize_fp8_per_token,
    quantize_fp8_rowwise,
)

NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def hidden(layers: int) -> None:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=4096, hidden_size=4096, intermediate_size=14336,
                                   num_hidden_layers=layers, num_attention_heads=32,
                                   num_key_value_heads=8, max_position_embeddings=512)
    m = transformers.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.fill_(1.0) if "norm" in n else p.normal_(0, 0.02)
    ids = torch.randint(0, cfg.vocab_size, (4, 100))
    lin = [mod for n, mod in m.named_modules() if n.split(".")[-1] in NAMES]
    orig = [mod.weight.data.clone() for mod in lin]

    def act_round(mod: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        x = args[0]
        q, s = quantize_fp8_per_token(x.reshape(-1, x.shape[-1]))
        return ((q.float() * s).reshape(x.shape),)

    def run(weights: bool, acts: bool) -> torch.Tensor:
        hooks = []
        for mod, w in zip(lin, orig, strict=True):
            mod.weight.data = dequantize_fp8_rowwise(*quantize_fp8_rowwise(w)) if weights else w.clone()
            if acts:
                hooks.append(mod.register_forward_pre_hook(act_round))
        with torch.no_grad():
            h = m.model(ids).last_hidden_state
        for hk in hooks:
            hk.remove()
        return h.reshape(-1, h.shape[-1])

    base = run(False, False)
    for weights, acts in ((True, False), (False, True), (True, True)):
        c = torch.nn.functional.cosine_similarity(run(weights, acts), base, dim=-1)
        print(f"weights rounded {weights!s:5} activations rounded {acts!s:5}: "
              f"cosine min {c.min():.4f} mean {c.mean():.4f}")


def ranks() -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (the repository root)
    import flashpage.layers.linear as linear
    from flashpage.layers.quant import w8a8_linear_ref
    from tests.conftest import build_tiny_checkpoint, random_prompts
    from tests.models.test_fp8_weights import _teacher_forced

    path = build_tiny_checkpoint(Path(tempfile.mkdtemp()), "head128_gqa")
    for mode in ("W8A16", "W8A8"):
        if mode == "W8A8":
            def emulated(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor,
                         b: torch.Tensor | None = None) -> torch.Tensor:
                return w8a8_linear_ref(x.reshape(-1, x.shape[-1]), q, s, b).reshape(*x.shape[:-1], -1)

            linear.fp8_linear = emulated  # type: ignore[assignment]
        for prompts in (random_prompts(1, 5, 5, seed=1), random_prompts(12, 3, 300, seed=2)):
            _, margins, rk = _teacher_forced(path, prompts, max_tokens=24, device="cpu")
            moved = margins[rk != 1]
            print(f"{mode}: {len(prompts)} prompts, {len(rk)} tokens, {float((rk == 1).float().mean()):.0%} "
                  f"kept on top; largest margin moved {float(moved.max()) if len(moved) else 0:.2f} nats")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["hidden", "ranks"])
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()
    hidden(args.layers) if args.what == "hidden" else ranks()


if __name__ == "__main__":
    main()
