"""OpenAI's Files and Batches APIs on the server (as SGLang's server offers them): a JSON
Lines file of Batch API requests uploaded, then run in the background through the engine
the server serves, beside its live traffic.

``POST /v1/batches`` keeps the input file's bytes and starts a task on the server's loop:
``validating`` (the lines read by ``run_batch.parse_lines``), ``in_progress`` (each line
answered by ``run_batch.start_lines``: the server's own handler for its url, at most the
engine's ``max_num_seqs`` lines in the engine at once, so live requests keep getting
slots), ``finalizing`` (the output file: the lines that succeeded; the error file: those
that failed, each as ``flashpage run-batch`` writes it, in input order), ``completed``. A
file none of whose lines can run (empty, not JSON, ...) is ``failed`` with ``errors``
naming each line. ``POST /v1/batches/{id}/cancel``: ``cancelling``, the running lines
aborted (their KV blocks freed), the waiting ones never run, the finished ones written as
above, then ``cancelled``. Batches are kept in memory (lost on restart); files in a
``FileStore`` (server/files.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from flashpage.server.files import UPLOAD_PURPOSES, FileStore, parse_form
from flashpage.server.protocol import APIError, Str, _Body, bad_request
from flashpage.server.serving import ServerState

logger = logging.getLogger("flashpage.server")

COMPLETION_WINDOWS = ("24h",)
FORM_OVERHEAD = 64 << 10  # an upload's body beyond its file: the form's headers and fields
MAX_LISTED_ERRORS = 100  # a failed batch's "errors" names at most this many lines
TERMINAL = ("completed", "failed", "cancelled", "expired")


class CreateBatchRequest(_Body):
    input_file_id: Str
    endpoint: Str
    completion_window: Str
    metadata: dict[str, Str] | None = None


class _Job:
    def __init__(self, obj: dict[str, Any], data: bytes) -> None:
        self.obj = obj
        self.data = data  # the input file's bytes, until its lines are read
        self.task: asyncio.Task[None] | None = None


def _now() -> int:
    return int(time.time())


def _errors(items: list[dict[str, Any]]) -> dict[str, Any]:
    return {"object": "list", "data": items[:MAX_LISTED_ERRORS]}


class Batches:
    """The server's batches (id -> OpenAI's batch object and its task), over ``files``."""

    def __init__(self, state: ServerState, files: FileStore) -> None:
        from flashpage.server.run_batch import _routes

        self.state = state
        self.files = files
        self.endpoints = sorted(_routes())
        config = getattr(state.engine.engine, "config", None)
        self.in_flight = getattr(config, "max_num_seqs", None)  # lines in the engine at once
        self._jobs: dict[str, _Job] = {}

    def create(self, req: CreateBatchRequest) -> dict[str, Any]:
        if req.endpoint not in self.endpoints:
            raise bad_request(f"endpoint {req.endpoint!r} is not served in batches here; "
                              f"one of {', '.join(self.endpoints)}", "endpoint")
        if req.completion_window not in COMPLETION_WINDOWS:
            raise bad_request(f"completion_window {req.completion_window!r}: only \"24h\" is "
                              "supported", "completion_window")
        if req.metadata is not None and len(req.metadata) > 16:
            raise bad_request(f"metadata has {len(req.metadata)} keys; at most 16", "metadata")
        purpose = self.files.get(req.input_file_id, "input_file_id")["purpose"]
        if purpose != "batch":
            raise bad_request(f"input_file_id {req.input_file_id!r} has purpose {purpose!r}; a "
                              "batch reads a file uploaded with purpose \"batch\"", "input_file_id")
        bid = f"batch_{uuid.uuid4().hex}"
        obj: dict[str, Any] = {
            "id": bid, "object": "batch", "endpoint": req.endpoint, "errors": None,
            "input_file_id": req.input_file_id, "completion_window": req.completion_window,
            "status": "validating", "output_file_id": None, "error_file_id": None,
            "created_at": _now(), "in_progress_at": None, "expires_at": None,
            "finalizing_at": None, "completed_at": None, "failed_at": None, "expired_at": None,
            "cancelling_at": None, "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "metadata": req.metadata}
        job = _Job(obj, self.files.content(req.input_file_id, "input_file_id"))
        self._jobs[bid] = job
        job.task = asyncio.ensure_future(self._run(job))
        job.task.add_done_callback(lambda _: self._settle(job))
        return self._view(job)

    def get(self, bid: str) -> dict[str, Any]:
        return self._view(self._job(bid))

    def page(self, limit: int, after: str | None) -> dict[str, Any]:
        """Newest first; ``after`` the last id of the previous page."""
        ids = list(reversed(self._jobs))
        if after is not None:
            if after not in self._jobs:
                raise APIError(404, f"No batch found with id {after!r} (after)",
                               "invalid_request_error", "after")
            ids = ids[ids.index(after) + 1:]
        page = [self._view(self._jobs[i]) for i in ids[:limit]]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(ids) > limit}

    def cancel(self, bid: str) -> dict[str, Any]:
        job = self._job(bid)
        status = job.obj["status"]
        if status in ("validating", "in_progress"):
            job.obj["status"], job.obj["cancelling_at"] = "cancelling", _now()
            assert job.task is not None
            job.task.cancel()
        elif status not in ("cancelling", "cancelled"):
            raise APIError(409, f"batch {bid} is {status}: only a batch still running can be "
                           "cancelled", "invalid_request_error")
        return self._view(job)

    async def close(self) -> None:
        """At shutdown: cancel every running batch (their requests aborted) and wait."""
        tasks = [j.task for j in self._jobs.values() if j.task is not None and not j.task.done()]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=30)

    # ------------------------------------------------------------------------ running
    def _job(self, bid: str) -> _Job:
        job = self._jobs.get(bid)
        if job is None:
            raise APIError(404, f"No batch found with id {bid!r}", "invalid_request_error")
        return job

    @staticmethod
    def _view(job: _Job) -> dict[str, Any]:
        return {**job.obj, "request_counts": dict(job.obj["request_counts"])}

    async def _run(self, job: _Job) -> None:
        from flashpage.server.run_batch import _routes, parse_lines, start_lines

        obj = job.obj
        lines = parse_lines(job.data.splitlines(), _routes())
        job.data = b""
        for line in lines:  # every line of a batch goes to its endpoint (OpenAI's rule)
            if line.error is None and line.url != obj["endpoint"]:
                line.error = bad_request(f"line {line.lineno}: url {line.url!r} is not this "
                                         f"batch's endpoint {obj['endpoint']!r} (every line of a "
                                         "batch goes to its endpoint)", "url")
        if all(line.error is not None for line in lines):
            obj["status"], obj["failed_at"] = "failed", _now()
            obj["errors"] = _errors(
                [{"code": "invalid_request", "param": ln.error.param, "line": ln.lineno,
                  "message": ln.error.message} for ln in lines if ln.error is not None]
                or [{"code": "empty_file", "param": None, "line": None,
                     "message": f"the input file {obj['input_file_id']} holds no requests"}])
            return
        counts = obj["request_counts"]
        counts["total"] = len(lines)
        obj["status"], obj["in_progress_at"] = "in_progress", _now()
        tasks = start_lines(self.state, lines, limit=self.in_flight)

        def count(t: asyncio.Task[dict[str, Any]]) -> None:
            if not t.cancelled() and t.exception() is None:
                counts["failed" if t.result()["error"] is not None else "completed"] += 1

        for t in tasks:
            t.add_done_callback(count)
        try:
            await asyncio.gather(*tasks)  # (answer gives every line an output, never raises)
        except asyncio.CancelledError:  # POST .../cancel, or the server stopping
            for t in tasks:
                t.cancel()
            await asyncio.wait(tasks)  # their streams abort: KV blocks freed
            self._write(job, tasks, "cancelled")
            return
        except BaseException:
            for t in tasks:
                t.cancel()
            raise
        obj["status"], obj["finalizing_at"] = "finalizing", _now()
        self._write(job, tasks, "completed")

    def _write(self, job: _Job, tasks: list[asyncio.Task[dict[str, Any]]], status: str) -> None:
        """The finished lines' outputs as the output and error files; then ``status``."""
        obj = job.obj
        good: list[str] = []
        bad: list[str] = []
        for t in tasks:
            if t.done() and not t.cancelled():
                out = t.result()
                (good if out["error"] is None else bad).append(json.dumps(out, ensure_ascii=False))
        try:
            for kind, rows, key in (("output", good, "output_file_id"),
                                    ("error", bad, "error_file_id")):
                if rows:
                    data = ("\n".join(rows) + "\n").encode()
                    obj[key] = self.files.add(data, f"{obj['id']}_{kind}.jsonl", "batch_output",
                                              check_limit=False)["id"]
        except OSError as e:  # --files-dir cannot be written
            logger.error("batch %s: its results cannot be stored: %s", obj["id"], e)
            obj["status"], obj["failed_at"] = "failed", _now()
            obj["errors"] = _errors([{"code": "server_error", "param": None, "line": None,
                                      "message": f"the results cannot be stored: {e}"}])
            return
        obj["status"], obj[f"{status}_at"] = status, _now()

    def _settle(self, job: _Job) -> None:
        """The task ended: a batch it left unfinished (cancelled before it began, or a bug)
        gets its final status."""
        obj, task = job.obj, job.task
        assert task is not None
        job.data = b""
        if obj["status"] in TERMINAL:
            return
        if task.cancelled():
            obj["status"], obj["cancelled_at"] = "cancelled", _now()
            return
        if task.exception() is not None:
            logger.error("batch %s failed", obj["id"], exc_info=task.exception())
        obj["status"], obj["failed_at"] = "failed", _now()
        obj["errors"] = _errors([{"code": "server_error", "param": None, "line": None,
                                  "message": "internal server error"}])


