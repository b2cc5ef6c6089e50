"""The loopback object stores' ``storage_options`` and fresh buckets, and the sealed fake AWS
environment: what ``tests/conftest.py``'s fixtures are built on, and what tests, benchmarks and
``scripts/experiments/`` pass to the library or their own checks."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

from tests.support.objectservers import azurite_connection_string

__all__ = [
    "FAKE_AWS_ENV",
    "S3_BLOCK_SIZE",
    "UNSET_AWS_ENV",
    "azure_options",
    "fresh_bucket",
    "gcs_options",
    "s3_storage_options",
    "s3_user_options",
]

# s3fs buffers this much before it starts a multipart upload, and uploads parts at least this
# big; 5 MiB is the smallest part S3 (and moto) accept, so a tensor over 5 MiB makes a real
# multipart upload without the test moving 50 MiB (s3fs' default block size).
S3_BLOCK_SIZE = 5 * 2**20

# Fake credentials and a sealed AWS environment: nothing from the developer's machine (profiles,
# real keys, a configured endpoint, a proxy, the EC2 metadata service) can reach the tests.
FAKE_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_CONFIG_FILE": "/nonexistent/hf_dcp_storage_tests/aws_config",
    "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/hf_dcp_storage_tests/aws_credentials",
    "AWS_EC2_METADATA_DISABLED": "true",
    "NO_PROXY": "127.0.0.1,localhost",
    "no_proxy": "127.0.0.1,localhost",
}
UNSET_AWS_ENV = (
    "AWS_PROFILE",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_REGION",
)


def s3_storage_options(endpoint: str) -> dict:
    """fsspec ``storage_options`` for the moto endpoint: fake keys, fresh instance, no listings
    cache.

    ``skip_instance_cache``: fsspec would otherwise hand every test (and the writer and reader of
    one test) the same ``S3FileSystem`` object; ``use_listings_cache=False``: a listing never
    comes from s3fs' directory cache, so no test sees a stale one. No ``region_name`` in
    ``client_kwargs``: with it, moto refuses the bucket creation.
    """
    return {
        "anon": False,
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint},
        "default_block_size": S3_BLOCK_SIZE,
        "skip_instance_cache": True,
        "use_listings_cache": False,
    }


def s3_user_options(endpoint: str) -> dict:
    """``storage_options`` as a user passes them: keys and endpoint only, so fsspec's defaults
    hold (one shared ``S3FileSystem`` per process, listings cache on). What the library is
    handed in the tests: it must be right with the cache a real process has (the checks a
    test makes itself use ``s3_storage_options``, which has none)."""
    return {
        "anon": False,
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint},
        "default_block_size": S3_BLOCK_SIZE,
    }


def fresh_bucket(endpoint: str) -> Iterator[tuple[str, dict]]:
    """Yields ``("s3://<fresh bucket>", user storage_options)``; removes the bucket after."""
    import s3fs

    options = s3_user_options(endpoint)
    bucket = f"hf-dcp-test-{uuid.uuid4().hex[:20]}"
    fs = s3fs.S3FileSystem(**s3_storage_options(endpoint))
    fs.mkdir(bucket)
    try:
        yield f"s3://{bucket}", options
    finally:
        # Frees moto's memory; also drops whatever a test left in fsspec's instance cache.
        fs.rm(bucket, recursive=True)
        s3fs.S3FileSystem.clear_instance_cache()


def gcs_options(endpoint: str) -> dict:
    """What a user passes for a GCS endpoint: ``token="anon"`` (otherwise gcsfs probes a cloud
    metadata address for credentials) and the endpoint; fsspec's caches on."""
    return {"token": "anon", "project": "hf-dcp-test", "endpoint_url": endpoint}


def azure_options(blob_endpoint: str) -> dict:
    """What a user passes for Azurite: its well-known development account's connection string."""
    return {"connection_string": azurite_connection_string(blob_endpoint)}
