"""Retries for remote operations: exponential backoff with full jitter, bounded in attempts and
time.

A remote request fails in one of two ways. Transient failures (503 SlowDown, 500, a reset
connection, a truncated body, a timeout) go away if the same idempotent request is sent again
a little later; they are retried. Permanent ones (403 AccessDenied, a missing bucket or object,
a bad request) never will; retrying them only delays the error, so they fail at once. Either
way the error names the operation and the URL.

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

__all__ = ["RemoteOperationError", "RetryPolicy", "StoreError", "is_transient", "policy_or_default"]

T = TypeVar("T")

# S3 error codes that mean "try again later"; anything else with a 4xx status is permanent.
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestTimeout",
        "RequestTimeTooSkewed",
        "InternalError",
        "ServiceUnavailable",
        "RequestLimitExceeded",
        "BandwidthLimitExceeded",
    }
)
# Connection-level failures by class name, so that optional libraries (botocore, aiohttp)
# need not be imported here: resets, closed connections, truncated bodies, timeouts.
_TRANSIENT_CLASS_NAMES = frozenset(
    {
        "EndpointConnectionError",
        "ConnectionClosedError",
        "ReadTimeoutError",
        "ConnectTimeoutError",
        "IncompleteReadError",
        "ResponseStreamingError",
        "ClientPayloadError",
        "ServerDisconnectedError",
        "ClientConnectionError",
        "ClientOSError",
        "ServerTimeoutError",
        "ContentLengthError",
        "TransferEncodingError",
        "HTTPClientError",
        "ProxyConnectionError",
        "IncompleteRead",
        "FSTimeoutError",
        "ResponseParserError",
        "ChecksumError",
        "FlexibleChecksumError",
        "AWSChunkedDecodingError",
        "ProxyError",
        "ServiceRequestError",
        "ServiceResponseError",
        "ServiceRequestTimeoutError",
        "ServiceResponseTimeoutError",
    }
)
# HTTP statuses that mean "try again later" where a store's error carries only its status
# (GCS, Azure): server errors, request timeout, too many requests.
_TRANSIENT_STATUSES = frozenset({408, 429})
# Azure error codes of permanent failures that name what is missing or refused.
_MISSING_CODES = frozenset(
    {
        "NoSuchBucket",
        "NoSuchKey",
        "NoSuchUpload",
        "404",
        "NotFound",
        "BlobNotFound",
        "ContainerNotFound",
        "ResourceNotFound",
    }
)
_DENIED_CODES = frozenset(
    {
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "403",
        "AuthorizationFailure",
        "AuthenticationFailed",
        "AuthorizationPermissionMismatch",
    }
)


class RemoteOperationError(OSError):
    """A remote operation that failed for good: permanently, or after every allowed retry."""


class StoreError(Exception):
    """A store's error answer that carries only an HTTP status (GCS through gcsfs's session):
    transient for 5xx, 408 and 429, permanent otherwise."""

    def __init__(self, message: str, *, status: int) -> None:
        super().__init__(message)
        self.status = status


def is_transient(exc: BaseException) -> bool:
    """Whether sending the same request again may succeed.

    An error that s3fs translated from botocore's (an ``OSError`` whose ``__cause__`` is the
    ``ClientError`` or connection error) is judged by that cause: s3fs turns a 500 into
    ``OSError(EREMOTEIO)``, which would otherwise look permanent. A ``RemoteOperationError`` is
    never transient: its retries have already run out.
    """
    if isinstance(exc, RemoteOperationError):
        return False
    response = getattr(exc, "response", None)
    if isinstance(response, dict) and "Error" in response:  # botocore ClientError
        code = str(response.get("Error", {}).get("Code", ""))
        status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        if code in {"NotImplemented", "XNotImplemented"} or status == 501:
            return False  # the store lacks the feature; asking again will not add it
        return code in _TRANSIENT_CODES or status >= 500
    if isinstance(
        exc,
        (
            FileNotFoundError,
            PermissionError,
            FileExistsError,
            IsADirectoryError,
            NotADirectoryError,
        ),
    ):
        return False
    http = _status(exc)
    if http is not None:  # a store's HTTP error answer (GCS, Azure)
        if http == 501:
            return False
        return http >= 500 or http in _TRANSIENT_STATUSES
    cause = exc.__cause__
    if type(exc) is OSError and cause is not None and cause is not exc:
        return is_transient(cause)
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    return any(cls.__name__ in _TRANSIENT_CLASS_NAMES for cls in type(exc).__mro__)


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
        sleep: Callable[[float], None] = time.sleep,
        keep_permanent: bool = False,
    ) -> T:
        """``fn()``, retried on transient failures.

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
                if keep_permanent and not is_transient(exc):
                    raise
                attempt += 1
                sleep(self._delay_or_raise(exc, attempt, started, operation, url))

    async def acall(self, fn: Callable[[], Awaitable[T]], *, operation: str, url: str) -> T:
        """``await fn()``, retried like :meth:`call`; for requests issued concurrently on one
        event loop."""
        started = time.monotonic()
        attempt = 0
        while True:
            try:
                return await fn()
            except Exception as exc:  # noqa: BLE001 - classified, then re-raised with context
                attempt += 1
                await asyncio.sleep(self._delay_or_raise(exc, attempt, started, operation, url))

    def _delay_or_raise(
        self, exc: Exception, attempt: int, started: float, operation: str, url: str
    ) -> float:
        """The sleep before the next attempt, or raise if ``exc`` ends the retries."""
        if not is_transient(exc):
            raise _permanent(exc, operation, url) from exc
        elapsed = time.monotonic() - started
        delay = random.uniform(0.0, min(self.max_delay, self.base_delay * 2 ** (attempt - 1)))
        if attempt >= self.max_attempts or elapsed + delay > self.deadline:
            raise RemoteOperationError(
                f"{operation} {url} failed after {attempt} attempt(s) over {elapsed:.1f} s: "
                f"{_describe(exc)}; raise RetryPolicy(max_attempts=..., deadline=...) if the "
                "store is only slow"
            ) from exc
        return delay


def _permanent(exc: Exception, operation: str, url: str) -> OSError:
    message = f"{operation} {url} failed: {_describe(exc)} (not retried: the error is permanent)"
    code, status = _code(exc), _status(exc)
    if isinstance(exc, FileNotFoundError) or code in _MISSING_CODES or status == 404:
        return FileNotFoundError(message)
    if isinstance(exc, PermissionError) or code in _DENIED_CODES or status in (401, 403):
        return PermissionError(message)
    return RemoteOperationError(message)


def _code(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", ""))
    code = getattr(exc, "error_code", None)  # azure.core's HttpResponseError
    return str(getattr(code, "value", code) or "")


def _status(exc: BaseException) -> int | None:
    """The HTTP status of a GCS or Azure error answer (``StoreError.status``, azure.core's
    ``HttpResponseError.status_code``), or ``None``: not such an answer."""
    status = exc.status if isinstance(exc, StoreError) else getattr(exc, "status_code", None)
    return status if isinstance(status, int) and not isinstance(status, bool) else None


def _describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if type(exc).__name__ not in text else text


def policy_or_default(retry: RetryPolicy | None) -> RetryPolicy:
    """A ``retry`` option: a ``RetryPolicy``, or ``None`` for the default one; else
    ``ValueError`` naming what was given."""
    if retry is not None and not isinstance(retry, RetryPolicy):
        raise ValueError(f"retry must be a hf_dcp_storage.RetryPolicy, got {type(retry).__name__}")
    return retry or RetryPolicy()