# ---------------------------------------------------------------------------- routes
def add_batch_routes(app: FastAPI, state: ServerState, files_dir: str | None = None) -> Batches:
    """The Files and Batches routes on ``app`` (each needs the API key when one is set)."""
    from flashpage.server.api_server import _check_key, _read_body, _read_json, validate_body

    files = FileStore(files_dir)
    batches = Batches(state, files)

    @app.post("/v1/files")
    async def upload_file(request: Request) -> Response:
        _check_key(state, request)
        body = await _read_body(state, request, files.limit + FORM_OVERHEAD,
                                " (FLASHPAGE_FILES_MAX_BYTES, plus the form's 64 KiB)")
        form = parse_form(request.headers.get("content-type", ""), body)
        if "purpose" not in form:
            raise bad_request("purpose is required (\"batch\")", "purpose")
        purpose = form["purpose"][1].decode("utf-8", "replace").strip()
        if purpose not in UPLOAD_PURPOSES:
            raise bad_request(f"purpose {purpose!r} is not supported here: this server keeps "
                              "files for the Batches API only (purpose \"batch\")", "purpose")
        if "file" not in form:
            raise bad_request("file is required (the form's file field)", "file")
        filename, data = form["file"]
        return JSONResponse(files.add(data, filename or "file", purpose))

    @app.get("/v1/files")
    async def list_files(request: Request) -> Response:
        _check_key(state, request)
        q = request.query_params
        order = q.get("order", "desc")
        if order not in ("asc", "desc"):
            raise bad_request(f"order must be \"asc\" or \"desc\", got {order!r}", "order")
        return JSONResponse(files.page(q.get("purpose"), _int_param(request, "limit", 10000, 10000),
                                       q.get("after"), order))

    @app.get("/v1/files/{file_id}")
    async def get_file(request: Request, file_id: str) -> Response:
        _check_key(state, request)
        return JSONResponse(files.get(file_id))

    @app.get("/v1/files/{file_id}/content")
    async def file_content(request: Request, file_id: str) -> Response:
        _check_key(state, request)
        return Response(files.content(file_id), media_type="application/octet-stream")

    @app.delete("/v1/files/{file_id}")
    async def delete_file(request: Request, file_id: str) -> Response:
        _check_key(state, request)
        return JSONResponse(files.delete(file_id))

    @app.post("/v1/batches")
    async def create_batch(request: Request) -> Response:
        _check_key(state, request)
        req = validate_body(state, await _read_json(state, request), CreateBatchRequest)
        return JSONResponse(batches.create(req))

    @app.get("/v1/batches")
    async def list_batches(request: Request) -> Response:
        _check_key(state, request)
        return JSONResponse(batches.page(_int_param(request, "limit", 20, 100),
                                         request.query_params.get("after")))

    @app.get("/v1/batches/{batch_id}")
    async def get_batch(request: Request, batch_id: str) -> Response:
        _check_key(state, request)
        return JSONResponse(batches.get(batch_id))

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(request: Request, batch_id: str) -> Response:
        _check_key(state, request)
        return JSONResponse(batches.cancel(batch_id))

    return batches


def _int_param(request: Request, name: str, default: int, most: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if not raw.isdigit() or not 1 <= int(raw) <= most:
        raise bad_request(f"{name} must be an integer from 1 to {most}, got {raw!r}", name)
    return int(raw)
