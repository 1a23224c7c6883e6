"""`flashpage bench serve`: an online benchmark of the HTTP server.

Sends ``--num-prompts`` streaming /v1/completions requests, arriving as a Poisson process
of ``--request-rate`` requests/s (``inf``: all at once), each a prompt of random token ids
(``--input-len``) asking for exactly ``--output-len`` tokens (ignore_eos). Reports time to
first token, inter-token latency (gaps between streamed chunks; one chunk per step),
time per output token and end-to-end latency percentiles, and request / token throughput,
as JSON.

Without ``--url`` it starts a server on 127.0.0.1 (a free port) in a subprocess with the
given model (``--model``, or ``--config NAME`` for random weights of that shape), and any
argument it does not know is passed to the server (``--max-num-seqs 256``, ``--dtype``...).
It only ever talks to loopback or the given ``--url``.

    flashpage bench serve --config llama-3-8b --num-prompts 500 --request-rate 16 \\
        --input-len 512 --output-len 128 --json-out results/serve.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import logging
import math
import os
import random
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds from sending to the first streamed token
    latency: float = 0.0  # seconds from sending to the last byte
    itl: list[float] = field(default_factory=list)  # gaps between streamed chunks


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flashpage bench serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="a running server (default: start one here)")
    p.add_argument("--model", default=None, help="model for the server it starts")
    p.add_argument("--config", default=None,
                   help="random weights of this shape for the server it starts: a config.json, "
                        "its folder, or a name under ../shared/configs or benchmarks/configs")
    p.add_argument("--served-model-name", default=None,
                   help="the model name to send (default: the server's only model)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="mean arrivals per second, Poisson (default inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="at most this many requests in flight")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)] (default 0: fixed)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup-requests", type=int, default=2)
    p.add_argument("--server-timeout", type=float, default=900.0,
                   help="seconds to wait for the started server to be healthy")
    p.add_argument("--json-out", default=None, help="write the results as JSON here too")
    return p


def main(argv: list[str] | None = None) -> int:
    args, server_args = build_parser().parse_known_args(argv)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
        raise ValueError("--num-prompts, --input-len and --output-len must be >= 1")
    if not 0.0 <= args.range_ratio < 1.0:
        raise ValueError("--range-ratio must be in [0, 1)")
    proc = None
    url = args.url
    try:
        if url is None:
            proc, url = start_server(args, server_args)
        elif server_args:
            raise ValueError(f"unknown arguments {server_args} (server arguments need no --url)")
        result = asyncio.run(run(args, url.rstrip("/")))
    finally:
        if proc is not None:
            stop_server(proc)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json_out:
        os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
        with open(args.json_out, "w") as f:
            f.write(text + "\n")
    return 0 if result["failed"] == 0 else 1


# ---------------------------------------------------------------------------- server
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, server_args: list[str]) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "flashpage.server.api_server", "--host", "127.0.0.1",
           "--port", str(port)]
    if args.model:
        cmd += ["--model", args.model]
    if args.config:
        from flashpage.bench.common import resolve_config

        cmd += ["--random-weights-config", str(resolve_config(args.config))]
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    cmd += server_args
    print("starting:", " ".join(cmd), file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.server_timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before it was ready")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            stop_server(proc)
            raise RuntimeError(f"the server was not healthy after {args.server_timeout:.0f}s")
        time.sleep(0.5)


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


# ---------------------------------------------------------------------------- client
async def run(args: argparse.Namespace, url: str) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(None, connect=30)
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits,
                                 timeout=timeout) as client:
        r = await client.get("/v1/models")
        r.raise_for_status()
        info = r.json()["data"][0]
        model = args.served_model_name or info["id"]
        vocab = int(info.get("vocab_size") or 32000)
        max_len = int(info.get("max_model_len") or 1 << 30)
        rng = random.Random(args.seed)
        jobs = make_requests(rng, args, vocab, max_len)
        for _ in range(args.warmup_requests):
            await one_request(client, model, [rng.randrange(vocab) for _ in range(16)], 8,
                              args.temperature)
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

        async def limited(prompt: list[int], out_len: int) -> RequestResult:
            if sem is None:
                return await one_request(client, model, prompt, out_len, args.temperature)
            async with sem:
                return await one_request(client, model, prompt, out_len, args.temperature)

        tasks = []
        t0 = time.perf_counter()
        for prompt, out_len in jobs:
            tasks.append(asyncio.create_task(limited(prompt, out_len)))
            if math.isfinite(args.request_rate) and args.request_rate > 0:
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    return summarize(args, url, model, results, duration)


def make_requests(rng: random.Random, args: argparse.Namespace, vocab: int,
                  max_len: int) -> list[tuple[list[int], int]]:
    def length(mean: int) -> int:
        lo = max(1, int(mean * (1 - args.range_ratio)))
        hi = max(lo, int(mean * (1 + args.range_ratio)))
        return rng.randint(lo, hi)

    jobs = []
    for _ in range(args.num_prompts):
        n_in, n_out = length(args.input_len), length(args.output_len)
        if n_in + n_out > max_len:
            raise ValueError(f"input {n_in} + output {n_out} tokens exceed the server's "
                             f"max_model_len {max_len}")
        jobs.append(([rng.randrange(vocab) for _ in range(n_in)], n_out))
    return jobs


async def one_request(client: httpx.AsyncClient, model: str, prompt: list[int], out_len: int,
                      temperature: float) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": out_len, "ignore_eos": True,
            "temperature": temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    res = RequestResult(prompt_tokens=len(prompt))
    start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"])
                    return res
                now = time.perf_counter()
                if chunk.get("choices"):
                    if res.ttft == 0.0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
        res.latency = time.perf_counter() - start
        res.ok = res.output_tokens > 0
        if not res.ok:
            res.error = "no usage in the stream"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


# ---------------------------------------------------------------------------- report
def percentiles(xs: list[float], scale: float = 1000.0) -> dict[str, float]:
    """mean, p50, p90, p99 (nearest-rank), in milliseconds by default."""
    if not xs:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    s = sorted(xs)

    def rank(q: float) -> float:
        return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]

    return {"mean": sum(s) / len(s) * scale, "p50": rank(0.5) * scale,
            "p90": rank(0.9) * scale, "p99": rank(0.99) * scale}


def summarize(args: argparse.Namespace, url: str, model: str, results: list[RequestResult],
              duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    errors = sorted({r.error for r in results if not r.ok})
    return {
        "benchmark": "serve",
        "date": datetime.date.today().isoformat(),
        "url": url,
        "model": model,
        "num_prompts": args.num_prompts,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "max_concurrency": args.max_concurrency,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "range_ratio": args.range_ratio,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors[:5],
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": percentiles([r.ttft for r in ok]),
        "itl_ms": percentiles([x for r in ok for x in r.itl]),
        "tpot_ms": percentiles(tpot),
        "e2e_latency_ms": percentiles([r.latency for r in ok]),
    }


if __name__ == "__main__":
    raise SystemExit(main())
