"""``flashpage run-batch`` (server/run_batch.py): each line's body answered as the live
server answers it (chat, completions, embeddings, score, rerank, responses, tokenize), in
input order; every
fault of the file its own error line while the others run, no KV block left behind; the
command end to end (stdin / stdout, URLs in and out) and its errors before the model loads."""

from __future__ import annotations

import asyncio
import http.server
import json
import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import MAX_MODEL_LEN, engine_kwargs

pytest.importorskip("fastapi")

from flashpage.server.run_batch import _routes, parse_lines, run_batch  # noqa: E402

CLI_ENGINE = ["--dtype", "float32", "--device", "cpu", "--max-model-len", str(MAX_MODEL_LEN),
              "--block-size", "8"]


@pytest.fixture(scope="module")
def batch_llm(tiny_model_dir):
    from flashpage import LLM

    return LLM(str(tiny_model_dir), **engine_kwargs())


def run_lines(llm, lines: list, name: str = "tiny", **kw) -> list[dict]:
    """The output lines for ``lines`` (dicts, or raw text for a broken line)."""
    raw = [(x if isinstance(x, str) else json.dumps(x)).encode() for x in lines]
    out: list[str] = []
    asyncio.run(run_batch(llm.engine, parse_lines(raw, _routes()), out.append, name,
                          progress=False, **kw))
    assert all(s.endswith("\n") and "\n" not in s[:-1] for s in out)
    return [json.loads(s) for s in out]


def line(cid, url, body, method="POST"):
    return {"custom_id": cid, "method": method, "url": url, "body": body}


def same(a, b, path="body"):
    """a == b, floats within 1e-4 (the batch and the server batch embeddings differently)
    and ids / timestamps aside."""
    if isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            if k not in ("id", "created", "created_at"):
                same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) or isinstance(b, float):
        assert math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-5), (path, a, b)
    else:
        assert a == b, (path, a, b)


BODIES = [
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hello"}],
                              "max_tokens": 8, "temperature": 0, "logprobs": True,
                              "top_logprobs": 2}),
    ("/v1/completions", {"model": "tiny", "prompt": ["the quick brown", "one two three"],
                         "max_tokens": 6, "temperature": 0, "logprobs": 1, "echo": True}),
    ("/v1/embeddings", {"model": "tiny", "input": ["the quick brown fox", "a lazy dog"]}),
    ("/v1/score", {"model": "tiny", "text_1": "hello world", "text_2": ["hello", "one two"]}),
    ("/v1/rerank", {"query": "the fox", "documents": ["a lazy dog", "the quick brown fox"],
                    "top_n": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "the capital of"}],
                              "max_tokens": 5, "temperature": 0, "n": 2}),
    ("/v1/responses", {"input": "hello there", "max_output_tokens": 5, "temperature": 0}),
    ("/tokenize", {"prompt": "hello world"}),
]


def test_outputs_equal_the_servers_answers_in_input_order(server, batch_llm):
    outs = run_lines(batch_llm, [line(f"req-{i}", url, body) for i, (url, body) in enumerate(BODIES)])
    assert [o["custom_id"] for o in outs] == [f"req-{i}" for i in range(len(BODIES))]
    assert len({o["id"] for o in outs}) == len(outs)
    for o, (url, body) in zip(outs, BODIES, strict=True):
        assert o["id"].startswith("batch_req_") and o["error"] is None
        resp = o["response"]
        assert resp["status_code"] == 200
        assert resp["request_id"] == resp["body"].get("id", resp["request_id"])  # (tokenize: none)
        want = httpx.post(server.url + url, json=body, timeout=60)
        assert want.status_code == 200, want.text
        same(resp["body"], want.json())
    assert outs[0]["response"]["body"]["choices"][0]["message"]["content"]  # something generated
    assert batch_llm.engine.stats()["kv_cache"].blocks_used == 0


