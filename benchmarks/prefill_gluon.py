"""The Gluon FA3-style prefill (kernels/flash_prefill_gluon.py), contiguous and paged, beside
our Triton prefill (``flash_attn_varlen`` and ``paged_prefill``, their default configs) and
SDPA's cuDNN and flash backends, one run, bf16, 32 heads, head_dim 128.

    python benchmarks/prefill_gluon.py --out $OUT      # all variants: ~3-4 minutes on an H200
    python benchmarks/prefill_gluon.py --out $OUT --variants gluon --causal-only  # < 4 min

Shapes: 2 x 4096 and 1 x 16384 causal (the targets), 8 x 1024 causal, 2 x 4096 full, and
1 x (8192 cached + 8192 new) causal (a prompt's second half over its cached first half:
paged kernels, the Triton varlen kernel and SDPA with a lower-right causal mask; the
contiguous Gluon kernel is self-attention only). TFLOP/s counts 4 * B * H * D per (query,
key) pair seen: S^2 full, S^2 / 2 causal, + S x prefix; each time is the median of
triton.testing.do_bench. Gluon variants (launcher knobs, see flash_prefill_gluon), static
schedules first: ``gluon_run72`` (run 72's default: static, all pairs in one chunk, no PV
overlap, one Q buffer), ``gluon_grid`` (one program per work tile, default order),
``gluon_grid_all`` (one per tile, all pairs), ``gluon_snake_all`` (static boustrophedon, all
pairs); ``gluon`` (the defaults: persistent, dynamic schedule (a global tile counter the
kernel zeroes itself), the work order in chunks of default_head_group (head, sequence)
pairs, heaviest first within each, ping-pong, PV overlap, two Q buffers), ``gluon_memset``
(the counter zeroed by a memset before each launch), ``gluon_no_overlap`` (the softmax waits
for its own P.V), ``gluon_no_pingpong``, ``gluon_q1`` (one Q buffer: the next tile's Q loads
only once this one's last S is done), ``gluon_stages3`` (3-deep K/V ring, so one Q buffer),
``gluon_hg1`` / ``gluon_hg_x4`` / ``gluon_hg_all`` (chunks of 1 pair, 4x the default, all
pairs), ``gluon_nocache`` (the TMA maps encoded on every call, as before tma_maps). Paged (``paged_prefill_gluon`` and ``triton_paged``): the same keys scattered over a
block-16 cache in shuffled block order; ``gluon_paged_static`` (static schedule),
``gluon_paged`` (the defaults), ``gluon_paged_q1`` / ``_q2`` (one / two Q buffers),
``gluon_paged_b128`` (the defaults over a block-128 cache: one box a tile, no gather),
``gluon_paged_stages3`` (3-deep K/V ring), ``gluon_paged_nocache`` (TMA maps every call),
``gluon_paged_gather*`` (``producer="gather"``: cp.async rows instead of TMA boxes; static
schedule, the defaults, 3 stages, consumers at 232 registers instead of 224, block 128),
``gluon_paged_r224`` (the TMA producer with consumers at 224 registers: what gather's
register split alone costs), ``gluon_paged_tma1`` / ``_tma1_b128`` / ``_tma1_stages3`` (``producer="tma1"``:
the TMA boxes issued by a producer of one warp; over block 128; a 3-deep ring); the table's last columns: paged / contiguous
Gluon (issue 5: within 5%), the gather producer's / contiguous, tma1's / contiguous, paged / cuDNN, paged / Triton paged. Every output is checked against SDPA flash first (self-attention over the
whole sequence, the new tokens' rows; rel err < 1e-2; a failure is recorded as a string,
never raised: a hang is not, so run this under ``timeout``); past --budget seconds the
remaining Gluon variants are skipped (recorded as such). Writes $OUT/prefill_gluon.json
after every measurement and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

HEADS, D = 32, 128
# (batch, new tokens a sequence, causal, cached prefix a sequence): the self-attention shapes
# of the targets (no prefix), then 1 x 16384 as 8192 cached + 8192 new (paged kernels,
# the Triton varlen kernel and SDPA with a lower-right causal mask only)
SHAPES = [(2, 4096, True, 0), (1, 16384, True, 0), (8, 1024, True, 0), (2, 4096, False, 0),
          (1, 8192, True, 8192)]
PAGE = 16  # the paged columns' block size (the engine's default)


def _hg(b: int, s: int, factor: int) -> int:
    from flashpage.kernels.flash_prefill_gluon import default_head_group

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return min(HEADS * b, factor * default_head_group(-(-s // 128), HEADS * b, sms))


# name -> (batch, seqlen) -> launcher keywords
GLUON_VARIANTS: dict[str, Callable[[int, int], dict]] = {
    # the static schedules first: a hang in the dynamic one's counter or tile posting would
    # leave them timed (in the JSON, written after every column)
    "gluon_run72": lambda b, s: {"schedule": "static", "pv_overlap": False, "head_group": HEADS * b,
                                 "q_buffers": 1},
    "gluon_grid": lambda b, s: {"persistent": False},
    "gluon_grid_all": lambda b, s: {"persistent": False, "head_group": HEADS * b},
    "gluon_snake_all": lambda b, s: {"schedule": "snake", "head_group": HEADS * b},
    "gluon": lambda b, s: {},
    "gluon_memset": lambda b, s: {"schedule": "dynamic_memset"},
    "gluon_no_overlap": lambda b, s: {"pv_overlap": False},
    "gluon_no_pingpong": lambda b, s: {"pingpong": False},
    "gluon_q1": lambda b, s: {"q_buffers": 1},
    "gluon_q2": lambda b, s: {"q_buffers": 2},
    "gluon_stages3": lambda b, s: {"num_stages": 3},
    "gluon_hg1": lambda b, s: {"head_group": 1},
    "gluon_hg_x4": lambda b, s: {"head_group": _hg(b, s, 4)},
    "gluon_hg_all": lambda b, s: {"head_group": HEADS * b},
    "gluon_nocache": lambda b, s: {"cache_descriptors": False},
}
# paged_prefill_gluon over a block-16 cache with shuffled block tables (static first, as above)
PAGED_VARIANTS: dict[str, dict] = {
    "gluon_paged_static": {"schedule": "static"},
    "gluon_paged": {},  # the defaults (q_buffers by max_seqlen_k)
    "gluon_paged_q1": {"q_buffers": 1},
    "gluon_paged_q2": {"q_buffers": 2},
    "gluon_paged_b128": {},  # the defaults over a block-128 cache (one TMA box a K/V tile)
    "gluon_paged_stages3": {"num_stages": 3},  # a 3-deep K/V ring (so one Q buffer)
    "gluon_paged_nocache": {"cache_descriptors": False},  # TMA maps encoded every call
    # producer="gather": cp.async rows instead of TMA boxes (consumers at 224 registers)
    "gluon_paged_gather_static": {"producer": "gather", "schedule": "static"},
    "gluon_paged_gather": {"producer": "gather"},
    "gluon_paged_gather_stages3": {"producer": "gather", "num_stages": 3},
    "gluon_paged_gather_r232": {"producer": "gather", "consumer_regs": 232},  # producer 40: spills
    "gluon_paged_gather_b128": {"producer": "gather"},  # over the block-128 cache
    "gluon_paged_r224": {"consumer_regs": 224},  # the TMA producer under gather's register split
    # producer="tma1": the TMA boxes from a producer of one warp (no bar.sync between issues)
    "gluon_paged_tma1": {"producer": "tma1"},
    "gluon_paged_tma1_b128": {"producer": "tma1"},  # over the block-128 cache (one box a tile)
    "gluon_paged_tma1_stages3": {"producer": "tma1", "num_stages": 3},  # its ring 3 deep (one Q buffer)
}
COLUMNS = [*GLUON_VARIANTS, *PAGED_VARIANTS, "triton", "triton_paged", "sdpa_cudnn", "sdpa_flash"]


def flops(b: int, s: int, causal: bool, prefix: int = 0) -> float:
    """4 B H D x (query, key) pairs seen: s (prefix + s) full, s prefix + s^2 / 2 causal."""
    return 4 * b * HEADS * D * (s * prefix + (s * s / 2 if causal else s * s))


def tflops(b: int, s: int, causal: bool, ms: float, prefix: int = 0) -> float:
    return round(flops(b, s, causal, prefix) / (ms * 1e-3) / 1e12, 1)


def _paged(k, v, b: int, n: int, page: int, seed: int = 0):
    """k, v [b * n, H, D] (b sequences of n keys) scattered into a cache of page-slot blocks
    in shuffled order: (key_cache, value_cache, block_tables int32 [b, n / page])."""
    nblk = -(-n // page)
    perm = torch.randperm(b * nblk, generator=torch.Generator().manual_seed(seed)).to(k.device)
    tables = perm.view(b, nblk).to(torch.int32)
    kc = torch.zeros(b * nblk, page, HEADS, D, dtype=k.dtype, device=k.device)
    vc = torch.zeros_like(kc)
    pos = torch.arange(n, device=k.device)
    for i in range(b):
        blk = tables[i].long()[pos // page]
        kc[blk, pos % page] = k[i * n:(i + 1) * n]
        vc[blk, pos % page] = v[i * n:(i + 1) * n]
    return kc, vc, tables


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--budget", type=float, default=200.0,
                    help="seconds after which the remaining Gluon variants are skipped")
    ap.add_argument("--variants", default="", help="comma-separated Gluon variants (default: all)")
    ap.add_argument("--paged-variants", default="",
                    help="comma-separated paged Gluon variants (default: all; 'none' for none)")
    ap.add_argument("--causal-only", action="store_true", help="only the causal shapes")
    ap.add_argument("--shapes", default="",
                    help="comma-separated BxS (e.g. 8x1024; prefixed ones as PREFIX+BxS, 8192+1x8192): only these")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every column this many times, in turn, and keep the median")
    args = ap.parse_args()
    chosen = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(chosen) - set(GLUON_VARIANTS))
    if unknown:
        sys.exit(f"unknown variants {unknown}; known: {sorted(GLUON_VARIANTS)}")
    paged_chosen = [v for v in args.paged_variants.split(",") if v]
    unknown = sorted(set(paged_chosen) - set(PAGED_VARIANTS) - {"none"})
    if unknown:
        sys.exit(f"unknown paged variants {unknown}; known: {sorted(PAGED_VARIANTS)}")
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (sm_90 for the Gluon kernel)")
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    from flashpage.kernels.flash_prefill import flash_attn_varlen, paged_prefill
    from flashpage.kernels.flash_prefill_gluon import flash_prefill_gluon, paged_prefill_gluon

    os.environ["FLASHPAGE_PREFILL_GLUON"] = "0"  # triton_paged: the Triton kernel
    t0 = time.time()
    rows = []
    only = {x for x in args.shapes.split(",") if x}
    for b, s, causal, prefix in SHAPES:
        if args.causal_only and not causal:
            continue
        if only and (f"{prefix}+{b}x{s}" if prefix else f"{b}x{s}") not in only:
            continue
        n = prefix + s  # keys a sequence
        g = torch.Generator(device="cuda").manual_seed(0)
        qf, k, v = (torch.randn(b * n, HEADS, D, generator=g, device="cuda", dtype=torch.bfloat16)
                    for _ in range(3))
        q = qf.view(b, n, HEADS, D)[:, prefix:].reshape(b * s, HEADS, D)  # the new tokens' queries
        cu_q = torch.arange(0, b * s + 1, s, dtype=torch.int32, device="cuda")
        cu_k = torch.arange(0, b * n + 1, n, dtype=torch.int32, device="cuda")
        seq_lens = torch.full((b,), n, dtype=torch.int32, device="cuda")
        kc, vc, tables = _paged(k, v, b, n, PAGE)
        caches = {PAGE: (kc, vc, tables), 128: _paged(k, v, b, n, 128, seed=1)}
        q4 = q.view(b, s, HEADS, D).transpose(1, 2)
        k4, v4 = (t.view(b, n, HEADS, D).transpose(1, 2) for t in (k, v))

        def sdpa(be, causal=causal, q4=q4, k4=k4, v4=v4, s=s, n=n):
            with sdpa_kernel(be):
                if causal and s != n:  # bottom-right: query i at key position n - s + i
                    return F.scaled_dot_product_attention(q4, k4, v4, attn_mask=causal_lower_right(s, n))
                return F.scaled_dot_product_attention(q4, k4, v4, is_causal=causal)

        # the reference: self-attention over the whole sequence, its last s query rows
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            qf4 = qf.view(b, n, HEADS, D).transpose(1, 2)
            ref = F.scaled_dot_product_attention(qf4, k4, v4, is_causal=causal)[:, :, prefix:]
        ref = ref.transpose(1, 2).reshape(b * s, HEADS, D).float()
        del qf4
        fns: dict[str, Callable] = {}
        kwargs = {}
        if prefix == 0:  # the contiguous Gluon kernel is self-attention only
            kwargs = {name: make(b, s) for name, make in GLUON_VARIANTS.items()
                      if not chosen or name in chosen}
            fns.update({name: (lambda kw=kw, causal=causal, q=q, k=k, v=v, cu=cu_q, s=s:
                               flash_prefill_gluon(q, k, v, cu, s, causal=causal, **kw))
                        for name, kw in kwargs.items()})
        paged_kwargs = {name: kw for name, kw in PAGED_VARIANTS.items()
                        if "none" not in paged_chosen and (not paged_chosen or name in paged_chosen)}
        fns.update({name: (lambda kw=kw, causal=causal, q=q, c=caches[128 if name.endswith("_b128") else PAGE],
                           cu=cu_q, lens=seq_lens, s=s, n=n:
                           paged_prefill_gluon(q, *c, cu, lens, s, n, causal=causal, **kw))
                    for name, kw in paged_kwargs.items()})
        fns["triton"] = lambda causal=causal, q=q, k=k, v=v, cq=cu_q, ck=cu_k, s=s, n=n: \
            flash_attn_varlen(q, k, v, cq, ck, s, n, causal=causal)
        fns["triton_paged"] = lambda causal=causal, q=q, kc=kc, vc=vc, t=tables, cu=cu_q, \
            lens=seq_lens, s=s, n=n: paged_prefill(q, kc, vc, t, cu, lens, s, n, causal=causal)
        fns["sdpa_cudnn"] = lambda: sdpa(SDPBackend.CUDNN_ATTENTION).transpose(1, 2)
        fns["sdpa_flash"] = lambda: sdpa(SDPBackend.FLASH_ATTENTION).transpose(1, 2)
        row: dict = dict(batch=b, seqlen=s, prefix=prefix, heads=HEADS, head_dim=D, causal=causal,
                         page=PAGE, gluon_kwargs=kwargs, paged_kwargs=paged_kwargs,
                         default_head_group=_hg(b, s, 1))
        times: dict[str, list[float]] = {}
        for rnd in range(args.rounds):  # the columns in turn each round: drift hits them alike
            for name, fn in fns.items():
                if isinstance(row.get(name), str):
                    continue  # failed or skipped in an earlier round
                if name.startswith("gluon") and time.time() - t0 > args.budget:
                    row[name] = f"n/a: skipped, past --budget {args.budget:.0f} s"
                    print(f"  {label(row)} {name}: {row[name]}", flush=True)
                    continue
                try:
                    if rnd == 0:
                        o = fn().reshape(ref.shape).float()
                        torch.cuda.synchronize()
                        err = ((o - ref).norm() / ref.norm()).item()
                        if not err < 1e-2:
                            raise RuntimeError(f"wrong output: rel err {err:.3g}")
                    ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
                    times.setdefault(name, []).append(tflops(b, s, causal, ms, prefix))
                    row[name] = statistics.median(times[name])
                    row.setdefault("rounds", {})[name] = times[name]
                except Exception as ex:  # recorded, the other columns still run
                    row[name] = f"n/a: {type(ex).__name__}: {str(ex)[:160]}"
                print(f"  {label(row)} {name}: {row[name]}", flush=True)
                env = save(args.out, t0, [*rows, row])  # after every column: a hang keeps these
        rows.append(row)
        del q, qf, k, v, q4, k4, v4, ref, kc, vc, caches
    print(render(rows, env))


def label(r: dict) -> str:
    pre = f"{r['prefix']}+" if r.get("prefix") else ""
    return f"{r['batch']}x{pre}{r['seqlen']} {'causal' if r['causal'] else 'full'}"


def save(out: str, t0: float, rows: list[dict]) -> dict:
    env = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=__import__("triton").__version__, seconds=round(time.time() - t0, 1))
    os.makedirs(out, exist_ok=True)
    (Path(out) / "prefill_gluon.json").write_text(json.dumps(dict(env=env, rows=rows), indent=1))
    return env


def render(rows: list[dict], env: dict) -> str:
    def cell(x) -> str:
        return f"{x:.0f}" if isinstance(x, float) else "n/a"

    def ratio(r, a, b) -> str:
        x, y = r.get(a), r.get(b)
        return f"{x / y:.2f}x" if isinstance(x, float) and isinstance(y, float) else "n/a"

    cols = [c for c in COLUMNS if any(c in r for r in rows)]  # the columns this run timed
    lines = [f"TFLOP/s, bf16, {HEADS} heads, head_dim {D}, paged: block {PAGE}, shuffled tables "
             f"({env['device']}, torch {env['torch']}, triton {env['triton']}, {env['seconds']} s); "
             "shape B x [cached +] new tokens", "",
             "| shape | " + " | ".join(cols)
             + " | gluon / cuDNN | gluon / flash | best gluon | best / cuDNN"
             + " | paged / gluon | gather / gluon | tma1 / gluon | paged / cuDNN"
             + " | paged / triton_paged |",
             "|---" * (len(cols) + 10) + "|"]
    for r in rows:
        timed = {c: r[c] for c in GLUON_VARIANTS if isinstance(r.get(c), float)}
        best = max(timed, key=lambda c: timed[c]) if timed else "gluon"
        lines.append(f"| {label(r)} | " + " | ".join(cell(r.get(c)) for c in cols)
                     + f" | {ratio(r, 'gluon', 'sdpa_cudnn')} | {ratio(r, 'gluon', 'sdpa_flash')}"
                     + f" | {best} | {ratio(r, best, 'sdpa_cudnn')}"
                     + f" | {ratio(r, 'gluon_paged', 'gluon')} | {ratio(r, 'gluon_paged_gather', 'gluon')}"
                     + f" | {ratio(r, 'gluon_paged_tma1', 'gluon')}"
                     + f" | {ratio(r, 'gluon_paged', 'sdpa_cudnn')}"
                     + f" | {ratio(r, 'gluon_paged', 'triton_paged')} |")
    fails = [(label(r), c, r[c]) for r in rows for c in COLUMNS if isinstance(r.get(c), str)]
    lines += [f"- {shape} {c}: {why}" for shape, c, why in fails]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
