"""The server's Files and Batches APIs (server/files.py, server/batches.py): a batch run on
the served engine answers each line as the live endpoint does, its faulty lines in the error
file as ``run-batch`` writes them; cancel aborts what runs and runs nothing more; the files'
errors (purpose, size cap, unknown ids), and a file store in a folder."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.server.conftest import live_server

pytest.importorskip("fastapi")

from tests.server.test_run_batch import line, same  # noqa: E402

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}


def jsonl(rows: list) -> bytes:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows).encode()


def upload(url: str, data: bytes, purpose: str = "batch", name: str = "in.jsonl") -> httpx.Response:
    return httpx.post(url + "/v1/files", files={"file": (name, data)}, data={"purpose": purpose},
                      timeout=30)


def start(url: str, data: bytes, endpoint: str = "/v1/chat/completions") -> dict:
    fid = upload(url, data).json()["id"]
    r = httpx.post(url + "/v1/batches", json={"input_file_id": fid, "endpoint": endpoint,
                                              "completion_window": "24h"}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def wait(url: str, bid: str, until=("completed", "failed", "cancelled"), timeout: float = 60,
         check=lambda b: True) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        b = httpx.get(f"{url}/v1/batches/{bid}", timeout=30).json()
        if b["status"] in until and check(b):
            return b
        assert time.monotonic() < deadline, b
        time.sleep(0.02)


def content(url: str, fid: str) -> list[dict]:
    r = httpx.get(f"{url}/v1/files/{fid}/content", timeout=30)
    assert r.status_code == 200
    return [json.loads(x) for x in r.text.splitlines()]


def test_batch_with_the_openai_client_equals_the_live_endpoints(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    other = {**CHAT, "messages": [{"role": "user", "content": "the quick brown fox"}],
             "max_tokens": 6, "logprobs": True, "top_logprobs": 2}
    bad_body = {**CHAT, "max_tokens": 0}
    rows = [line("a", "/v1/chat/completions", CHAT),
            "{not json",
            line("b", "/v1/chat/completions", other),
            line("a", "/v1/chat/completions", CHAT),  # a's id again
            line("emb", "/v1/embeddings", {"input": "hello"}),  # not the batch's endpoint
            line("invalid", "/v1/chat/completions", bad_body),
            line("model", "/v1/chat/completions", {**CHAT, "model": "other"}),
            "",
            line("c", "/v1/chat/completions", {**CHAT, "model": "tiny"})]
    f = client.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
    assert (f.object, f.purpose, f.filename, f.bytes) == ("file", "batch", "in.jsonl", len(jsonl(rows)))
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                              completion_window="24h", metadata={"run": "one"})
    assert b.status == "validating" and b.metadata == {"run": "one"} and b.id.startswith("batch_")
    done = wait(server.url, b.id)
    b = client.batches.retrieve(b.id)
    assert b.status == "completed" == done["status"]
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (8, 3, 5)
    assert b.in_progress_at is not None and b.completed_at is not None and b.failed_at is None
    outs = [json.loads(x) for x in client.files.content(b.output_file_id).text.splitlines()]
    errs = [json.loads(x) for x in client.files.content(b.error_file_id).text.splitlines()]
    assert client.files.retrieve(b.output_file_id).purpose == "batch_output"
    # the lines that ran, in input order, each as the live endpoint answers the same body
    assert [o["custom_id"] for o in outs] == ["a", "b", "c"]
    for o, body in zip(outs, (CHAT, other, CHAT), strict=True):
        assert o["error"] is None and o["response"]["status_code"] == 200
        live = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        same(o["response"]["body"], live.json())
    # the others in the error file, as run-batch writes them
    assert [e["custom_id"] for e in errs] == [None, "a", "emb", "invalid", "model"]
    assert [e["response"]["status_code"] for e in errs] == [400, 400, 400, 400, 404]
    for e in errs:
        assert e["error"] == e["response"]["body"] and set(e["error"]) == {"error"}
    msg = [e["error"]["error"] for e in errs]
    assert "line 2 is not JSON" in msg[0]["message"]
    assert msg[1]["param"] == "custom_id" and "already used on line 1" in msg[1]["message"]
    assert msg[2]["param"] == "url" and "'/v1/chat/completions'" in msg[2]["message"]
    for e, body in ((errs[3], bad_body), (errs[4], {**CHAT, "model": "other"})):
        live = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert live.status_code == e["response"]["status_code"] and live.json() == e["error"]
    assert server.wait_idle()["flashpage:kv_cache_blocks_used"] == 0
    for fid in (f.id, b.output_file_id, b.error_file_id):
        assert client.files.delete(fid).deleted


def test_batch_errors(server):
    url = server.url
    fid = upload(url, jsonl([line("a", "/v1/completions", {"prompt": "x", "max_tokens": 1})])).json()["id"]
    ok = {"input_file_id": fid, "endpoint": "/v1/completions", "completion_window": "24h"}
    cases = [({**ok, "input_file_id": "file-nope"}, 404, "input_file_id", "'file-nope'"),
             ({**ok, "endpoint": "/v1/nowhere"}, 400, "endpoint", "/v1/chat/completions"),
             ({**ok, "completion_window": "1h"}, 400, "completion_window", "24h"),
             ({k: v for k, v in ok.items() if k != "endpoint"}, 400, "endpoint", "endpoint"),
             ({**ok, "metadata": {"k": 1}}, 400, "metadata.k", "valid string")]
    for body, status, param, words in cases:
        r = httpx.post(url + "/v1/batches", json=body, timeout=30)
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == param and words in err["message"], err
    for path, method in (("/v1/batches/batch_nope", "GET"), ("/v1/batches/batch_nope/cancel", "POST")):
        r = httpx.request(method, url + path, timeout=30)
        assert r.status_code == 404 and "'batch_nope'" in r.json()["error"]["message"]
    # a batch's results are not an input (purpose batch_output)
    done = wait(url, httpx.post(url + "/v1/batches", json=ok, timeout=30).json()["id"])
    assert done["status"] == "completed" and done["error_file_id"] is None
    r = httpx.post(url + "/v1/batches", json={**ok, "input_file_id": done["output_file_id"]})
    assert r.status_code == 400 and "batch_output" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/batches/{done['id']}/cancel", timeout=30)
    assert r.status_code == 409 and "completed" in r.json()["error"]["message"]
    # a file none of whose lines can run fails, naming them; an empty one too
    failed = wait(url, start(url, jsonl(["not json", "[1, 2]", line("x", "/v1/embeddings", {})]),
                             "/v1/completions")["id"])
    assert failed["status"] == "failed" and failed["output_file_id"] is None
    assert failed["error_file_id"] is None and failed["failed_at"] is not None
    assert [(e["line"], e["param"]) for e in failed["errors"]["data"]] == [(1, None), (2, None),
                                                                          (3, "url")]
    assert "line 1 is not JSON" in failed["errors"]["data"][0]["message"]
    empty = wait(url, start(url, b"\n\n")["id"])
    assert empty["status"] == "failed" and empty["errors"]["data"][0]["code"] == "empty_file"
    # the list, newest first, paged by after
    page = httpx.get(url + "/v1/batches", params={"limit": 2}, timeout=30).json()
    assert [b["id"] for b in page["data"]] == [empty["id"], failed["id"]] and page["has_more"]
    rest = httpx.get(url + "/v1/batches", params={"limit": 1, "after": page["last_id"]}).json()
    assert rest["data"][0]["id"] == done["id"]
    r = httpx.get(url + "/v1/batches", params={"limit": 0}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "limit"


def test_files(server, monkeypatch):
    url = server.url
    # bytes the form's own syntax uses come back as they went
    data = b"--x\r\n\r\n--boundary\r\n\xc3\xa9 \x00\r\n--"
    f = upload(url, data, name="odd name.jsonl").json()
    assert (f["object"], f["bytes"], f["filename"], f["purpose"]) == ("file", len(data),
                                                                      "odd name.jsonl", "batch")
    assert f["id"].startswith("file-") and httpx.get(f"{url}/v1/files/{f['id']}").json() == f
    assert httpx.get(f"{url}/v1/files/{f['id']}/content").content == data
    g = upload(url, b"{}\n").json()
    listed = httpx.get(url + "/v1/files", params={"purpose": "batch", "limit": 1}).json()
    assert [x["id"] for x in listed["data"]] == [g["id"]] and listed["has_more"]
    nxt = httpx.get(url + "/v1/files", params={"purpose": "batch", "after": g["id"], "limit": 1})
    assert [x["id"] for x in nxt.json()["data"]] == [f["id"]]
    # refused uploads, by name
    for kw, param, words in (
            (dict(files={"file": ("a", b"x")}, data={"purpose": "fine-tune"}), "purpose", "'fine-tune'"),
            (dict(files={"file": ("a", b"x")}), "purpose", "purpose is required"),
            (dict(data={"purpose": "batch"}, files={"other": ("a", b"x")}), "file", "file is required"),
            (dict(json={"purpose": "batch"}), None, "multipart/form-data")):
        r = httpx.post(url + "/v1/files", timeout=30, **kw)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert words in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/files", content=b"--b\r\nno end", timeout=30,
                   headers={"content-type": "multipart/form-data; boundary=b"})
    assert r.status_code == 400 and "closing boundary" in r.json()["error"]["message"]
    # unknown ids, and delete
    for method, path in (("GET", "/v1/files/file-nope"), ("GET", "/v1/files/file-nope/content"),
                         ("DELETE", "/v1/files/file-nope")):
        r = httpx.request(method, url + path, timeout=30)
        assert r.status_code == 404 and "'file-nope'" in r.json()["error"]["message"]
    assert httpx.delete(f"{url}/v1/files/{g['id']}").json() == {"id": g["id"], "object": "file",
                                                               "deleted": True}
    assert httpx.get(f"{url}/v1/files/{g['id']}").status_code == 404
    # the cap: the stored files together, uploads past it 413s naming it; deleting makes room
    held = sum(x["bytes"] for x in httpx.get(url + "/v1/files").json()["data"])
    monkeypatch.setenv("FLASHPAGE_FILES_MAX_BYTES", str(held + 1000))
    first = upload(url, b"x" * 600)
    assert first.status_code == 200
    r = upload(url, b"y" * 600)
    assert r.status_code == 413 and "FLASHPAGE_FILES_MAX_BYTES" in r.json()["error"]["message"]
    assert str(held + 1000) in r.json()["error"]["message"]
    r = upload(url, b"z" * (held + 1000 + (64 << 10) + 1))  # the body itself over it
    assert r.status_code == 413 and "FLASHPAGE_FILES_MAX_BYTES" in r.json()["error"]["message"]
    httpx.delete(f"{url}/v1/files/{first.json()['id']}")
    assert upload(url, b"y" * 600).status_code == 200


def test_cancel_aborts_what_runs_and_runs_nothing_more(tiny_model_dir, tmp_path):
    """Two lines in the engine at once (max_num_seqs 2): cancel after the first finishes;
    the finished ones are kept, the running ones aborted, the rest never reach the engine. A
    live request runs beside the batch; a batch still running when the server stops is
    cancelled with it."""
    body = {"prompt": "one two three", "max_tokens": 100, "ignore_eos": True, "temperature": 0}
    rows = [line(f"r{i}", "/v1/completions", body) for i in range(12)]
    with live_server(tiny_model_dir, engine_kw={"max_num_seqs": 2}, files_dir=str(tmp_path)) as s:
        b = start(s.url, jsonl(rows), "/v1/completions")
        live = httpx.post(s.url + "/v1/chat/completions", json=CHAT, timeout=60)
        assert live.status_code == 200 and live.json()["usage"]["completion_tokens"] == 4
        wait(s.url, b["id"], ("in_progress",), check=lambda x: x["request_counts"]["completed"] >= 1)
        r = httpx.post(f"{s.url}/v1/batches/{b['id']}/cancel", timeout=30)
        assert r.status_code == 200 and r.json()["status"] == "cancelling"
        done = wait(s.url, b["id"], ("cancelled",))
        counts = done["request_counts"]
        assert counts["total"] == 12 and counts["failed"] == 0 and 1 <= counts["completed"] < 12
        assert done["cancelling_at"] is not None and done["cancelled_at"] is not None
        outs = content(s.url, done["output_file_id"])
        assert len(outs) == counts["completed"]
        assert all(o["response"]["body"]["usage"]["completion_tokens"] == 100 for o in outs)
        assert (tmp_path / done["output_file_id"]).read_bytes().count(b"\n") == len(outs)
        m = s.wait_idle()
        assert m["flashpage:kv_cache_blocks_used"] == 0
        aborted = m.get('flashpage:request_finished_total{finish_reason="abort"}', 0)
        # what ran when cancelled was aborted (neither finished nor left running), the rest
        # never started
        assert aborted <= 2 and counts["completed"] + aborted < 12
        assert m['flashpage:request_finished_total{finish_reason="length"}'] == counts["completed"] + 1
        again = httpx.post(f"{s.url}/v1/batches/{b['id']}/cancel", timeout=30).json()
        assert again["status"] == "cancelled"  # (cancelling a cancelled batch: as it is)
        running = start(s.url, jsonl(rows), "/v1/completions")
        wait(s.url, running["id"], ("in_progress",))
    # (live_server checks the server and its engine thread stopped)


def test_file_store_in_a_folder(tmp_path):
    from flashpage.server.files import FileStore

    store = FileStore(str(tmp_path))
    a = store.add(b"one\n", "a.jsonl", "batch")
    b = store.add(b"two\r\n", "b.jsonl", "batch_output", check_limit=False)
    again = FileStore(str(tmp_path))  # a restart finds them
    assert again.get(a["id"]) == a and again.content(b["id"]) == b"two\r\n"
    assert [o["id"] for o in again.page(None, 10, None, "asc")["data"]] == [a["id"], b["id"]]
    assert again.delete(a["id"])["deleted"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([b["id"], f"{b['id']}.json"])
    assert FileStore(str(tmp_path)).used() == len(b"two\r\n")