def test_each_fault_is_its_own_line_and_the_rest_run(server, batch_llm):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    bad_body = {**chat, "max_tokens": 0}
    too_long = {"prompt": "hello " * 40, "max_tokens": MAX_MODEL_LEN}
    lines = [
        line("a", "/v1/chat/completions", chat),
        "{not json",
        "[1, 2]",
        {"method": "POST", "url": "/v1/chat/completions", "body": chat},  # no custom_id
        line("a", "/v1/chat/completions", chat),  # a's id again
        line("get", "/v1/chat/completions", chat, method="GET"),
        line("url", "/v1/nowhere", chat),
        line("body", "/v1/chat/completions", "hello"),
        line("stream", "/v1/chat/completions", {**chat, "stream": True}),
        line("model", "/v1/chat/completions", {**chat, "model": "other"}),
        line("invalid", "/v1/chat/completions", bad_body),
        line("long", "/v1/completions", too_long),
        "   ",  # blank: skipped
        line("alias", "/v1/chat/completions", {**chat, "model": "/models/tiny"}),
        line("z", "/v1/completions", {"prompt": "one two", "max_tokens": 3, "temperature": 0}),
        line("model_list", "/v1/chat/completions", {**chat, "model": ["tiny"]}),
    ]
    outs = run_lines(batch_llm, lines, aliases=frozenset({"/models/tiny"}))
    assert [o["custom_id"] for o in outs] == ["a", None, None, None, "a", "get", "url", "body",
                                              "stream", "model", "invalid", "long", "alias", "z",
                                              "model_list"]
    by_status = [o["response"]["status_code"] for o in outs]
    assert by_status == [200, 400, 400, 400, 400, 405, 404, 400, 400, 404, 400, 400, 200, 200, 400]
    for o in outs:
        if o["response"]["status_code"] != 200:  # the error body in both places
            assert o["error"] == o["response"]["body"] and set(o["error"]) == {"error"}
        else:
            assert o["error"] is None
    err = [o["error"]["error"] if o["error"] else None for o in outs]
    assert "line 2 is not JSON" in err[1]["message"]
    assert "must be a JSON object" in err[2]["message"]
    assert err[3]["param"] == "custom_id" and "line 4" in err[3]["message"]
    assert err[4]["param"] == "custom_id" and "already used on line 1" in err[4]["message"]
    assert err[5]["param"] == "method" and "'GET'" in err[5]["message"]
    assert err[6]["type"] == "not_found_error" and "/v1/chat/completions" in err[6]["message"]
    assert err[7]["param"] == "body"
    assert err[8]["param"] == "stream" and "not streamed" in err[8]["message"]
    assert err[9]["code"] == "model_not_found"
    assert err[14]["param"] == "model"
    assert outs[12]["response"]["body"]["model"] == "tiny"  # the alias answered as the served name
    # the server's own answers to the same bodies: status and error body alike
    for i, body, url in ((9, {**chat, "model": "other"}, "/v1/chat/completions"),
                         (10, bad_body, "/v1/chat/completions"), (11, too_long, "/v1/completions")):
        want = httpx.post(server.url + url, json=body, timeout=60)
        assert want.status_code == outs[i]["response"]["status_code"]
        assert want.json() == outs[i]["response"]["body"]
    ok = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60).json()
    same(outs[0]["response"]["body"], ok)
    same(outs[12]["response"]["body"], ok)
    assert batch_llm.engine.stats()["kv_cache"].blocks_used == 0


