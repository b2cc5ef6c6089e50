"""``RetryPolicy``: which failures are retried (by the rules of the store that raised them), how
long it waits, what it says when it gives up."""

from __future__ import annotations

import asyncio
import random

import pytest

from hf_dcp_storage import RetryPolicy
from hf_dcp_storage.stores import retry
from hf_dcp_storage.stores.azure_requests import AZURE_ERRORS
from hf_dcp_storage.stores.gcs_requests import GCS_ERRORS
from hf_dcp_storage.stores.retry import FSSPEC_ERRORS, ErrorRules, RemoteOperationError, StoreError
from hf_dcp_storage.stores.s3_requests import S3_ERRORS


class _ClientError(Exception):
    """Shaped like botocore's ClientError: what the classifier reads is ``response``."""

    def __init__(self, code: str, status: int) -> None:
        super().__init__(f"An error occurred ({code})")
        self.response = {
            "Error": {"Code": code, "Message": code},
            "ResponseMetadata": {"HTTPStatusCode": status},
        }


class ClientPayloadError(Exception):  # aiohttp's name for a body cut short
    pass


class _HttpResponseError(Exception):
    """Shaped like azure.core's HttpResponseError: ``status_code`` and ``error_code``."""

    def __init__(self, status: int, code: str) -> None:
        super().__init__(f"({code}) status {status}")
        self.status_code, self.error_code = status, code


class ServiceResponseError(Exception):  # azure.core's name for a connection dropped mid-answer
    pass


class EndpointConnectionError(Exception):  # botocore's name for an endpoint not reached
    pass


@pytest.mark.parametrize(
    "rules,exc,transient",
    [
        (S3_ERRORS, _ClientError("SlowDown", 503), True),
        (S3_ERRORS, _ClientError("InternalError", 500), True),
        (S3_ERRORS, _ClientError("RequestTimeout", 400), True),
        (S3_ERRORS, _ClientError("AccessDenied", 403), False),
        (S3_ERRORS, _ClientError("NoSuchBucket", 404), False),
        (S3_ERRORS, _ClientError("NotImplemented", 501), False),
        (S3_ERRORS, EndpointConnectionError(), True),
        (GCS_ERRORS, StoreError("rate limited", status=429), True),
        (GCS_ERRORS, StoreError("backend error", status=503), True),
        (GCS_ERRORS, StoreError("precondition failed", status=412), False),
        (AZURE_ERRORS, _HttpResponseError(503, "ServerBusy"), True),
        (AZURE_ERRORS, _HttpResponseError(404, "BlobNotFound"), False),
        (AZURE_ERRORS, ServiceResponseError("connection dropped"), True),
        # What every store shares: Python's connection errors, aiohttp's, Python's permanent ones.
        *(
            case
            for rules in (S3_ERRORS, GCS_ERRORS, AZURE_ERRORS, FSSPEC_ERRORS)
            for case in (
                (rules, ConnectionResetError(), True),
                (rules, TimeoutError(), True),
                (rules, ClientPayloadError("Response payload is not completed"), True),
                (rules, FileNotFoundError("x"), False),
                (rules, PermissionError("x"), False),
                (rules, ValueError("bad"), False),
            )
        ),
    ],
)
def test_classification(rules: ErrorRules, exc: BaseException, transient: bool) -> None:
    assert rules.transient(exc) is transient


@pytest.mark.parametrize(
    "rules,exc",
    [
        (GCS_ERRORS, _ClientError("SlowDown", 503)),
        (FSSPEC_ERRORS, _ClientError("SlowDown", 503)),
        (S3_ERRORS, _HttpResponseError(503, "ServerBusy")),
        (FSSPEC_ERRORS, EndpointConnectionError()),
        (S3_ERRORS, ServiceResponseError("connection dropped")),
    ],
)
def test_a_store_reads_its_own_errors_only(rules: ErrorRules, exc: BaseException) -> None:
    """Each store's rules know its own SDK's shapes: another SDK's transient error is none of
    theirs (and so permanent), which is what keeps a backend's knowledge in its own module."""
    assert rules.transient(exc) is False


