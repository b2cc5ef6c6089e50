"""The GCS requests the library makes itself: object uploads (simple, or resumable in chunks),
composes with generation preconditions, deletes, ranged GETs.

Used only when the fsspec filesystem is gcsfs (``stores/gcs.py`` is the store built on them; the
reader's ranged GETs use them too). The requests go through gcsfs's own HTTP session and
credentials (so ``token``, ``project``, ``endpoint_url``, ``session_kwargs``... are the user's),
without gcsfs's retry loop (six attempts, sleeps up to 32 s, beneath which no policy can be
set): each request is retried by this library's :class:`~.retry.RetryPolicy` alone, and
fails with a message naming the operation and the object.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from typing import Any
from urllib.parse import quote

from fsspec import AbstractFileSystem
from fsspec.asyn import sync

from ..io.parallel import parallel_map
from ..plan.gcsplan import part_name
from .base import STAGING_DIR
from .partsclient import PartRef, PartsClient, quietly
from .retry import ErrorRules, RetryPolicy, StoreError

__all__ = ["CHUNK_BYTES", "GCS", "GCS_ERRORS", "RESUMABLE_ABOVE", "ResumableWriter"]


# How GCS's errors read: an HTTP status (``StoreError``, made from gcsfs's ``HttpError`` by
# ``GCS._once``), gcsfs's checksum mismatch of a body cut short.
GCS_ERRORS = ErrorRules(transient_classes=frozenset({"ChecksumError"}))

# Objects above this go up as resumable uploads, in chunks: a failed chunk is sent again alone,
# not the whole object, and a staged stream holds one chunk in memory. Chunks are multiples of
# 256 KiB, as GCS requires of every chunk but the last.
RESUMABLE_ABOVE = 8 << 20
CHUNK_BYTES = 8 << 20


def _key(path: str) -> tuple[str, str]:
    bucket, _, key = path.partition("/")
    return bucket, key


class GCS(PartsClient):
    """Retried GCS JSON-API requests on a gcsfs filesystem's session; paths are ``bucket/key``."""

    errors = GCS_ERRORS

    def __init__(self, fs: AbstractFileSystem, retry: RetryPolicy) -> None:
        self.fs, self.retry = fs, retry

    def url(self, path: str) -> str:
        return f"gs://{path}"

    async def _once(
        self, method: str, path: str, *args: Any, **kwargs: Any
    ) -> tuple[int, Any, bytes]:
        # gcsfs's request without its retry decorator: this library's policy is the only one.
        request = type(self.fs)._request.__wrapped__
        try:
            status, headers, _, contents = await request(self.fs, method, path, *args, **kwargs)
        except OSError as exc:
            # gcsfs turns a 403 into a bare OSError("Forbidden: ..."), a 412 into FileExistsError.
            if type(exc) is OSError and str(exc).startswith("Forbidden"):
                raise PermissionError(str(exc)) from exc
            raise
        except Exception as exc:  # gcsfs.retry.HttpError: keep its status for the retry policy
            code = getattr(exc, "code", None)
            if isinstance(code, int) and not isinstance(exc, StoreError):
                raise StoreError(str(exc), status=code) from exc
            raise
        return status, headers, contents

    def _call(
        self, operation: str, path: str, method: str, target: str, *args: Any, **kwargs: Any
    ) -> tuple[int, Any, bytes]:
        return self.retry.call(
            lambda: sync(self.fs.loop, self._once, method, target, *args, **kwargs),
            operation=operation,
            url=self.url(path),
            errors=self.errors,
        )

    def _upload_url(self, bucket: str) -> str:
        return f"{self.fs._location}/upload/storage/v1/b/{quote(bucket, safe='')}/o"

    # -- objects --------------------------------------------------------------------------------

    def put(self, path: str, data: bytes | bytearray | memoryview) -> dict[str, Any]:
        """One object, whole: a single media upload, or resumable in chunks above
        ``RESUMABLE_ABOVE``."""
        if len(data) > RESUMABLE_ABOVE:
            with ResumableWriter(self, path) as out:
                out.write(data)
            assert out.metadata is not None
            return out.metadata
        bucket, key = _key(path)
        _, _, body = self._call(
            "upload",
            path,
            "POST",
            self._upload_url(bucket),
            uploadType="media",
            name=key,
            data=bytes(data) if isinstance(data, memoryview) else data,
            headers={"Content-Type": "application/octet-stream"},
        )
        return json.loads(body)

    def upload_part(
        self, root: str, save_id: str, part: PartRef, data: bytes | bytearray
    ) -> dict[str, Any]:
        """Part ``part.number`` as an object under the save's staging folder; its generation is
        what the compose will require of it, its CRC32C (as GCS computed it) what the composed
        file is checked against."""
        meta = self.put(part_name(f"{root}/{STAGING_DIR}", save_id, part.name, part.number), data)
        entry = {"PartNumber": part.number, "ETag": str(meta["generation"])}
        if meta.get("crc32c"):
            entry["CRC32C"] = str(meta["crc32c"])
        return entry

    def staged_writer(self, path: str, size: int) -> ResumableWriter:
        return ResumableWriter(self, path)

    def compose(self, target: str, sources: Sequence[tuple[str, str | None]]) -> dict[str, Any]:
        """Compose ``sources`` (``(path, generation or None)``, in order, all in the target's
        bucket) into ``target``. A generation is required of its source: a part replaced since it
        was
        uploaded (another save's) fails the compose (412) instead of entering the file."""
        bucket, key = _key(target)
        objects = []
        for path, generation in sources:
            b, k = _key(path)
            if b != bucket:
                raise ValueError(
                    f"cannot compose {self.url(path)} into {self.url(target)}: GCS composes "
                    "objects of one bucket only"
                )
            entry: dict[str, Any] = {"name": k}
            if generation is not None:
                entry["objectPreconditions"] = {"ifGenerationMatch": int(generation)}
            objects.append(entry)
        body = {
            "kind": "storage#composeRequest",
            "sourceObjects": objects,
            "destination": {"contentType": "application/octet-stream"},
        }
        _, _, out = self._call(
            f"compose {len(objects)} objects into",
            target,
            "POST",
            "b/{}/o/{}/compose",
            bucket,
            key,
            json=body,
        )
        return json.loads(out)

    def delete(self, path: str) -> None:
        bucket, key = _key(path)
        with contextlib.suppress(FileNotFoundError):
            self._call("delete", path, "DELETE", "b/{}/o/{}", bucket, key)

    def delete_many(self, paths: Sequence[str], threads: int = 16) -> None:
        parallel_map(self.delete, list(paths), threads)

    # -- reads ----------------------------------------------------------------------------------

    async def read_span(self, path: str, start: int, end: int) -> bytes:
        bucket, key = _key(path)
        target = (
            f"{self.fs._location}/download/storage/v1/b/{quote(bucket, safe='')}"
            f"/o/{quote(key, safe='')}"
        )
        _, _, data = await self.retry.acall(
            lambda: self._once(
                "GET", target, alt="media", headers={"Range": f"bytes={start}-{end - 1}"}
            ),
            operation=f"GET bytes {start}-{end - 1} of",
            url=self.url(path),
            errors=self.errors,
        )
        return data


