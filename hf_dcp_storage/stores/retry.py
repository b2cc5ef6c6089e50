"""Retries for remote operations: exponential backoff with full jitter, bounded in attempts and
time, each failure judged by the rules of the store that raised it.

A remote request fails in one of two ways. Transient failures (503 SlowDown, 500, a reset
connection, a truncated body, a timeout) go away if the same idempotent request is sent again
a little later; they are retried. Permanent ones (403 AccessDenied, a missing bucket or object,
a bad request) never will; retrying them only delays the error, so they fail at once. Either
way the error names the operation and the URL.

Which is which depends on the store's SDK: botocore's error codes, an HTTP status on GCS and
Azure, the class names of its connection errors. Each store states its own :class:`ErrorRules`
beside its requests (``S3_ERRORS`` in ``stores/s3_requests.py``, ...; ``Store.errors``); this
module knows only what every store shares (Python's and aiohttp's connection errors, fsspec's
timeout), so nothing here names a backend.

Every request this library retries is idempotent (a ranged GET, a PUT of a whole object or
part, a part copy, completing or aborting an upload), so sending it twice is safe.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

__all__ = [
    "FSSPEC_ERRORS",
    "ErrorRules",
    "RemoteOperationError",
    "RetryPolicy",
    "StoreError",
    "policy_or_default",
]

T = TypeVar("T")

# Connection-level failures every store's requests can end in, by class name so that optional
# libraries need not be imported here: aiohttp's (under s3fs, gcsfs and adlfs alike), fsspec's
# timeout, the standard library's truncated body.
_COMMON_TRANSIENT_CLASSES = frozenset(
    {
        "ClientPayloadError",
        "ServerDisconnectedError",
        "ClientConnectionError",
        "ClientOSError",
        "ServerTimeoutError",
        "ContentLengthError",
        "TransferEncodingError",
        "FSTimeoutError",
        "IncompleteRead",
        "ProxyError",
    }
)
# HTTP statuses that mean "try again later": request timeout, too many requests (and any 5xx
# but 501).
_TRANSIENT_STATUSES = frozenset({408, 429})
# Python's own permanent failures: what is missing, refused or in the way stays so.
_PERMANENT_OS_ERRORS = (
    FileNotFoundError,
    PermissionError,
    FileExistsError,
    IsADirectoryError,
    NotADirectoryError,
)


class RemoteOperationError(OSError):
    """A remote operation that failed for good: permanently, or after every allowed retry."""


class StoreError(Exception):
    """A store's error answer that carries only an HTTP status (GCS through gcsfs's session):
    transient for 5xx, 408 and 429, permanent otherwise."""

    def __init__(self, message: str, *, status: int) -> None:
        super().__init__(message)
        self.status = status


def _no_code(exc: BaseException) -> str:
    return ""


def _store_error_status(exc: BaseException) -> int | None:
    return exc.status if isinstance(exc, StoreError) else None


@dataclass(frozen=True)
class ErrorRules:
    """How one store's errors read: which are worth sending again, and which permanent ones say
    that something is missing or refused (raised as ``FileNotFoundError`` / ``PermissionError``).

    ``code`` and ``status`` read the store's error code and HTTP status off an exception (``""``
    and ``None`` where it carries none). A failure is judged in this order: a code in
    ``unsupported_codes`` or status 501 is permanent (the store lacks the feature); a code in
    ``transient_codes`` is transient; any other status is transient when 5xx, 408 or 429;
    Python's missing / refused / in-the-way ``OSError`` s are permanent; a bare ``OSError`` that
    translates another error (s3fs turns a 500 into ``OSError(EREMOTEIO)``) is judged by that
    cause; connection resets and timeouts, and errors whose class (or a base's) is named in
    ``transient_classes`` or is a common connection error, are transient; the rest permanent.
    """

    transient_codes: frozenset[str] = frozenset()
    unsupported_codes: frozenset[str] = frozenset()
    missing_codes: frozenset[str] = frozenset()
    denied_codes: frozenset[str] = frozenset()
    transient_classes: frozenset[str] = frozenset()
    code: Callable[[BaseException], str] = _no_code
    status: Callable[[BaseException], int | None] = _store_error_status

    def transient(self, exc: BaseException) -> bool:
        """Whether sending the same request again may succeed. A ``RemoteOperationError`` is
        never transient: its retries have already run out."""
        if isinstance(exc, RemoteOperationError):
            return False
        code, status = self.code(exc), self.status(exc)
        if code in self.unsupported_codes or status == 501:
            return False  # the store lacks the feature; asking again will not add it
        if code in self.transient_codes:
            return True
        if status is not None:
            return status >= 500 or status in _TRANSIENT_STATUSES
        if isinstance(exc, _PERMANENT_OS_ERRORS):
            return False
        cause = exc.__cause__
        if type(exc) is OSError and cause is not None and cause is not exc:
            return self.transient(cause)
        if isinstance(exc, (ConnectionError, TimeoutError)):
            return True
        names = self.transient_classes | _COMMON_TRANSIENT_CLASSES
        return any(cls.__name__ in names for cls in type(exc).__mro__)

    def permanent(self, exc: BaseException, operation: str, url: str) -> OSError:
        """The error a permanent failure is raised as, naming ``operation`` and ``url``."""
        message = (
            f"{operation} {url} failed: {_describe(exc)} (not retried: the error is permanent)"
        )
        code, status = self.code(exc), self.status(exc)
        if isinstance(exc, FileNotFoundError) or code in self.missing_codes or status == 404:
            return FileNotFoundError(message)
        if isinstance(exc, PermissionError) or code in self.denied_codes or status in (401, 403):
            return PermissionError(message)
        return RemoteOperationError(message)


# The rules of the stores that go through fsspec alone (local disk, memory://, any other
# backend): Python's errors, the common connection errors, a ``StoreError``'s status.
FSSPEC_ERRORS = ErrorRules()


@dataclass(frozen=True)
class RetryPolicy:
    """How transient failures of one remote request are retried.

    Attempt ``k`` (from 0) that fails transiently is followed by a sleep drawn uniformly from
    ``[0, min(max_delay, base_delay * 2**k)]`` ("full jitter": ranks that failed together do
    not retry together). A request stops being retried after ``max_attempts`` attempts or once
    ``deadline`` seconds have passed since its first attempt, whichever comes first.

    Storage clients may retry beneath this (botocore does, per its ``retries`` config); this
    policy bounds what this library adds on top.

    Raises:
        ValueError: a non-positive attempt count or a negative time.
    """

    max_attempts: int = 6
    base_delay: float = 0.1
    max_delay: float = 5.0
    deadline: float = 120.0

    def __post_init__(self) -> None:
        if not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise ValueError(
                f"RetryPolicy(max_attempts={self.max_attempts!r}) must be an int >= 1 (1 = no "
                "retries)"
            )
        for name in ("base_delay", "max_delay", "deadline"):
            if getattr(self, name) < 0:
                raise ValueError(
                    f"RetryPolicy({name}={getattr(self, name)!r}) must be >= 0 seconds"
                )

    def call(
        self,
        fn: Callable[[], T],
        *,
        operation: str,
        url: str,
        errors: ErrorRules,
        sleep: Callable[[float], None] = time.sleep,
        keep_permanent: bool = False,
    ) -> T:
        """``fn()``, retried on the failures ``errors`` (the rules of the store it asks) calls
        transient.

        ``keep_permanent``: re-raise a permanent failure as it is, for an ``fn`` whose own errors
        already say what is wrong (a malformed file: ``ValueError``).

        Raises:
            FileNotFoundError, PermissionError: permanent failures of those kinds, message
                naming ``operation`` and ``url``.
            RemoteOperationError: any other permanent failure, or a transient one that outlasted
                the attempts or the deadline; the last error is its ``__cause__``.
        """
        started = time.monotonic()
        attempt = 0
        while True:
            try:
                return fn()
            except Exception as exc:
                if keep_permanent and not errors.transient(exc):
                    raise
                attempt += 1
                sleep(self._delay_or_raise(exc, errors, attempt, started, operation, url))

    async def acall(
        self, fn: Callable[[], Awaitable[T]], *, operation: str, url: str, errors: ErrorRules
    ) -> T:
        """``await fn()``, retried like :meth:`call`; for requests issued concurrently on one
        event loop."""
        started = time.monotonic()
        attempt = 0
        while True:
            try:
                return await fn()
            except Exception as exc:  # noqa: BLE001 - classified, then re-raised with context
                attempt += 1
                delay = self._delay_or_raise(exc, errors, attempt, started, operation, url)
                await asyncio.sleep(delay)

    def _delay_or_raise(
        self,
        exc: Exception,
        errors: ErrorRules,
        attempt: int,
        started: float,
        operation: str,
        url: str,
    ) -> float:
        """The sleep before the next attempt, or raise if ``exc`` ends the retries."""
        if not errors.transient(exc):
            raise errors.permanent(exc, operation, url) from exc
        elapsed = time.monotonic() - started
        delay = random.uniform(0.0, min(self.max_delay, self.base_delay * 2 ** (attempt - 1)))
        if attempt >= self.max_attempts or elapsed + delay > self.deadline:
            raise RemoteOperationError(
                f"{operation} {url} failed after {attempt} attempt(s) over {elapsed:.1f} s: "
                f"{_describe(exc)}; raise RetryPolicy(max_attempts=..., deadline=...) if the "
                "store is only slow"
            ) from exc
        return delay


def _describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if type(exc).__name__ not in text else text


def policy_or_default(retry: RetryPolicy | None) -> RetryPolicy:
    """A ``retry`` option: a ``RetryPolicy``, or ``None`` for the default one; else
    ``ValueError`` naming what was given."""
    if retry is not None and not isinstance(retry, RetryPolicy):
        raise ValueError(f"retry must be a hf_dcp_storage.RetryPolicy, got {type(retry).__name__}")
    return retry or RetryPolicy()
