"""The Azure Blob requests the library makes itself: blocks (Put Block), block lists (Put Block
List), whole blobs, ranged reads, and discarding a killed save's uncommitted blocks.

Used only when the fsspec filesystem is adlfs (``stores/azure.py`` is the store built on them; the
reader's ranged reads use them too). The requests go through adlfs's own async
``BlobServiceClient`` (so the account, credential, connection string or SAS, and endpoint are
the user's), with the SDK's retries off for them (``retry_total=0``: its default waits 15 s and
more between attempts): each one is retried by this library's :class:`~.retry.RetryPolicy`
alone, and fails with a message naming the operation and the blob.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from fsspec import AbstractFileSystem
from fsspec.asyn import sync

from ..plan.azureplan import block_id
from .partsclient import PartRef, PartsClient, quietly
from .retry import ErrorRules, RetryPolicy

__all__ = ["AZURE_ERRORS", "BLOCK_BYTES", "Azure", "BlockWriter"]


def _azure_code(exc: BaseException) -> str:
    code = getattr(exc, "error_code", None)  # azure.core's HttpResponseError
    return str(getattr(code, "value", code) or "")


def _azure_status(exc: BaseException) -> int | None:
    status = getattr(exc, "status_code", None)
    return status if isinstance(status, int) and not isinstance(status, bool) else None


# How Azure Blob's errors read: azure.core's ``HttpResponseError`` (status and error code), its
# connection errors by class name.
AZURE_ERRORS = ErrorRules(
    missing_codes=frozenset({"BlobNotFound", "ContainerNotFound", "ResourceNotFound"}),
    denied_codes=frozenset(
        {"AuthorizationFailure", "AuthenticationFailed", "AuthorizationPermissionMismatch"}
    ),
    transient_classes=frozenset(
        {
            "ServiceRequestError",
            "ServiceResponseError",
            "ServiceRequestTimeoutError",
            "ServiceResponseTimeoutError",
            "IncompleteReadError",
        }
    ),
    code=_azure_code,
    status=_azure_status,
)

# A staged stream's blocks: one in memory while it fills, then staged.
BLOCK_BYTES = 8 << 20
# The SDK's own retries, off for every request made here (ours run instead).
_NO_SDK_RETRY = {"retry_total": 0}


class Azure(PartsClient):
    """Retried Azure Blob requests on an adlfs filesystem's client; paths are ``container/blob``."""

    errors = AZURE_ERRORS

    def __init__(self, fs: AbstractFileSystem, retry: RetryPolicy) -> None:
        self.fs, self.retry = fs, retry

    def url(self, path: str) -> str:
        return f"az://{path}"

    def _blob(self, path: str) -> Any:
        container, _, blob = path.partition("/")
        return self.fs.service_client.get_blob_client(container, blob)

    def _call(self, operation: str, path: str, method: str, *args: Any, **kwargs: Any) -> Any:
        async def once() -> Any:
            async with self._blob(path) as client:
                return await getattr(client, method)(*args, **kwargs, **_NO_SDK_RETRY)

        return self.retry.call(
            lambda: sync(self.fs.loop, once),
            operation=operation,
            url=self.url(path),
            errors=self.errors,
        )

    # -- blobs and blocks -------------------------------------------------------------------------

    def put(self, path: str, data: bytes | bytearray | memoryview) -> dict[str, Any]:
        """One blob, whole (a single Put Blob; above ``BLOCK_BYTES`` staged blocks and one
        commit)."""
        if len(data) > BLOCK_BYTES:
            with BlockWriter(self, path) as out:
                out.write(data)
            return {}
        return self._call(
            "Put Blob",
            path,
            "upload_blob",
            bytes(data),
            overwrite=True,
            length=len(data),
            max_concurrency=1,
        )

    def stage(self, path: str, block: str, data: bytes | bytearray | memoryview) -> None:
        self._call("Put Block", path, "stage_block", block, _body(data), length=len(data))

    def commit(self, path: str, blocks: Sequence[str]) -> None:
        """Make ``path`` the blob of ``blocks``, in order (uncommitted blocks not named are
        dropped)."""
        from azure.storage.blob import BlobBlock

        self._call(
            f"Put Block List ({len(blocks)} blocks)",
            path,
            "commit_block_list",
            [BlobBlock(block_id=b) for b in blocks],
        )

    def upload_part(
        self, root: str, save_id: str, part: PartRef, data: bytes | bytearray
    ) -> dict[str, Any]:
        """Part ``part.number`` as a block of the final blob, named by its file and first byte."""
        bid = block_id(save_id, part.file, part.start)
        self.stage(f"{root}/{part.name}", bid, data)
        return {"PartNumber": part.number, "ETag": bid}

    def staged_writer(self, path: str, size: int) -> BlockWriter:
        return BlockWriter(self, path)

    def discard(self, path: str) -> None:
        """Drop every uncommitted block of ``path`` and the blob: commit an empty list (which
        drops them), then delete the blob that made. For blobs this save (or a killed one) was
        making, never for a committed checkpoint's."""
        self.commit(path, [])
        self.delete(path)

    def delete(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._call("Delete Blob", path, "delete_blob")

    def uncommitted(self, prefix: str) -> list[str]:
        """Blobs under ``prefix`` (``container/path/``) that hold only uncommitted blocks (a
        killed save's), which a plain listing does not show. The emulator Azurite lists none."""
        container, _, inner = prefix.partition("/")

        async def listing() -> tuple[set[str], set[str]]:
            async with self.fs.service_client.get_container_client(container) as cc:
                every = {
                    b.name
                    async for b in cc.list_blobs(
                        name_starts_with=inner, include=["uncommittedblobs"], **_NO_SDK_RETRY
                    )
                }
                committed = {
                    b.name async for b in cc.list_blobs(name_starts_with=inner, **_NO_SDK_RETRY)
                }
            return every, committed

        try:
            every, committed = self.retry.call(
                lambda: sync(self.fs.loop, listing),
                operation="list uncommitted blobs under",
                url=self.url(prefix),
                errors=self.errors,
            )
        except FileNotFoundError:
            return []
        return sorted(f"{container}/{name}" for name in every - committed)

    # -- reads ----------------------------------------------------------------------------------

    async def read_span(self, path: str, start: int, end: int) -> bytes:
        async def once() -> bytes:
            async with self._blob(path) as client:
                stream = await client.download_blob(
                    offset=start, length=end - start, max_concurrency=1, **_NO_SDK_RETRY
                )
                return await stream.readall()

        return await self.retry.acall(
            once,
            operation=f"GET bytes {start}-{end - 1} of",
            url=self.url(path),
            errors=self.errors,
        )


def _body(data: bytes | bytearray | memoryview) -> bytes | bytearray:
    """A Put Block body the SDK sends as it is: the caller's bytes or bytearray, not a copy (a
    rank's parts are filled buffers nobody touches again); a view is copied once. (Put Blob
    takes no bytearray: the SDK's upload_blob fails on one.)"""
    return data if isinstance(data, (bytes, bytearray)) else bytes(data)


class BlockWriter:
    """A write-only stream to one block blob: blocks of ``BLOCK_BYTES`` staged as they fill (one
    in memory), committed in one block list by a clean exit; an error discards the blocks."""

    def __init__(self, azure: Azure, path: str, block: int = BLOCK_BYTES) -> None:
        self.azure, self.path, self.block = azure, path, block
        self._buf = bytearray()
        self._blocks: list[str] = []

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        self._buf += view
        while len(self._buf) >= self.block:
            self._stage(self.block)
        return len(view)

    def _stage(self, n: int) -> None:
        # Fixed-length ids, numbered: a blob's block ids must all be of one length.
        bid = block_id("staged", 0, len(self._blocks))
        self.azure.stage(self.path, bid, self._buf[:n])
        self._blocks.append(bid)
        del self._buf[:n]

    def close(self) -> None:
        if not self._blocks:
            self.azure.put(self.path, self._buf)
            return
        if self._buf:
            self._stage(len(self._buf))
        self.azure.commit(self.path, self._blocks)

    def __enter__(self) -> BlockWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        elif self._blocks:
            quietly(lambda: self.azure.discard(self.path), self.azure.url(self.path))
