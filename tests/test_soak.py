"""The soak (``tests/support/soak.py``), short: seeded fault schedules over many saves and loads,
against moto.

The long version is ``scripts/experiments/soak_s3.py`` (results in ``benchmarks/results/``). Below
it, one test per bug the soak found and fixed (``stores/s3_requests.py``, ``reader.py``,
``stores/retry.py``, ``writer.py``).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import torch
import torch.distributed.checkpoint as dcp

s3fs = pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

from hf_dcp_storage import HFStorageReader, HFStorageWriter, RetryPolicy  # noqa: E402
from hf_dcp_storage.stores.retry import RemoteOperationError  # noqa: E402
from hf_dcp_storage.stores.s3_requests import S3_ERRORS  # noqa: E402
from tests.support.data import assert_same, random_tensor  # noqa: E402
from tests.support.faultproxy import Fault, FaultProxy  # noqa: E402
from tests.support.soak import BOUNDED_FIRES, KINDS, POLICY, soak  # noqa: E402
from tests.support.storage_options import s3_storage_options  # noqa: E402

# The moto server only: quick to write to, and enough to find bugs (radosgw has test_s3_faults.py).
moto_only = pytest.mark.parametrize("s3_endpoint", ["moto"], indirect=True)

INDEX = "model.safetensors.index.json"
# Drawn so that this short soak has every fault kind, saves that fail and saves that complete
# after retried faults (asserted below, so a change of the drawing that loses them shows).
SEED = 7


@pytest.mark.distributed
@moto_only
def test_a_short_soak_loses_no_bytes_and_fails_only_cleanly(s3_endpoint: str) -> None:
    report = soak(s3_endpoint, 16, SEED, multi_rank_saves=4)  # ~20 s on 2 cores
    print("\n" + report.markdown())
    assert report.problems == []
    assert report.bytes_lost == 0 and report.unclean == 0 and report.leftovers == 0
    assert report.saves == 20 and report.multi_rank_saves == 4
    assert report.survived == report.saves
    assert report.loads_ok == report.loads == 2 * report.completed + report.failed
    assert all(report.faults[k] > 0 for k in KINDS), report.faults
    assert sum(report.load_faults.values()) > 0
    assert (
        report.failed >= 1
        and report.failed_clean == report.failed
        and report.resaves_ok == report.failed
    )
    assert report.completed_after_faults >= 1
    assert report.bytes_saved > 0


# -- bugs the soak found --------------------------------------------------------------------------


@pytest.fixture
def proxied(s3_endpoint: str) -> Iterator[tuple[FaultProxy, str, dict, s3fs.S3FileSystem]]:
    """``(proxy, s3://bucket/ckpt, options through the proxy, s3fs straight to moto)``."""
    direct = s3fs.S3FileSystem(**s3_storage_options(s3_endpoint))
    bucket = f"hf-dcp-soakbug-{uuid.uuid4().hex[:16]}"
    direct.mkdir(bucket)
    with FaultProxy(upstream=s3_endpoint) as proxy:
        # botocore's retries off: only the library's remain.
        options = {
            **s3_storage_options(proxy.endpoint),
            "config_kwargs": {"retries": {"total_max_attempts": 1, "mode": "standard"}},
        }
        yield proxy, f"s3://{bucket}/ckpt", options, direct
        assert proxy.errors == []
    direct.rm(bucket, recursive=True)


def _big_state_dict() -> dict[str, torch.Tensor]:
    # 20 MiB in one file: one process uploads it in two parts (16 MiB parts), so a multipart upload.
    return {
        "w": random_tensor((5120, 1024), torch.float32, 11),
        "b": random_tensor((1024,), torch.bfloat16, 12),
    }


def _load(url: str, options: dict, expected: dict[str, torch.Tensor]) -> None:
    out = {k: torch.zeros_like(v) for k, v in expected.items()}
    dcp.load(
        out,
        storage_reader=HFStorageReader(url, storage_options=options, retry=POLICY),
        no_dist=True,
    )
    for k, v in expected.items():
        assert_same(out[k], v, k)


@moto_only
def test_a_create_upload_whose_answer_was_lost_leaves_no_orphan_upload(proxied) -> None:
    """CreateMultipartUpload is not idempotent: the first attempt's upload exists although its
    answer was cut short, and the retry makes a second. The save completed but left the first
    open (billed, invisible) until the next save to the path."""
    proxy, url, options, direct = proxied
    fault = proxy.add_fault(Fault("truncate", method="POST", query_has="uploads", times=1))
    sd = _big_state_dict()
    dcp.save(
        sd, storage_writer=HFStorageWriter(url, storage_options=options, retry=POLICY), no_dist=True
    )
    assert fault.fired == 1
    creates = [r for r in proxy.requests if r.method == "POST" and r.query == "uploads"]
    assert len(creates) == 2  # the lost answer, then the retry
    assert direct.list_multipart_uploads(url.removeprefix("s3://").split("/")[0]) == []
    _load(url, options, sd)


@moto_only
def test_a_500_or_a_reset_on_reading_the_index_is_retried(proxied) -> None:
    """The index is read through s3fs, which retries neither a 500 nor a reset: one of either
    failed the load."""
    proxy, url, options, _direct = proxied
    sd = {"w": random_tensor((256, 256), torch.float32, 13)}
    dcp.save(sd, storage_writer=HFStorageWriter(url, storage_options=options), no_dist=True)
    faults = [
        proxy.add_fault(Fault("500", method="HEAD", path=INDEX, times=1)),
        proxy.add_fault(Fault("reset", method="GET", path=INDEX, times=1)),
        proxy.add_fault(Fault("500", method="GET", path=INDEX, times=1)),
    ]
    _load(url, options, sd)
    assert [f.fired for f in faults] == [1, 1, 1]


@moto_only
def test_a_500_on_the_size_of_a_file_whose_header_a_verified_load_reads_is_retried(proxied) -> None:
    """``verify=True`` reads every file's own header, taking its size from a HEAD through s3fs,
    which does not retry a 500: one failed the load."""
    proxy, url, options, _direct = proxied
    sd = {"w": random_tensor((256, 256), torch.float32, 16)}
    dcp.save(sd, storage_writer=HFStorageWriter(url, storage_options=options), no_dist=True)
    fault = proxy.add_fault(Fault("500", method="HEAD", path=r"\.safetensors$", times=2))
    out = {"w": torch.zeros(256, 256)}
    dcp.load(
        out,
        storage_reader=HFStorageReader(url, storage_options=options, retry=POLICY, verify=True),
        no_dist=True,
    )
    assert fault.fired == 2
    assert_same(out["w"], sd["w"], "w")


@moto_only
def test_a_missing_or_malformed_index_still_fails_at_once_with_its_own_error(proxied) -> None:
    _proxy, url, options, direct = proxied
    reader = HFStorageReader(
        url, storage_options=options, retry=RetryPolicy(max_attempts=5, base_delay=10)
    )
    with pytest.raises(FileNotFoundError, match="is not an HF checkpoint"):
        reader.read_metadata()  # no sleep of 10 s: a permanent failure is not retried
    direct.pipe_file(f"{url.removeprefix('s3://')}/{INDEX}", b"{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        HFStorageReader(
            url, storage_options=options, retry=RetryPolicy(max_attempts=5, base_delay=10)
        ).read_metadata()


class _ClientError(Exception):
    def __init__(self, code: str, status: int) -> None:
        super().__init__(f"An error occurred ({code})")
        self.response = {
            "Error": {"Code": code, "Message": code},
            "ResponseMetadata": {"HTTPStatusCode": status},
        }


def _translated(code: str, status: int) -> OSError:
    """What s3fs raises for an error code it has no builtin exception for: OSError, cause kept."""
    exc = OSError(121, "We encountered an internal error. Please try again.")
    exc.__cause__ = _ClientError(code, status)
    return exc


def _gave_up() -> RemoteOperationError:
    """What an inner retry raises once its attempts ran out: its cause is transient, it is not."""
    exc = RemoteOperationError("GET s3://b/k failed after 5 attempt(s)")
    exc.__cause__ = _ClientError("SlowDown", 503)
    return exc


@pytest.mark.parametrize(
    "exc,transient",
    [
        (_translated("InternalError", 500), True),
        (_translated("SlowDown", 503), True),
        (_translated("InvalidArgument", 400), False),
        (OSError(121, "no cause"), False),
        (_gave_up(), False),  # else a retry around a retried call would multiply the attempts
    ],
)
def test_errors_s3fs_translated_are_judged_by_their_cause(
    exc: BaseException, transient: bool
) -> None:
    assert S3_ERRORS.transient(exc) is transient


def test_keep_permanent_retries_transient_failures_and_passes_the_rest_unchanged() -> None:
    failures: list[BaseException] = [
        _translated("InternalError", 500),
        ValueError("malformed index"),
    ]

    def fn() -> None:
        raise failures.pop(0)

    with pytest.raises(ValueError, match=r"^malformed index$"):
        RetryPolicy(max_attempts=BOUNDED_FIRES + 2).call(
            fn,
            operation="GET",
            url="s3://b/k",
            errors=S3_ERRORS,
            sleep=lambda s: None,
            keep_permanent=True,
        )
    assert failures == []


# -- bugs the soak found in writer.py -------------------------------------------------------------


@moto_only
def test_a_500_on_removing_the_staging_folder_after_the_commit_does_not_fail_the_save(
    proxied,
) -> None:
    proxy, url, options, direct = proxied
    fault = proxy.add_fault(Fault("500", method="POST", query_has="delete", times=1))
    dcp.save(
        {"w": random_tensor((64, 64), torch.float32, 14)},
        storage_writer=HFStorageWriter(url, storage_options=options, retry=POLICY),
        no_dist=True,
    )
    assert fault.fired == 1
    root = url.removeprefix("s3://")
    assert direct.exists(f"{root}/{INDEX}")
    direct.invalidate_cache()
    assert [k for k in direct.find(root) if ".hf_dcp_staging" in k] == []  # the removal was retried


@moto_only
def test_a_500_on_listing_the_destination_is_retried(proxied) -> None:
    proxy, url, options, _direct = proxied
    bucket = url.removeprefix("s3://").split("/")[0]
    fault = proxy.add_fault(
        Fault("500", method="GET", path=f"^/{bucket}$", query_has="list-type", times=1)
    )
    dcp.save(
        {"w": random_tensor((64, 64), torch.float32, 15)},
        storage_writer=HFStorageWriter(url, storage_options=options, retry=POLICY),
        no_dist=True,
    )
    assert fault.fired == 1