@pytest.mark.parametrize(
    "rules,exc,kind",
    [
        (S3_ERRORS, _ClientError("NoSuchKey", 404), FileNotFoundError),
        (S3_ERRORS, _ClientError("SignatureDoesNotMatch", 403), PermissionError),
        (GCS_ERRORS, StoreError("no such object", status=404), FileNotFoundError),
        (GCS_ERRORS, StoreError("forbidden", status=403), PermissionError),
        (AZURE_ERRORS, _HttpResponseError(404, "ContainerNotFound"), FileNotFoundError),
        (AZURE_ERRORS, _HttpResponseError(403, "AuthorizationFailure"), PermissionError),
        (AZURE_ERRORS, _HttpResponseError(409, "BlobAlreadyExists"), RemoteOperationError),
    ],
)
def test_each_store_names_what_is_missing_or_refused(
    rules: ErrorRules, exc: BaseException, kind: type
) -> None:
    with pytest.raises(kind, match=r"^GET az://c/b failed: .*\(not retried") as info:
        RetryPolicy().call(
            _flaky([exc])[0], operation="GET", url="az://c/b", errors=rules, sleep=pytest.fail
        )
    assert type(info.value) is kind


def _flaky(failures: list[BaseException]):
    calls = []

    def fn() -> str:
        calls.append(1)
        if failures:
            raise failures.pop(0)
        return "ok"

    return fn, calls


def test_transient_failures_are_retried_with_growing_jittered_sleeps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fn, calls = _flaky(
        [_ClientError("SlowDown", 503), ConnectionResetError(), ClientPayloadError()]
    )
    sleeps: list[float] = []
    policy = RetryPolicy(max_attempts=4, base_delay=1.0, max_delay=3.0)
    monkeypatch.setattr(
        retry, "random", random.Random(20261203)
    )  # the jitter's draws, of a seed of its own
    assert (
        policy.call(fn, operation="GET", url="s3://b/k", errors=S3_ERRORS, sleep=sleeps.append)
        == "ok"
    )
    assert len(calls) == 4
    # Full jitter: attempt k sleeps uniform(0, min(max_delay, base_delay * 2**k)), so the bounds
    # grow 1, 2, 4 -> capped at 3; the same draws from the same seed pin them exactly.
    same = random.Random(20261203)
    assert sleeps == [same.uniform(0.0, cap) for cap in (1.0, 2.0, 3.0)]


def test_attempts_run_out_with_a_message_naming_operation_url_and_fix() -> None:
    fn, calls = _flaky([_ClientError("SlowDown", 503)] * 10)
    with pytest.raises(
        RemoteOperationError,
        match=r"^UploadPart 3 s3://b/k failed after 3 attempt\(s\) over [0-9.]+ s: "
        r".*SlowDown.*raise RetryPolicy\(max_attempts=\.\.\., deadline=\.\.\.\)",
    ) as info:
        RetryPolicy(max_attempts=3).call(
            fn, operation="UploadPart 3", url="s3://b/k", errors=S3_ERRORS, sleep=lambda s: None
        )
    assert len(calls) == 3 and isinstance(info.value.__cause__, _ClientError)


def test_the_deadline_bounds_total_time() -> None:
    fn, calls = _flaky([TimeoutError()] * 10)
    with pytest.raises(RemoteOperationError, match="failed after 1 attempt"):
        RetryPolicy(max_attempts=10, base_delay=5.0, max_delay=5.0, deadline=0.0).call(
            fn, operation="GET", url="u", errors=FSSPEC_ERRORS, sleep=lambda s: None
        )
    assert len(calls) == 1


@pytest.mark.parametrize(
    "exc,kind",
    [
        (_ClientError("AccessDenied", 403), PermissionError),
        (_ClientError("NoSuchBucket", 404), FileNotFoundError),
        (ValueError("no"), RemoteOperationError),
    ],
)
def test_permanent_failures_are_not_retried_and_keep_their_kind(
    exc: BaseException, kind: type
) -> None:
    fn, calls = _flaky([exc])
    with pytest.raises(
        kind, match=r"^PUT s3://b/k failed: .* \(not retried: the error is permanent\)$"
    ):
        RetryPolicy().call(
            fn,
            operation="PUT",
            url="s3://b/k",
            errors=S3_ERRORS,
            sleep=lambda s: pytest.fail("slept"),
        )
    assert len(calls) == 1


def test_async_calls_retry_the_same_way() -> None:
    failures = [ConnectionResetError(), _ClientError("SlowDown", 503)]

    async def fn() -> int:
        if failures:
            raise failures.pop(0)
        return 7

    assert (
        asyncio.run(
            RetryPolicy(base_delay=0.001).acall(fn, operation="GET", url="u", errors=S3_ERRORS)
        )
        == 7
    )


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"max_attempts": 0}, r"max_attempts=0\) must be an int >= 1 \(1 = no retries\)"),
        ({"deadline": -1}, r"deadline=-1\) must be >= 0 seconds"),
    ],
)
def test_bad_policies_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RetryPolicy(**kwargs)
