"""OpenAI's Files API on the server, for the Batches API (server/batches.py): the files a
batch reads and the results it writes.

``FileStore`` keeps each file's bytes in memory, or with ``--files-dir`` in that folder
(``<id>`` and its object as ``<id>.json``, so the files outlive a restart), all of them
together held to ``FLASHPAGE_FILES_MAX_BYTES`` (envs.py): an upload past it is a 413 naming
the limit. A batch's results are always kept (the work is done) and count toward it.

``parse_form`` reads a ``multipart/form-data`` body (what ``POST /v1/files`` takes) with the
standard library, so the serve extra needs no python-multipart.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from email.message import Message
from pathlib import Path
from typing import Any

from flashpage import envs
from flashpage.server.protocol import APIError, bad_request

logger = logging.getLogger("flashpage.server")

UPLOAD_PURPOSES = ("batch",)  # what POST /v1/files takes; results are "batch_output"


def parse_form(content_type: str, body: bytes) -> dict[str, tuple[str | None, bytes]]:
    """A multipart/form-data body's fields: name -> (its filename, if a file; its bytes).
    A 400 saying what is wrong for anything else."""
    header = Message()
    header["content-type"] = content_type
    boundary = header.get_param("boundary")
    if header.get_content_type() != "multipart/form-data" or not isinstance(boundary, str) \
            or not boundary:
        raise bad_request("POST /v1/files takes a multipart/form-data body (fields file and "
                          f"purpose), not {content_type or 'a body without a Content-Type'!r}")
    # each part ends at CRLF "--" boundary; the first delimiter may open the body
    chunks = (b"\r\n" + body).split(b"\r\n--" + boundary.encode("latin-1"))
    if len(chunks) < 3 or not chunks[-1].startswith(b"--"):
        raise bad_request("malformed multipart body: its closing boundary is missing")
    fields: dict[str, tuple[str | None, bytes]] = {}
    for chunk in chunks[1:-1]:
        head_end = chunk.find(b"\r\n\r\n")
        if head_end < 0:
            raise bad_request("malformed multipart body: a part without a blank line after its "
                              "headers")
        part = Message()
        for raw in chunk[:head_end].decode("utf-8", "replace").split("\r\n")[1:]:
            name, sep, value = raw.partition(":")
            if sep:
                part[name.strip()] = value.strip()
        field = part.get_param("name", header="content-disposition")
        if not isinstance(field, str):
            raise bad_request("malformed multipart body: a part without a Content-Disposition "
                              "name")
        fields.setdefault(field, (part.get_filename(), chunk[head_end + 4:]))
    return fields


class FileStore:
    """The server's files: id -> OpenAI's file object, and its bytes (memory or ``folder``)."""

    def __init__(self, folder: str | None = None) -> None:
        envs.files_max_bytes()  # a bad value stops the start
        self.folder = Path(folder) if folder is not None else None
        self._objects: dict[str, dict[str, Any]] = {}
        self._data: dict[str, bytes] = {}
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
            found = []
            for meta in self.folder.glob("file-*.json"):
                try:
                    obj = json.loads(meta.read_text())
                    if (self.folder / obj["id"]).is_file():
                        found.append((obj["created_at"], meta.stat().st_mtime_ns, obj))
                except (OSError, ValueError, KeyError, TypeError):
                    logger.warning("--files-dir: skipping %s (not a file object)", meta)
            for *_, obj in sorted(found, key=lambda f: f[:2]):  # the lists' order: creation
                self._objects[obj["id"]] = obj

    @property
    def limit(self) -> int:
        return envs.files_max_bytes()

    def used(self) -> int:
        return sum(o["bytes"] for o in self._objects.values())

    def add(self, data: bytes, filename: str, purpose: str, *, check_limit: bool = True) -> dict[str, Any]:
        """Keep ``data``; its file object. ``check_limit``: a 413 if it would not fit."""
        if check_limit:
            used, limit = self.used(), self.limit
            if used + len(data) > limit:
                raise APIError(413, f"the file of {len(data)} bytes does not fit: the server keeps "
                               f"at most {limit} bytes of files (FLASHPAGE_FILES_MAX_BYTES) and "
                               f"holds {used}; delete files to make room", "invalid_request_error",
                               "file")
        fid = f"file-{uuid.uuid4().hex[:24]}"
        obj = {"id": fid, "object": "file", "bytes": len(data), "created_at": int(time.time()),
               "filename": filename, "purpose": purpose, "status": "processed",
               "expires_at": None, "status_details": None}
        if self.folder is not None:
            (self.folder / fid).write_bytes(data)
            (self.folder / f"{fid}.json").write_text(json.dumps(obj))
        else:
            self._data[fid] = data
        self._objects[fid] = obj
        return obj

    def get(self, fid: str, param: str | None = None) -> dict[str, Any]:
        obj = self._objects.get(fid)
        if obj is None:
            raise APIError(404, f"No such File object: {fid!r}", "invalid_request_error", param)
        return obj

    def content(self, fid: str, param: str | None = None) -> bytes:
        self.get(fid, param)
        if self.folder is None:
            return self._data[fid]
        try:
            return (self.folder / fid).read_bytes()
        except OSError as e:
            raise APIError(500, f"file {fid} cannot be read from --files-dir: {e}",
                           "server_error") from None

    def delete(self, fid: str) -> dict[str, Any]:
        self.get(fid)
        del self._objects[fid]
        self._data.pop(fid, None)
        if self.folder is not None:
            for path in (self.folder / fid, self.folder / f"{fid}.json"):
                path.unlink(missing_ok=True)
        return {"id": fid, "object": "file", "deleted": True}

    def page(self, purpose: str | None, limit: int, after: str | None,
             order: str) -> dict[str, Any]:
        """OpenAI's list: by created_at (``order`` "desc": newest first), ``after`` an id of
        the previous page, at most ``limit``."""
        objs = [o for o in self._objects.values() if purpose is None or o["purpose"] == purpose]
        if order == "desc":  # (the dict's order is the creation order)
            objs.reverse()
        if after is not None:
            ids = [o["id"] for o in objs]
            if after not in ids:
                raise APIError(404, f"No such File object: {after!r} (after)",
                               "invalid_request_error", "after")
            objs = objs[ids.index(after) + 1:]
        page = objs[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(objs) > limit}