class _Files(http.server.BaseHTTPRequestHandler):
    """GET /in.jsonl answers ``served``; PUT /out.jsonl keeps the body in ``uploaded``."""

    served = b""
    uploaded: list[bytes] = []

    def do_GET(self):
        if self.path != "/in.jsonl":
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.served)))
        self.end_headers()
        self.wfile.write(self.served)

    def do_PUT(self):
        self.uploaded.append(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_cli_reads_and_writes_urls(tiny_model_dir, capsys):
    from flashpage.cli import main

    lines = [line("c", "/v1/completions", {"model": str(tiny_model_dir), "prompt": "one two",
                                           "max_tokens": 3, "temperature": 0}),
             line("e", "/v1/embeddings", {"input": "hello"}),
             line("x", "/v1/files", {})]
    _Files.served = "".join(json.dumps(x) + "\n" for x in lines).encode()
    _Files.uploaded = []
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Files)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        assert main(["run-batch", "-i", base + "/in.jsonl", "-o", base + "/out.jsonl",
                     "--model", str(tiny_model_dir), *CLI_ENGINE]) == 0
        assert main(["run-batch", "-i", base + "/missing.jsonl", "-o", "-"]) == 2
    finally:
        httpd.shutdown()
    err = capsys.readouterr().err
    assert "3 requests, 1 failed (1 x 404)" in err and "cannot read the input file" in err and "404" in err
    outs = [json.loads(x) for x in _Files.uploaded[0].decode().splitlines()]
    assert [o["custom_id"] for o in outs] == ["c", "e", "x"]
    assert [o["response"]["status_code"] for o in outs] == [200, 200, 404]
    # the --model string names the model too; the answer names it as serve does
    assert outs[0]["response"]["body"]["model"] == tiny_model_dir.name


def test_cli_stdin_to_stdout(tiny_model_dir):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    text = json.dumps(line("only", "/v1/chat/completions", body)) + "\n"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    r = subprocess.run([sys.executable, "-m", "flashpage", "run-batch", "-i", "-", "-o", "-",
                        "--model", str(tiny_model_dir), "--served-model-name", "t", *CLI_ENGINE],
                       input=text, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    (out,) = [json.loads(x) for x in r.stdout.splitlines()]  # nothing else on stdout
    assert out["custom_id"] == "only" and out["response"]["status_code"] == 200
    assert out["response"]["body"]["model"] == "t"
    assert out["response"]["body"]["usage"]["completion_tokens"] == 3
    assert "Running batch" in r.stderr  # the progress bar


def test_cli_errors_before_the_model_loads(tmp_path, monkeypatch, capsys):
    import flashpage.cli as cli

    def no_model(args):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(cli, "build_llm", no_model)
    good = tmp_path / "in.jsonl"
    good.write_text(json.dumps(line("a", "/v1/completions", {"prompt": "x"})) + "\n")
    cases = [
        (["-i", str(tmp_path / "nope.jsonl"), "-o", str(tmp_path / "o.jsonl")],
         "cannot read the input file"),
        (["-i", str(good), "-o", str(tmp_path / "no_dir" / "o.jsonl")], "does not exist"),
        (["-i", str(good), "-o", str(tmp_path)], "is a folder"),
    ]
    for argv, message in cases:
        assert cli.main(["run-batch", *argv]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()
    monkeypatch.setitem(sys.modules, "flashpage.server.run_batch", None)  # no serve extra
    assert cli.main(["run-batch", "-i", str(good), "-o", "-"]) == 2
    assert "pip install 'flashpage[serve]'" in capsys.readouterr().err


def test_cli_model_that_cannot_load(tmp_path, capsys):
    from flashpage.cli import main

    good = tmp_path / "in.jsonl"
    good.write_text(json.dumps(line("a", "/v1/completions", {"prompt": "x"})) + "\n")
    out = tmp_path / "o.jsonl"
    assert main(["run-batch", "-i", str(good), "-o", str(out), "--model",
                 str(tmp_path / "no_model"), *CLI_ENGINE]) == 2
    assert "no_model" in capsys.readouterr().err
    assert not out.exists()


def test_a_handler_bug_is_that_lines_500(batch_llm, monkeypatch):
    import flashpage.server.score as score

    async def broken(*args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(score, "rerank", broken)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    outs = run_lines(batch_llm, [line("r", "/v1/rerank", {"query": "q", "documents": ["d"]}),
                                 line("c", "/v1/chat/completions", chat)])
    assert [o["response"]["status_code"] for o in outs] == [500, 200]
    assert outs[0]["error"]["error"] == {"message": "internal server error", "type": "server_error",
                                         "param": None, "code": None}
    assert batch_llm.engine.stats()["kv_cache"].blocks_used == 0