class ResumableWriter:
    """A write-only stream to one GCS object: a resumable upload, one chunk of ``CHUNK_BYTES`` in
    memory, each chunk retried on its own. An object no bigger than one chunk is a single media
    upload. A clean exit finalizes the object (``metadata``: its resource); an error leaves none
    (an unfinished resumable upload is no object, and GCS drops it after a week)."""

    def __init__(self, gcs: GCS, path: str, chunk: int = CHUNK_BYTES) -> None:
        if chunk % (256 << 10):
            raise ValueError(f"chunk={chunk}: GCS wants resumable chunks in multiples of 256 KiB")
        self.gcs, self.path, self.chunk = gcs, path, chunk
        self._buf = bytearray()
        self._session: str | None = None
        self._sent = 0
        self.metadata: dict[str, Any] | None = None

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        self._buf += view
        while (
            len(self._buf) > self.chunk
        ):  # keep the last bytes back: the final chunk says the size
            self._send(self.chunk, final=False)
        return len(view)

    def _start(self) -> str:
        bucket, key = _key(self.path)
        _, headers, _ = self.gcs._call(
            "start a resumable upload of",
            self.path,
            "POST",
            self.gcs._upload_url(bucket),
            uploadType="resumable",
            name=key,
            json={"name": key, "contentType": "application/octet-stream"},
            headers={"X-Upload-Content-Type": "application/octet-stream"},
        )
        location = headers["Location"]
        return location[0] if isinstance(location, list) else location

    def _send(self, n: int, *, final: bool) -> None:
        if self._session is None:
            self._session = self._start()
        data = bytes(self._buf[:n])
        total = str(self._sent + n) if final else "*"
        first, last = self._sent, self._sent + n - 1
        content_range = f"bytes {first}-{last}/{total}" if n else f"bytes */{total}"
        status, headers, body = self.gcs._call(
            f"upload bytes {first}-{last} of",
            self.path,
            "PUT",
            self._session,
            data=data,
            headers={"Content-Range": content_range, "Content-Type": "application/octet-stream"},
        )
        if not final and status == 308 and "Range" in headers:
            persisted = int(headers["Range"].split("-")[1]) + 1
            if persisted != self._sent + n:  # the server kept fewer bytes: send the rest again
                kept = persisted - self._sent
                del self._buf[:kept]
                self._sent = persisted
                return
        del self._buf[:n]
        self._sent += n
        if final:
            self.metadata = json.loads(body) if body else {}

    def close(self) -> None:
        if self._session is None:
            self.metadata = (
                self.gcs.put(self.path, self._buf) if len(self._buf) <= self.chunk else None
            )
            if self.metadata is not None:
                return
        self._send(len(self._buf), final=True)

    def __enter__(self) -> ResumableWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        elif self._session is not None:
            session = self._session
            # Cancelling the session frees it at once (GCS answers 499); otherwise it expires.
            quietly(
                lambda: sync(self.gcs.fs.loop, self.gcs._once, "DELETE", session),
                self.gcs.url(self.path),
            )
