"""Shared fixtures: a checkpoint URL per backend."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import uuid
from collections.abc import Iterator

import fsspec
import pytest

from tests.support import objectservers
from tests.support.faultproxy import FaultProxy
from tests.support.storage_options import (
    FAKE_AWS_ENV,
    UNSET_AWS_ENV,
    azure_options,
    fresh_bucket,
    gcs_options,
)

# tests/integrations/ needs the trainers, which live in .venv-integrations (with their own
# fsspec); in any other venv tests/test_integrations.py runs them there, so they are not
# collected here at all (rather than listed as skipped).
if importlib.util.find_spec("lightning") is None and importlib.util.find_spec("torchtitan") is None:
    collect_ignore = ["integrations"]


@pytest.fixture(params=["local", "file", "memory"])
def url(request: pytest.FixtureRequest, tmp_path) -> Iterator[str]:
    """A fresh checkpoint location: a plain local path, a ``file://`` URL, or ``memory://``."""
    if request.param == "local":
        yield str(tmp_path / "ckpt")
    elif request.param == "file":
        yield f"file://{tmp_path}/ckpt"
    else:
        # Unique root so tests do not interfere through the process-wide memory filesystem.
        root = f"/{uuid.uuid4().hex}"
        yield f"memory://{root}/ckpt"
        fsspec.filesystem("memory").rm(root, recursive=True)


# -- S3 (moto and Ceph radosgw servers on loopback) ------------------------------------------------


@contextlib.contextmanager
def _sealed_aws_env() -> Iterator[None]:
    """The fake AWS environment of ``FAKE_AWS_ENV`` (inherited by spawned ranks), undone after."""
    with pytest.MonkeyPatch.context() as mp:
        for name, value in FAKE_AWS_ENV.items():
            mp.setenv(name, value)
        for name in UNSET_AWS_ENV:
            mp.delenv(name, raising=False)
        yield


@contextlib.contextmanager
def _moto_server() -> Iterator[str]:
    """moto's S3 server in a thread of this process (port 0: the OS picks a free port)."""
    moto_server = pytest.importorskip("moto.server")
    werkzeug_log = logging.getLogger("werkzeug")
    old_level = werkzeug_log.level
    werkzeug_log.setLevel(logging.WARNING)  # it logs every request at INFO
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
    finally:
        server.stop()
        werkzeug_log.setLevel(old_level)


@pytest.fixture(scope="session", params=["moto", "radosgw"])
def s3_endpoint(request: pytest.FixtureRequest) -> Iterator[str]:
    """``http://127.0.0.1:<port>`` of a real S3 server on loopback, once per session per server.

    ``moto``: moto's server in a thread of this process (port 0: the OS picks a free port).
    ``radosgw``: Ceph's S3 gateway on a one-node cluster started by ``scripts/setup/radosgw.sh``
    (about 2 s); skipped, with the reason, where Ceph is not installed (``scripts/test.sh``
    installs it when it can) or ``HF_DCP_TEST_RADOSGW=0``. Spawned ranks reach either over
    loopback (they inherit the fake AWS environment set here).
    """
    pytest.importorskip("s3fs")
    if request.param == "radosgw":
        from tests.support import radosgw

        reason = radosgw.radosgw_unavailable()
        if reason is not None:
            pytest.skip(f"radosgw: {reason}")
        with _sealed_aws_env():
            # A Ceph that is installed but fails to start errors the tests (with its log tail).
            endpoint, stop = radosgw.start_radosgw()
            try:
                yield endpoint
            finally:
                stop()
        return
    with _sealed_aws_env(), _moto_server() as endpoint:
        yield endpoint


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """Like ``s3_endpoint``, moto only: for the trainer integrations (``tests/integrations/``),
    whose runs are too long to repeat against every server."""
    pytest.importorskip("s3fs")
    with _sealed_aws_env(), _moto_server() as endpoint:
        yield endpoint


@pytest.fixture
def s3(s3_endpoint: str) -> Iterator[tuple[str, dict]]:
    """``("s3://<fresh bucket>", storage_options)``: an empty bucket of its own per test, and the
    options a user would pass (``s3_user_options``)."""
    yield from fresh_bucket(s3_endpoint)


@pytest.fixture
def moto_s3(moto_endpoint: str) -> Iterator[tuple[str, dict]]:
    """``s3`` on moto only."""
    yield from fresh_bucket(moto_endpoint)


# -- GCS (fake-gcs-server) and Azure Blob (Azurite) on loopback ------------------------------------

# gcsfs reads this when it is imported: without it, every open is a slow gRPC probe for zonal
# buckets (44 s seen). Set here, before any test imports gcsfs; spawned ranks inherit it.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


@pytest.fixture(scope="session")
def gcs_endpoint() -> Iterator[str]:
    """``http://127.0.0.1:<port>`` of fake-gcs-server (in-memory), started once per session;
    skipped with the reason where it is not installed."""
    reason = objectservers.gcs_unavailable()
    if reason is not None:
        pytest.skip(f"GCS: {reason}")
    endpoint, stop = objectservers.start_fake_gcs()
    try:
        yield endpoint
    finally:
        stop()


@pytest.fixture(scope="session")
def azure_endpoint() -> Iterator[str]:
    """The blob endpoint of Azurite (data in a temporary folder), started once per session;
    skipped with the reason where Node.js or Azurite is not installed."""
    reason = objectservers.azurite_unavailable()
    if reason is not None:
        pytest.skip(f"Azure: {reason}")
    endpoint, stop = objectservers.start_azurite()
    try:
        yield endpoint
    finally:
        stop()


@pytest.fixture
def gcs(gcs_endpoint: str) -> Iterator[tuple[str, dict]]:
    """``("gs://<fresh bucket>", storage_options)``: an empty bucket per test."""
    import gcsfs

    options = gcs_options(gcs_endpoint)
    with _fresh_root(gcsfs.GCSFileSystem, options) as name:
        yield f"gs://{name}", options


@pytest.fixture
def azure(azure_endpoint: str) -> Iterator[tuple[str, dict]]:
    """``("az://<fresh container>", storage_options)``: an empty container per test."""
    import adlfs

    options = azure_options(azure_endpoint)
    with _fresh_root(adlfs.AzureBlobFileSystem, options) as name:
        yield f"az://{name}", options


@contextlib.contextmanager
def _fresh_root(fs_class: type, options: dict) -> Iterator[str]:
    """A new, empty bucket or container (its name), removed with its contents afterwards."""
    name = f"hf-dcp-test-{uuid.uuid4().hex[:20]}"
    fs = fs_class(skip_instance_cache=True, **options)
    fs.mkdir(name)
    try:
        yield name
    finally:
        fs.rm(name, recursive=True)
        fs_class.clear_instance_cache()


@pytest.fixture(scope="module")
def s3_proxy(s3_endpoint: str) -> Iterator[FaultProxy]:
    """A fault-injecting, request-recording proxy in front of the S3 server
    (``tests/support/faultproxy.py``), one per test module; tests ``clear()`` it."""
    with FaultProxy(upstream=s3_endpoint) as p:
        yield p
