"""Store conformance: one contract every store passes (the idea of fsspec's ``tests/abstract/``).

Each test below is written once, against a ``Ckpt`` (a fresh checkpoint URL, the
``storage_options`` a user would pass, and a view of the store that caches nothing), and runs
on every entry of ``STORES``: local paths, ``file://``, ``memory://``, the generic staged path
on ``file://`` (``direct_write=False``), S3 on moto, GCS on fake-gcs-server, Azure Blob on
Azurite and S3 on Ceph radosgw (skipped, with the reason, where Ceph is not installed: the
``s3_endpoint`` fixture's own skip). All servers are the real ones ``conftest.py`` starts on
127.0.0.1, once per session; nothing of boto, s3fs, gcsfs or adlfs is patched.

The contract:

* ``test_two_ranks_round_trip``: 2 gloo ranks save a sharded state dict (row shards, a column
  shard, a replicated and a plain tensor, 3 files, every file holding bytes of both ranks) as
  bf16 with a key mapping and load it resharded: the same bits; the folder, fetched through
  fsspec, reads with ``safetensors`` and its index names every tensor; nothing else is left.
* ``test_the_index_is_written_last``: a 2-rank save killed (SIGKILL, every rank) once every
  file is whole but before the index leaves every file, byte for byte, and no index; killed at
  its first slab, no index either (and S3's open uploads); a load of the folder fails with a
  clear error; the next save there (no ``overwrite``) succeeds and leaves nothing else: no
  staging, no part object, no open upload, no uncommitted block.
* ``test_overwrite``: a complete checkpoint is refused without ``overwrite=True`` and unchanged
  by that, and by a save refused before it touches the store; with ``overwrite=True`` it is
  replaced (stale shards gone). What README's "Guarantees" promise for a failed save over it
  (a folder is a checkpoint only when its index exists; an overwrite removes the index
  first, so old and new files never pass for a checkpoint together): a save with
  ``overwrite=True`` that fails in its write leaves no index, nothing unfinished and no part
  object; a save lost after its writes (a writer subclass raising before the commit) leaves
  its bytes (GCS parts, Azure blocks) but no index; either way a load fails clearly, and the
  next save clears all of it.
* ``test_transient_faults_are_retried``: only the stores reached over HTTP (S3, GCS, Azure):
  the fault proxy (``tests/support/faultproxy.py``, an HTTP/1.1 proxy) sits between the client
  and the server, and faults each kind of request once; local disk and ``memory://`` make no
  requests to fault.

A store that lives in one process (``memory://``: every process has its own) cannot be shared
by several ranks: its round trip runs in one process, and its kill test is skipped.

To add a store: its module in ``hf_dcp_storage/stores/`` and its row in the stores' registry
(``stores/registry.py``); here, one ``StoreCase`` in ``STORES``: its id; ``root``, a conftest
fixture that yields ``("scheme://<fresh bucket>", storage_options)`` like ``s3``/``gcs``/
``azure`` (with ``endpoint``, the fixture of its server), or a local kind; for a store over
HTTP, ``faults`` (the proxy's matchers for its data uploads, its assembly, its index write
and its reads) and how to reach it through the proxy (``upstream``, ``through``). Every test
then runs on it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load as st_load
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from hf_dcp_storage import (
    HFLoadPlanner,
    HFSavePlanner,
    HFStorageReader,
    HFStorageWriter,
    RetryPolicy,
)
from tests.support.checks import raises_in_checkpoint
from tests.support.data import assert_same, random_tensor, read_checkpoint
from tests.support.faultproxy import Fault, FaultProxy
from tests.support.jobs import run_job
from tests.support.killpoints import arm
from tests.support.storage_options import azure_options, gcs_options, s3_user_options

INDEX = "model.safetensors.index.json"
# The deadline only bounds a broken retry loop: the attempts end these tests' retries.
FAST_RETRY = RetryPolicy(max_attempts=6, base_delay=0.01, max_delay=0.05, deadline=300)
UNFINISHED = (
    r"has neither model.safetensors.index.json nor model.safetensors"
    r" \(an unfinished save has no index\)"
)
JOB_TIMEOUT = 120.0


# -- the stores ------------------------------------------------------------------------------------


def _s3_through(proxy: str) -> dict:
    # botocore's own retries off: every retry the fault test sees is the library's RetryPolicy.
    return {
        **s3_user_options(proxy),
        "config_kwargs": {"retries": {"total_max_attempts": 1, "mode": "standard"}},
    }


def _same(endpoint: str) -> str:
    return endpoint


def _azure_upstream(endpoint: str) -> str:
    # Azurite's endpoint names the account (http://127.0.0.1:P/devstoreaccount1): the host's part.
    return endpoint.rsplit("/", 1)[0]


def _azure_through(proxy: str) -> dict:
    from tests.support import objectservers

    return azure_options(f"{proxy}/{objectservers.AZURITE_ACCOUNT}")


@dataclass(frozen=True)
class StoreCase:
    """One store of the conformance suite.

    ``root``: ``"local"`` (a plain path), ``"file"`` (a ``file://`` URL), ``"memory"``, or the
    conftest fixture that yields ``("scheme://<fresh bucket>", storage_options)``;
    ``endpoint``: the conftest fixture of its server (``http://127.0.0.1:<port>``);
    ``s3_server``: the ``s3_endpoint`` server the case is tied to (``"moto"`` or
    ``"radosgw"``): that session fixture is parametrized, so every case names one, and the
    cases that are not S3 take moto's (an in-process thread the S3 tests start anyway);
    ``writer``: extra ``HFStorageWriter`` options; ``one_process``: the store is private to a
    process (``memory://``); ``faults``: for a store reached over HTTP, the fault proxy's
    matchers (``Fault`` fields) for ``data`` (a request carrying a shard file's bytes),
    ``assemble`` (the server making a file whole from its parts, where a one-process save has
    that step), ``commit`` (writing the index) and ``read`` (a load's GET of a shard file);
    ``upstream``: the address the proxy forwards to, from the endpoint; ``through``: the
    ``storage_options`` that reach the server through the proxy at a given address.
    """

    id: str
    root: str
    endpoint: str | None = None
    s3_server: str = "moto"
    writer: Mapping[str, Any] = field(default_factory=dict)
    one_process: bool = False
    faults: Mapping[str, Mapping[str, str]] | None = None
    upstream: Callable[[str], str] = _same
    through: Callable[[str], dict] | None = None


_S3_FAULTS = {
    "data": {"method": "PUT", "path": r"/model-\d{5}-of-\d{5}\.safetensors$"},
    # No "assemble": one process PUTs each S3 file whole (multipart uploads are for the ranks'
    # parts of a file; test_s3_faults.py faults their completion on 2 ranks).
    "commit": {"method": "PUT", "path": INDEX + "$"},
    "read": {"method": "GET", "path": r"safetensors$"},
}

STORES: tuple[StoreCase, ...] = (
    StoreCase("local", "local"),
    StoreCase("file", "file"),
    StoreCase("memory", "memory", one_process=True),
    # The generic fsspec path (staged objects merged per file, what memory:// and HDFS take)
    # on a filesystem that several processes share.
    StoreCase("staged", "file", writer={"direct_write": False}),
    StoreCase(
        "s3-moto", "s3", "s3_endpoint", s3_server="moto", faults=_S3_FAULTS, through=_s3_through
    ),
    StoreCase(
        "gcs",
        "gcs",
        "gcs_endpoint",
        through=gcs_options,
        faults={
            # The part objects (and staged runs) a save uploads under .hf_dcp_staging/.
            "data": {
                "method": "POST",
                "path": r"/upload/",
                "query_re": r"^name=.*/\.hf_dcp_staging/.*safetensors",
            },
            "assemble": {"method": "POST", "path": r"/compose$"},
            "commit": {
                "method": "POST",
                "path": r"/upload/",
                "query_re": r"^name=.*/model\.safetensors\.index\.json$",
            },
            "read": {"method": "GET", "path": r"safetensors$"},
        },
    ),
    StoreCase(
        "azure",
        "azure",
        "azure_endpoint",
        upstream=_azure_upstream,
        through=_azure_through,
        faults={
            "data": {"method": "PUT", "query_has": "comp=block", "path": r"safetensors$"},
            "assemble": {"method": "PUT", "query_has": "comp=blocklist"},
            "commit": {"method": "PUT", "path": INDEX + "$"},
            "read": {"method": "GET", "path": r"safetensors$"},
        },
    ),
    StoreCase(
        "s3-radosgw",
        "s3",
        "s3_endpoint",
        s3_server="radosgw",
        faults=_S3_FAULTS,
        through=_s3_through,
    ),
)


def _over(
    cases: tuple[StoreCase, ...], skip: Callable[[StoreCase], str | None] = lambda case: None
) -> pytest.MarkDecorator:
    """Run a test once per case (``skip``: why not on a case), each tied to its ``s3_endpoint``
    server. Session scope, and every test given the same list: pytest groups the tests by
    store, so each server starts once."""
    params = [
        pytest.param(
            c,
            c.s3_server,
            id=c.id,
            marks=[pytest.mark.skip(reason=why)] if (why := skip(c)) else [],
        )
        for c in cases
    ]
    return pytest.mark.parametrize(
        ("case", "s3_endpoint"), params, indirect=["s3_endpoint"], scope="session"
    )


every_store = _over(STORES)
# The fault proxy is an HTTP proxy: local disk and memory:// make no requests to fault.
stores_over_http = _over(
    STORES,
    lambda c: (
        None if c.faults else f"{c.id}: no HTTP requests, nothing for the fault proxy to fault"
    ),
)


@dataclass
class Ckpt:
    """A fresh checkpoint location on one store, and what the tests look at it with."""

    case: StoreCase
    url: str
    options: dict | None
    endpoint: str | None
    _fs: tuple[Any, str] | None = field(default=None, repr=False, compare=False)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fs": None}  # the ranks it is sent to make their own

    def writer(
        self, cls: type[HFStorageWriter] = HFStorageWriter, **kwargs: Any
    ) -> HFStorageWriter:
        return cls(self.url, storage_options=self.options, **{**self.case.writer, **kwargs})

    def reader(self, **kwargs: Any) -> HFStorageReader:
        return HFStorageReader(self.url, storage_options=self.options, **kwargs)

    def fs(self) -> tuple[Any, str]:
        """A filesystem of the test's own (never the instance the library is handed), its caches
        emptied before every look: it sees the store as it is. And the folder's path in it."""
        if self._fs is None:
            opts = dict(self.options or {})
            if "://" in self.url and not self.url.startswith(("file://", "memory://")):
                opts["skip_instance_cache"] = True
            self._fs = fsspec.core.url_to_fs(self.url, **opts)
        fs, root = self._fs
        fs.invalidate_cache()
        return fs, root

    def names(self) -> list[str]:
        """The relative name of every object under the folder (one listing)."""
        fs, root = self.fs()
        base = root.rstrip("/") + "/"
        return sorted(p[len(base) :] for p in fs.find(root)) if fs.exists(root) else []

    def files(self) -> dict[str, bytes]:
        """``relative name -> bytes`` of every object under the folder."""
        fs, root = self.fs()
        return {name: fs.cat_file(f"{root.rstrip('/')}/{name}") for name in self.names()}

    def unfinished(self, names: list[str]) -> list[str]:
        """What a listing does not show: S3's open multipart uploads under the folder, Azure's
        uncommitted blocks of the blobs ``names`` (and of every ``model-0000k-of-0000N`` name,
        N <= 4: Azurite lists no blob that has only uncommitted blocks)."""
        fs, root = self.fs()
        if self.url.startswith("s3://"):
            bucket, _, prefix = root.partition("/")
            return sorted(
                u["Key"]
                for u in fs.list_multipart_uploads(bucket)
                if u["Key"].startswith(prefix + "/")
            )
        if not self.url.startswith("az://"):
            return []
        from fsspec.asyn import sync

        candidates = set(names) | {
            f"model-{k:05d}-of-{n:05d}.safetensors" for n in range(1, 5) for k in range(1, n + 1)
        }

        async def count(name: str) -> int:
            container, _, blob = f"{root}/{name}".partition("/")
            async with fs.service_client.get_blob_client(container, blob) as bc:
                try:
                    return len((await bc.get_block_list("uncommitted"))[1])
                except Exception:  # noqa: BLE001 - no such blob: nothing uncommitted
                    return 0

        async def every() -> list[tuple[str, int]]:
            import asyncio

            names_ = sorted(candidates)
            return list(zip(names_, await asyncio.gather(*(count(n) for n in names_)), strict=True))

        return [f"{n} (uncommitted blocks)" for n, c in sync(fs.loop, every) if c]

    def assert_only(self, expected: list[str]) -> None:
        """The folder holds exactly ``expected`` (no staging, no stale shard), and nothing is left
        unfinished on the server (no open upload, no uncommitted block)."""
        names = self.names()
        assert names == sorted(expected), f"{self.case.id}: {names}, expected {sorted(expected)}"
        assert self.unfinished(names) == []

    def fails_unfinished(self, dest: dict[str, torch.Tensor]) -> None:
        """Loading the folder fails, saying that the save is unfinished."""
        with raises_in_checkpoint(AssertionError, UNFINISHED):
            dcp.load(dest, storage_reader=self.reader(), no_dist=True)


@pytest.fixture(scope="module")
def proxies() -> Iterator[Callable[[str], FaultProxy]]:
    """``proxy(upstream)``: one fault proxy per server, made when first asked, closed at the end."""
    made: dict[str, FaultProxy] = {}

    def proxy(upstream: str) -> FaultProxy:
        if upstream not in made:
            made[upstream] = FaultProxy(upstream=upstream)
        return made[upstream]

    yield proxy
    for p in made.values():
        p.close()
    assert [e for p in made.values() for e in p.errors] == []


@pytest.fixture
def store(
    request: pytest.FixtureRequest, case: StoreCase, s3_endpoint: str, tmp_path: Path
) -> Iterator[Ckpt]:
    """A fresh checkpoint location on ``case``'s store (its bucket removed afterwards).

    ``s3_endpoint``: the server the case is tied to (``_over``), started once per session
    whatever the store; the S3 cases' fresh bucket (the ``s3`` fixture) is on it."""
    name = f"ckpt-{uuid.uuid4().hex[:8]}"
    if case.root == "local":
        yield Ckpt(case, str(tmp_path / name), None, None)
    elif case.root == "file":
        yield Ckpt(case, f"file://{tmp_path}/{name}", None, None)
    elif case.root == "memory":
        top = f"/{uuid.uuid4().hex}"
        yield Ckpt(case, f"memory://{top}/{name}", None, None)
        memory = fsspec.filesystem("memory")
        if memory.exists(top):
            memory.rm(top, recursive=True)
    else:
        bucket, options = request.getfixturevalue(case.root)
        yield Ckpt(
            case,
            f"{bucket}/{name}",
            options,
            request.getfixturevalue(case.endpoint) if case.endpoint else None,
        )


# -- what is saved ---------------------------------------------------------------------------------

# name -> (shape, dtype, placement saving on 2 ranks, placement loading on 2 ranks)
KEYS: dict[str, tuple[tuple[int, ...], torch.dtype, str, str]] = {
    # 10.5 MiB as bf16, its own file: 5.25 MiB of each rank, runs that become the ranks' own
    # parts (S3 takes parts of 5 MiB or more: a multipart upload; GCS part objects and Azure
    # blocks, of 1 MiB or more).
    "emb": ((5376, 1024), torch.float32, "S0", "S1"),
    # 12 KiB, its own file: one run of each rank per row, interleaved.
    "layers.0.attn.w": ((96, 64), torch.float32, "S1", "S0"),
    # the third file: small runs of both ranks.
    "layers.0.mlp.w": ((33, 17), torch.float32, "S0", "R"),
    "layers.0.norm": ((64,), torch.float32, "R", "S0"),
    "step": ((), torch.int64, "plain", "plain"),
}
KEY_MAPPING = {
    "emb": "model.embed_tokens.weight",
    "layers.0.attn.w": "model.layers.0.self_attn.q_proj.weight",
}
MAX_SHARD = "8KB"  # tensors over it get a file of their own


def _full(seed: int) -> dict[str, torch.Tensor]:
    return {
        k: random_tensor(shape, dtype, seed * 1000 + i)
        for i, (k, (shape, dtype, _, _)) in enumerate(KEYS.items())
    }


def _as_saved(seed: int) -> dict[str, torch.Tensor]:
    """What the files hold: HF names, floats as bf16."""
    return {
        KEY_MAPPING.get(k, k): v.to(torch.bfloat16) if v.is_floating_point() else v
        for k, v in _full(seed).items()
    }


def _as_loaded(seed: int) -> dict[str, torch.Tensor]:
    """What a load into the original dtypes gives: the bf16 values, widened back."""
    return {
        k: v.to(torch.bfloat16).to(v.dtype) if v.is_floating_point() else v
        for k, v in _full(seed).items()
    }


def _distribute(full: Mapping[str, torch.Tensor], world: int, which: int) -> dict[str, Any]:
    """``which``: 2 the saving placements, 3 the loading ones; plain tensors for one process."""
    if world == 1:
        return {k: v.clone() for k, v in full.items()}
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    placements = {"S0": Shard(0), "S1": Shard(1), "R": Replicate()}
    # src_data_rank=None: each rank cuts its part from its own copy (no collective).
    return {
        k: v.clone()
        if KEYS[k][which] == "plain"
        else distribute_tensor(v, mesh, [placements[KEYS[k][which]]], src_data_rank=None)
        for k, v in full.items()
    }


def _local(value: Any) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return value.to_local() if isinstance(value, DTensor) else value


def _round_trip(rank: int, world: int, ckpt: Ckpt, seed: int) -> None:
    """(every rank) Save bf16 with the key mapping; load resharded into the original dtypes."""
    no_dist = world == 1
    dcp.save(
        _distribute(_full(seed), world, 2),
        storage_writer=ckpt.writer(max_shard_size=MAX_SHARD),
        planner=HFSavePlanner(key_mapping=KEY_MAPPING, save_dtype=torch.bfloat16),
        no_dist=no_dist,
    )
    dest = _distribute({k: torch.zeros_like(v) for k, v in _full(seed).items()}, world, 3)
    dcp.load(
        dest,
        storage_reader=ckpt.reader(verify=True),
        planner=HFLoadPlanner(key_mapping=KEY_MAPPING),
        no_dist=no_dist,
    )
    want = _distribute(_as_loaded(seed), world, 3)
    for k in KEYS:
        assert_same(
            _local(dest[k]),
            _local(want[k]).contiguous(),
            f"rank {rank}/{world}: {k!r} loaded from {ckpt.case.id}",
        )


def _bare_save(
    rank: int, world: int, ckpt: Ckpt, seed: int, kill: str | None, retry: RetryPolicy | None = None
) -> None:
    """(every rank) Save ``_full(seed)`` as bf16; ``kill``: die (the whole job) at that moment."""
    if kill is not None:
        arm(kill, "job", rank)
    dcp.save(
        _distribute(_full(seed), world, 2),
        storage_writer=ckpt.writer(max_shard_size=MAX_SHARD, rank_timeout=6.0, retry=retry),
        planner=HFSavePlanner(key_mapping=KEY_MAPPING, save_dtype=torch.bfloat16),
        no_dist=world == 1,
    )


def _loads(ckpt: Ckpt, seed: int) -> None:
    """One process loads the checkpoint whole, every CRC32 checked: ``_as_loaded(seed)``."""
    dest = {k: torch.zeros_like(v) for k, v in _full(seed).items()}
    dcp.load(
        dest,
        storage_reader=ckpt.reader(verify=True),
        planner=HFLoadPlanner(key_mapping=KEY_MAPPING),
        no_dist=True,
    )
    for k, v in _as_loaded(seed).items():
        assert_same(dest[k], v, f"{ckpt.case.id}: {k!r}")


def _layout() -> list[str]:
    """The files a save of ``KEYS`` makes (``MAX_SHARD``): emb, the attention weight, the rest."""
    return [f"model-{k:05d}-of-00003.safetensors" for k in (1, 2, 3)]


# -- the contract ----------------------------------------------------------------------------------


@every_store
@pytest.mark.distributed
def test_two_ranks_round_trip(store: Ckpt, tmp_path: Path) -> None:
    """Saved on 2 ranks (1 for a store private to a process), loaded resharded: the same bits;
    the files, fetched through fsspec, read with safetensors and agree with the index."""
    if store.case.one_process:
        _round_trip(0, 1, store, 1)
    else:
        run_job(_round_trip, 2, store, 1, timeout=JOB_TIMEOUT).check_returned()
    store.assert_only([*_layout(), INDEX])
    files = store.files()
    fetched = tmp_path / "fetched"
    fetched.mkdir()
    for name, data in files.items():
        (fetched / name).write_bytes(data)
    # safetensors itself: each file opens and holds the keys the index maps to it, as saved.
    index = json.loads(files[INDEX])
    want = _as_saved(1)
    assert (
        sorted(index["weight_map"]) == sorted(want)
        and sorted(set(index["weight_map"].values())) == _layout()
    )
    for name in _layout():
        with safe_open(str(fetched / name), framework="pt") as f:
            keys = sorted(f.keys())
            assert keys == sorted(k for k, v in index["weight_map"].items() if v == name), (
                name,
                keys,
            )
            for key in keys:
                assert_same(f.get_tensor(key), want[key], f"{name}: {key!r}")
    tensors, _ = read_checkpoint(fetched)  # total_size, one file per key, the CRC32 of every tensor
    assert sorted(tensors) == sorted(want)


@every_store
@pytest.mark.distributed
@pytest.mark.parametrize("moment", ["before-index", "early-write"])
def test_the_index_is_written_last(store: Ckpt, moment: str) -> None:
    """A 2-rank save killed (SIGKILL, every rank) is no checkpoint: ``before-index``, once every
    file is whole, just before the index (every byte is there: only the commit is missing);
    ``early-write``, once a rank wrote its first slab (S3's multipart uploads are open, Azure
    may hold uncommitted blocks). The next save to the path (no ``overwrite``: nothing was
    committed) succeeds and leaves exactly its files and index, nothing unfinished."""
    if store.case.one_process:
        pytest.skip(
            f"{store.case.id}: a store private to one process dies with it (nothing to look at "
            "after a kill)"
        )
    ends = run_job(_bare_save, 2, store, 1, moment, timeout=JOB_TIMEOUT)
    assert ends.how() == ["killed", "killed"], [(e.how, e.error[-2000:]) for e in ends.ranks]
    if moment == "before-index":
        left = store.files()
        assert INDEX not in left, sorted(left)
        # Everything but the commit: the three files whole, each a valid safetensors file with
        # exactly the saved tensors (the save's records and staged bytes beside them).
        on_store = {}
        for name in _layout():
            assert name in left, sorted(left)
            on_store.update(st_load(left[name]))
        assert sorted(on_store) == sorted(_as_saved(1))
        for key, want in _as_saved(1).items():
            assert_same(on_store[key], want, f"{key!r} of the killed save")
    else:
        assert INDEX not in store.names()
    store.fails_unfinished({k: torch.zeros_like(v) for k, v in _full(1).items()})
    _bare_save(0, 1, store, 2, None)
    store.assert_only([*_layout(), INDEX])
    _loads(store, 2)


class _FailingPlanner(DefaultSavePlanner):
    """Raises while the writer pulls one tensor's bytes: a failure in the middle of
    ``write_data``."""

    def resolve_data(self, write_item):
        if write_item.index.fqn == "boom":
            raise OSError("disk on fire")
        return super().resolve_data(write_item)


class _FailsAfterWriting(HFStorageWriter):
    """Fails once its rank's bytes are written, before the commit: what the library leaves
    when the job is lost between the writes and ``finish``."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        super().write_data(plan, planner).wait()
        raise OSError("the job was lost after writing")


@every_store
def test_overwrite(store: Ckpt) -> None:
    """Refused without ``overwrite=True`` (old bytes kept), replaced with it (stale shards gone);
    a failed overwrite leaves no index and nothing unfinished; a save lost after its writes
    leaves no index; the next save clears what both left."""
    first = {
        "a": random_tensor((64, 8), torch.float32, 1),
        "b": random_tensor((64, 8), torch.float32, 2),
    }
    dcp.save(first, storage_writer=store.writer(max_shard_size=2048), no_dist=True)
    store.assert_only(
        ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", INDEX]
    )
    before = store.files()

    second = {"a": random_tensor((64, 8), torch.float32, 3)}
    with raises_in_checkpoint(
        FileExistsError,
        r"already holds a complete checkpoint \(model.safetensors.index.json\);"
        r" pass HFStorageWriter\(..., overwrite=True\)",
    ):
        dcp.save(second, storage_writer=store.writer(), no_dist=True)
    assert store.files() == before
    # Refused before anything is written: the old checkpoint is untouched, even with overwrite.
    with raises_in_checkpoint(
        ValueError, r"dtype torch.complex128 of 'z' cannot be stored in safetensors"
    ):
        dcp.save(
            {**second, "z": torch.zeros(2, dtype=torch.complex128)},
            storage_writer=store.writer(overwrite=True),
            no_dist=True,
        )
    assert store.files() == before

    dcp.save(second, storage_writer=store.writer(overwrite=True), no_dist=True)
    store.assert_only(["model-00001-of-00001.safetensors", INDEX])
    out = {"a": torch.zeros(64, 8)}
    dcp.load(out, storage_reader=store.reader(verify=True), no_dist=True)
    assert_same(out["a"], second["a"], "a after the overwrite")

    # A save that fails in its write (a tensor's bytes cannot be had; in one process that comes
    # before any upload): the index went first, so the folder is no checkpoint (never old
    # files and new ones under an index), and nothing of the save is left unfinished or in
    # part objects; its record may stay until the next save.
    broken = {
        "a": random_tensor((64, 8), torch.float32, 4),
        "boom": torch.ones(8),
        "z": torch.ones(8),
    }
    with raises_in_checkpoint(OSError, "disk on fire"):
        dcp.save(
            broken,
            storage_writer=store.writer(overwrite=True),
            planner=_FailingPlanner(),
            no_dist=True,
        )
    left = store.names()
    assert INDEX not in left, left
    assert store.unfinished(left) == [] and not [n for n in left if "/parts/" in n], left
    store.fails_unfinished({"a": torch.zeros(64, 8)})
    # A save that fails once every byte is written, where the library does not see it (between
    # the writes and the commit, as a lost job): what it wrote stays (files, parts, blocks;
    # "big", 6.25 MiB, makes GCS part objects and Azure blocks), with no index.
    written = {
        "a": random_tensor((64, 8), torch.float32, 8),
        "big": random_tensor((1600, 1024), torch.float32, 7),
    }
    with raises_in_checkpoint(OSError, "the job was lost after writing"):
        dcp.save(written, storage_writer=store.writer(_FailsAfterWriting), no_dist=True)
    assert INDEX not in store.names()
    store.fails_unfinished({k: torch.zeros_like(v) for k, v in written.items()})
    # The next save (no overwrite: nothing is committed) clears all of it.
    third = {
        "a": random_tensor((64, 8), torch.float32, 5),
        "c": random_tensor((3, 3), torch.float32, 6),
    }
    dcp.save(third, storage_writer=store.writer(), no_dist=True)
    store.assert_only(["model-00001-of-00001.safetensors", INDEX])
    out = {k: torch.zeros_like(v) for k, v in third.items()}
    dcp.load(out, storage_reader=store.reader(verify=True), no_dist=True)
    for k, v in third.items():
        assert_same(out[k], v, f"{k} after the save that followed the failed one")


@stores_over_http
def test_transient_faults_are_retried(
    store: Ckpt, proxies: Callable[[str], FaultProxy], tmp_path: Path
) -> None:
    """A save through transient faults on its data, its index write, and a load through faults
    on its reads: the same bytes as a save on local disk, every fault fired once."""
    case = store.case
    assert case.faults is not None and case.through is not None and store.endpoint is not None
    proxy = proxies(case.upstream(store.endpoint))
    proxy.clear()
    through = Ckpt(case, store.url, case.through(proxy.endpoint), store.endpoint)
    m = case.faults
    faults = [
        proxy.add_fault(Fault("503", **m["data"], times=1)),
        proxy.add_fault(Fault("reset", **m["data"], times=1)),
        *([proxy.add_fault(Fault("500", **m["assemble"], times=1))] if "assemble" in m else []),
        proxy.add_fault(Fault("500", **m["commit"], times=1)),
    ]
    seed = 3
    _bare_save(0, 1, through, seed, None, FAST_RETRY)
    assert [f.fired for f in faults] == [1] * len(faults), [
        (r.method, r.path, r.query, r.status) for r in proxy.requests
    ]
    local = Ckpt(StoreCase("local", "local"), str(tmp_path / "local"), None, None)
    _bare_save(0, 1, local, seed, None)
    store.assert_only([*_layout(), INDEX])
    assert store.files() == local.files()  # byte for byte, what positioned writes on disk made
    proxy.clear()
    reads = [
        proxy.add_fault(Fault("503", **m["read"], times=1)),
        proxy.add_fault(Fault("reset", **m["read"], times=1)),
        proxy.add_fault(Fault("truncate", **m["read"], times=1)),
    ]
    dest = {k: torch.zeros_like(v) for k, v in _full(seed).items()}
    dcp.load(
        dest,
        storage_reader=through.reader(verify=True, retry=FAST_RETRY),
        planner=HFLoadPlanner(key_mapping=KEY_MAPPING),
        no_dist=True,
    )
    assert [f.fired for f in reads] == [1, 1, 1]
    for k, v in _as_loaded(seed).items():
        assert_same(dest[k], v, f"{case.id}: {k!r} loaded through faults")
    proxy.clear()
    assert proxy.errors == []
