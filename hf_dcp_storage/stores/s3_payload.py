"""How this library's S3 requests that carry checkpoint bytes (``UploadPart``, ``PutObject``)
protect their bodies: a CRC32 checksum that the server verifies, computed here, and, with it, no
SHA-256 of the body in the signature.

Left to itself, botocore makes two passes over every body it sends: a CRC32 for its flexible
checksum header (the stdlib's zlib, ~2 GB/s on this project's VM) and, on an ``http://``
endpoint, a SHA-256 of the body for the SigV4 signature (~1.1 GB/s). Uploading 320 MiB in 8 MiB
parts from one process took 0.66 s of CPU with both, 0.31 s without; on a 2-core machine where
the ranks and the server share the cores, that is a tenth of a save's time. Here instead:

- the checksum header comes from ``format/crc.crc32_of`` (zlib-ng, ~30 GB/s), and botocore
  computes none of its own (it skips a request whose checksum header is already set);
- a body that carries that checksum is signed as ``UNSIGNED-PAYLOAD``: what botocore itself does
  over https, and what AWS's CRT client (s3torchconnector, Mountpoint) does on every endpoint.
  The server still verifies the CRC32 of the body, and the signature still covers the method,
  the key, the headers and the checksum.

Both yield to the user's configuration of the client: ``request_checksum_calculation=
"when_required"`` (a server that refuses checksums) or a checksum asked for in
``s3_additional_kwargs`` turns both off; an explicit ``config_kwargs={"s3":
{"payload_signing_enabled": True}}`` keeps every body signed. Only this library's own requests
are affected (a context variable marks them while they are built): every other request through
the same client is signed as botocore would.
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from typing import Any

from ..format.crc import crc32_of

__all__ = ["BODY_METHODS", "body_checksum", "checkpoint_bytes"]

# The client methods by which this library sends checkpoint bytes.
BODY_METHODS = frozenset({"upload_part", "put_object"})

# True while one of this library's body requests is being built and signed (in its own task).
_OURS: ContextVar[bool] = ContextVar("hf_dcp_storage_checkpoint_bytes", default=False)
_HANDLER_ID = "hf_dcp_storage.unsigned_checksummed_payload"


def body_checksum(
    client: Any, additional: Mapping[str, Any], data: bytes | bytearray | memoryview
) -> dict[str, str]:
    """The ``ChecksumCRC32`` parameter of a request whose body is ``data`` (base64 of the
    big-endian CRC32, as S3 reads it), or ``{}`` where the user's configuration asks for no
    checksum (``request_checksum_calculation`` other than botocore's default
    ``"when_supported"``, or a botocore too old to have it) or for another one (a ``Checksum*``
    key in ``additional``, s3fs's ``s3_additional_kwargs``)."""
    config = client.meta.config
    if getattr(config, "request_checksum_calculation", None) != "when_supported":
        return {}
    if any(str(k).startswith("Checksum") for k in additional):
        return {}
    crc = crc32_of(data)
    return {"ChecksumCRC32": base64.b64encode(crc.to_bytes(4, "big")).decode("ascii")}


@contextlib.contextmanager
def checkpoint_bytes(client: Any) -> Iterator[None]:
    """Around the call that sends one of this library's body requests through ``client`` (in the
    coroutine that awaits it): a body with a checksum header goes unsigned (the module
    docstring). Registers the signing hook on ``client`` once (botocore's ``unique_id``)."""
    client.meta.events.register("before-sign.s3", _unsigned_when_checksummed, unique_id=_HANDLER_ID)
    token = _OURS.set(True)
    try:
        yield
    finally:
        _OURS.reset(token)


def _unsigned_when_checksummed(request: Any, **_: Any) -> None:
    """botocore's ``before-sign`` hook: for this library's body requests that carry a checksum
    header, sign the body as ``UNSIGNED-PAYLOAD`` (this request's own copy of the client
    configuration, with ``payload_signing_enabled`` off) unless the user set that option."""
    if not _OURS.get():
        return
    config = request.context.get("client_config")
    s3 = dict(getattr(config, "s3", None) or {})
    if config is None or s3.get("payload_signing_enabled") is not None:
        return
    if not any(str(h).lower().startswith("x-amz-checksum-") for h in request.headers):
        return
    # ``Config`` through the instance's own class: botocore is reached through s3fs only.
    unsigned = type(config)(s3={**s3, "payload_signing_enabled": False})
    request.context["client_config"] = config.merge(unsigned)
