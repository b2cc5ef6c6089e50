"""Multi-rank save/load through real gloo process groups: save on 4 ranks, load on 1, 2, 3 (and 4).

One 4-rank spawn (the module fixture ``saved4``) saves one state dict that covers every
layout case four ways (direct, staged, and key-mapped/bf16 direct and staged) and reloads it on
4 ranks with different shardings, recording what it saw. The tests then check the files in
this process with ``safetensors`` itself. One spawn per other world size (1, 2, 3) loads the
4-rank checkpoint into differently sharded destinations and saves it again ("and back"); the
files must be byte-identical to the 4-rank ones.

Originals are a pure function of the key name (``_data.random_tensor``), so every rank and the
checker rebuild them independently.
"""

from __future__ import annotations

import json
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from hf_dcp_storage import HFLoadPlanner, HFSavePlanner, HFStorageReader, HFStorageWriter
from hf_dcp_storage.session.records import RankRecord, rank_record_name
from tests.support.data import (
    ALL_DTYPES,
    DTYPE_IDS,
    assert_same,
    assert_same_files,
    random_tensor,
    read_checkpoint,
    seed_of,
)
from tests.support.dist import run_ranks

pytestmark = pytest.mark.distributed

SAVE_WORLD = 4
# Small enough that the ~30 KB checkpoint spreads over several files; the 16 KB tensor is
# larger than this and must get a file of its own.
MAX_SHARD = 6000
STAGING_DIR = ".hf_dcp_staging"


# -- the state dict -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Key:
    """One state-dict entry and how the 4-rank save holds it.

    kind:
        ``mesh1``: DTensor on the 1-D mesh of 4 ranks with ``placements``;
        ``mesh2``: DTensor on the 2x2 mesh (dp, tp) with ``placements``;
        ``plain``: the same plain tensor on every rank (replicated: must be written once);
        ``owners``: a plain tensor only ranks ``owners`` hold;
        ``tied``: the very same object as key ``tied_to`` (two keys, one storage).
    layout:
        ``contig``; ``transposed``: the original is a transposed (non-contiguous) view;
        ``strided``: the original is a column-strided view ``x[:, ::2]``;
        ``noncontig_local``: a DTensor whose local shard is non-contiguous.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    kind: str = "plain"
    placements: tuple[Placement, ...] = ()
    owners: tuple[int, ...] = ()
    tied_to: str | None = None
    layout: str = "contig"


F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16

KEYS: list[Key] = [
    # 1-D mesh placements
    Key("dt.shard0", (16, 8), kind="mesh1", placements=(Shard(0),)),
    Key("dt.shard1", (6, 12), kind="mesh1", placements=(Shard(1),)),
    Key("dt.replicate", (8,), kind="mesh1", placements=(Replicate(),)),
    Key("dt.replicate_2d", (3, 5), F64, kind="mesh1", placements=(Replicate(),)),
    # uneven shards: 7 rows over 4 -> 2,2,2,1; 5 rows over 4 -> 2,2,1,0 (an empty shard); 3 cols
    # over 4 -> 1,1,1,0
    Key("uneven.rows7_over4", (7, 3), kind="mesh1", placements=(Shard(0),)),
    Key("uneven.rows5_over4", (5, 4), kind="mesh1", placements=(Shard(0),)),
    Key("uneven.cols3_over4", (4, 3), kind="mesh1", placements=(Shard(1),)),
    # 7 rows over the 2 tp ranks (4,3), replicated over dp
    Key("uneven.rows7_over2", (7, 5), kind="mesh2", placements=(Replicate(), Shard(0))),
    # 2-D mesh
    Key("mesh2d.s0_s1", (6, 10), kind="mesh2", placements=(Shard(0), Shard(1))),
    Key("mesh2d.s0_s1_uneven", (5, 7), kind="mesh2", placements=(Shard(0), Shard(1))),
    Key("mesh2d.s1_s0", (9, 4), F64, kind="mesh2", placements=(Shard(1), Shard(0))),
    Key("mesh2d.s0_s0", (8, 3), kind="mesh2", placements=(Shard(0), Shard(0))),
    Key("mesh2d.rep_s1", (3, 8), BF16, kind="mesh2", placements=(Replicate(), Shard(1))),
    Key("mesh2d.s1_rep_3d", (2, 4, 6), kind="mesh2", placements=(Shard(1), Replicate())),
    # 0-dim and empty
    Key("scalar.plain", ()),
    Key("scalar.int64", (), torch.int64),
    Key("scalar.dtensor", (), kind="mesh1", placements=(Replicate(),)),
    Key("empty.plain", (0, 4)),
    Key("empty.dtensor_rows", (0, 4), kind="mesh1", placements=(Shard(0),)),
    Key("empty.dtensor_cols", (3, 0), kind="mesh1", placements=(Shard(0),)),
    # non-contiguous
    Key("noncontig.transposed", (5, 3), layout="transposed"),
    Key("noncontig.strided", (4, 5), torch.int32, layout="strided"),
    Key(
        "noncontig.dtensor_local",
        (8, 6),
        kind="mesh1",
        placements=(Shard(0),),
        layout="noncontig_local",
    ),
    Key(
        "noncontig.dtensor_of_transposed",
        (6, 4),
        kind="mesh1",
        placements=(Shard(1),),
        layout="transposed",
    ),
    # tied weights
    Key("tied.embed", (10, 4)),
    Key("tied.lm_head", (10, 4), kind="tied", tied_to="tied.embed"),
    Key("tied.dt_a", (8, 4), kind="mesh1", placements=(Shard(0),)),
    Key("tied.dt_b", (8, 4), kind="tied", tied_to="tied.dt_a"),
    # large enough to exceed MAX_SHARD / fill files
    Key("big.rows", (64, 64), kind="mesh1", placements=(Shard(0),)),
    Key("big.cols", (32, 96), BF16, kind="mesh1", placements=(Shard(1),)),
    # dtype matrix: an uneven row shard on the 1-D mesh, a 2-D mesh shard, and a plain scalar each
    *[
        k
        for dtype, tag in zip(ALL_DTYPES, DTYPE_IDS, strict=True)
        for k in (
            Key(f"dtype.{tag}.rows", (5, 3), dtype, kind="mesh1", placements=(Shard(0),)),
            Key(
                f"dtype.{tag}.mesh2d", (2, 7), dtype, kind="mesh2", placements=(Shard(1), Shard(0))
            ),
            Key(f"dtype.{tag}.scalar", (), dtype),
        )
    ],
    # keys that only some ranks hold; last, each rank's in canonical order (see _owners_in)
    Key("partial.ranks0and2", (6,), kind="owners", owners=(0, 2)),
    Key("partial.rank0", (2, 3), torch.int16, kind="owners", owners=(0,)),
    Key("partial.rank1", (3, 3), kind="owners", owners=(1,)),
    Key("partial.rank2", (4, 3), F64, kind="owners", owners=(2,)),
    Key("partial.rank3", (5,), torch.uint8, kind="owners", owners=(3,)),
]
BY_NAME = {k.name: k for k in KEYS}

# Rename every other key (the dict form keeps the rest), as a trainer -> HF mapping would.
KEY_MAPPING = {k.name: f"model.{k.name}" for i, k in enumerate(KEYS) if i % 2 == 0}


def original(key: Key) -> torch.Tensor:
    """The full (global) tensor of ``key``; the same on every rank and in the checker."""
    if key.kind == "tied":
        return original(BY_NAME[key.tied_to])
    seed = seed_of(key.name)
    if key.layout == "transposed":
        return random_tensor(key.shape[::-1], key.dtype, seed).t()
    if key.layout == "strided":
        rows, cols = key.shape
        return random_tensor((rows, 2 * cols), key.dtype, seed)[:, ::2]
    return random_tensor(key.shape, key.dtype, seed)


def originals() -> dict[str, torch.Tensor]:
    return {k.name: original(k) for k in KEYS}


def bf16_rounded(t: torch.Tensor) -> torch.Tensor:
    """What ``save_dtype=torch.bfloat16`` stores for ``t``."""
    return t.to(torch.bfloat16) if t.dtype.is_floating_point else t


def _owners_in(key: Key, world: int) -> set[int]:
    """Ranks that hold an ``owners`` key in a ``world``-rank job.

    4-rank owner r becomes r * world // 4: monotonic, so each key is first seen on the same
    relative rank order and the layout's key order (rank 0's keys, then those first seen on
    rank 1, ...) stays the canonical one; the "and back" files can then be byte-identical.
    """
    return {r * world // SAVE_WORLD for r in key.owners}


def _shard(full: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...]) -> DTensor:
    # src_data_rank=None: every rank cuts its own shard from its own copy; no collective, so
    # dtypes gloo cannot communicate (float8, uint16...) work too.
    return distribute_tensor(full, mesh, list(placements), src_data_rank=None)


def build_saved_state_dict(
    rank: int, mesh1: DeviceMesh, mesh2: DeviceMesh
) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s state dict for the 4-rank save, in canonical key order."""
    sd: dict[str, torch.Tensor] = {}
    for key in KEYS:
        if key.kind == "tied":
            sd[key.name] = sd[key.tied_to]  # the same object: shared storage
        elif key.kind == "owners":
            if rank in key.owners:
                sd[key.name] = original(key)
        elif key.kind == "plain":
            sd[key.name] = original(key)
        else:
            mesh = mesh1 if key.kind == "mesh1" else mesh2
            dt = _shard(original(key), mesh, key.placements)
            if key.layout == "noncontig_local":
                local = dt.to_local().t().contiguous().t()  # same values, column-major strides
                assert not local.is_contiguous()
                dt = DTensor.from_local(
                    local, mesh, key.placements, run_check=False, shape=dt.shape, stride=dt.stride()
                )
            sd[key.name] = dt
    return sd


# -- destinations for loading ----------------------------------------------------------------------


def dest_placement(key: Key, position: int, world: int) -> Placement | str:
    """How a ``world``-rank job holds ``key`` when loading: a 1-D mesh placement or ``"plain"``.

    Rotates through the options with the key's position and the world size, so every key is
    loaded differently than it was saved in at least some world sizes (Shard(0) saved -> Shard(1)
    loaded, sharded saved -> plain loaded, plain saved -> sharded loaded...).
    """
    ndim = len(key.shape)
    options: list[Placement | str]
    if ndim == 0:
        options = ["plain", Replicate()]
    elif ndim == 1:
        options = [Shard(0), "plain", Replicate()]
    else:
        options = [Shard(1), Shard(0), Replicate(), "plain"]
    return options[(position + world) % len(options)]


def build_dest_state_dict(
    rank: int, world: int, mesh: DeviceMesh
) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """Zero-filled destinations, differently sharded than the save, and how each is held."""
    sd: dict[str, torch.Tensor] = {}
    how: dict[str, object] = {}
    for position, key in enumerate(KEYS):
        if key.kind == "tied":
            sd[key.name] = sd[key.tied_to]
            how[key.name] = how[key.tied_to]
            continue
        if key.kind == "owners":
            if rank in _owners_in(key, world):
                sd[key.name], how[key.name] = torch.zeros(key.shape, dtype=key.dtype), "plain"
            continue
        if key.layout == "transposed" and key.kind == "plain":
            # A non-contiguous destination: the reader must scatter into strided memory.
            sd[key.name] = torch.zeros(key.shape[::-1], dtype=key.dtype).t()
            how[key.name] = "plain"
            continue
        placement = dest_placement(key, position, world)
        zeros = torch.zeros(key.shape, dtype=key.dtype)
        sd[key.name] = zeros if placement == "plain" else _shard(zeros, mesh, (placement,))
        how[key.name] = placement
    return sd, how


def check_dest(
    sd: dict[str, torch.Tensor],
    how: dict[str, object],
    mesh: DeviceMesh,
    where: str,
    rounded: bool = False,
) -> list[tuple[str, str]]:
    """``(key, message)`` for every destination that does not hold its original (or bf16-rounded)
    data."""
    problems = []
    for name, value in sd.items():
        full = original(BY_NAME[name])
        if rounded:
            full = bf16_rounded(full).to(full.dtype)
        placement = how[name]
        expected = full if placement == "plain" else _shard(full, mesh, (placement,)).to_local()  # type: ignore[arg-type]
        actual = value if placement == "plain" else value.to_local()  # type: ignore[union-attr]
        try:
            assert_same(actual, expected, f"{where}: {name!r} loaded as {placement}")
        except AssertionError as exc:
            problems.append((name, str(exc)))
    return problems


def check_unchanged(sd: dict[str, torch.Tensor], where: str) -> list[tuple[str, str]]:
    """Saving must not modify the caller's tensors (no in-place cast, no resize)."""
    problems = []
    for name, value in sd.items():
        if isinstance(value, DTensor):
            continue  # the caller compares local shards against copies taken before saving
        try:
            assert_same(value, original(BY_NAME[name]), f"{where}: {name!r}")
        except AssertionError as exc:
            problems.append((name, str(exc)))
    return problems


# -- rank functions (module level: spawned children import them) --------------------------------


class _RecordingWriter(HFStorageWriter):
    """``HFStorageWriter`` that also records, outside the checkpoint, which rank wrote what."""

    def __init__(self, path: str, record_to: str, **kwargs: object) -> None:
        super().__init__(path, **kwargs)  # type: ignore[arg-type]
        self.record_to = record_to

    def finish(self, metadata, results):  # type: ignore[no-untyped-def]
        # What each rank recorded having written (its record, read before the commit removes it).
        staging = Path(self.root) / STAGING_DIR
        written = [
            {"rank": rank, "key": item.key, "offset": list(item.offsets), "bytes": item.nbytes}
            for rank in range(len(results))
            for item in RankRecord.decode(
                (staging / rank_record_name(rank)).read_bytes(), "test"
            ).items
        ]
        Path(self.record_to).write_text(json.dumps(written))
        super().finish(metadata, results)


def _save_on_4_ranks(rank: int, world: int, root: str) -> None:
    assert world == SAVE_WORLD
    out = Path(root)
    mesh1 = init_device_mesh("cpu", (world,))
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    sd = build_saved_state_dict(rank, mesh1, mesh2)
    expected_locals = {n: v.to_local().clone() for n, v in sd.items() if isinstance(v, DTensor)}

    dcp.save(
        sd,
        storage_writer=_RecordingWriter(
            str(out / "direct"), str(out / "written_direct.json"), max_shard_size=MAX_SHARD
        ),
    )
    dcp.save(
        sd,
        storage_writer=_RecordingWriter(
            str(out / "staged"),
            str(out / "written_staged.json"),
            max_shard_size=MAX_SHARD,
            direct_write=False,
            thread_count=2,
        ),
    )
    for name, direct_write in (("mapped_direct", None), ("mapped_staged", False)):
        dcp.save(
            sd,
            storage_writer=HFStorageWriter(
                str(out / name), max_shard_size=MAX_SHARD, direct_write=direct_write
            ),
            planner=HFSavePlanner(key_mapping=KEY_MAPPING, save_dtype=torch.bfloat16),
        )

    report: dict[str, list] = {"unchanged": check_unchanged(sd, f"rank {rank} after saving")}
    for name, local in expected_locals.items():
        try:
            assert_same(
                sd[name].to_local(), local, f"rank {rank} after saving: local shard of {name!r}"
            )
        except AssertionError as exc:
            report["unchanged"].append((name, str(exc)))

    # Reload on the same 4 ranks, resharded onto the 1-D mesh (e.g. Shard(1) where saved Shard(0)).
    for stage, folder, planner, rounded in (
        ("reload", "direct", None, False),
        ("reload_mapped", "mapped_staged", HFLoadPlanner(key_mapping=KEY_MAPPING), True),
    ):
        dest, how = build_dest_state_dict(rank, world, mesh1)
        try:
            dcp.load(dest, storage_reader=HFStorageReader(str(out / folder)), planner=planner)
        except BaseException:  # noqa: BLE001 - CheckpointException; reported to the test below
            report[stage] = [
                ("*", f"rank {rank}: dcp.load({folder}) raised:\n{traceback.format_exc()}")
            ]
            continue
        report[stage] = check_dest(
            dest, how, mesh1, f"rank {rank} of {world}, {folder}", rounded=rounded
        )
    (out / f"report_rank{rank}.json").write_text(json.dumps(report))


def _load_and_save_back(rank: int, world: int, ckpt4: str, out: str) -> None:
    """Load the 4-rank checkpoint on ``world`` ranks, check, then save it again from here."""
    mesh = init_device_mesh("cpu", (world,))
    problems: list[tuple[str, str]] = []

    dest, how = build_dest_state_dict(rank, world, mesh)
    dcp.load(dest, storage_reader=HFStorageReader(str(Path(ckpt4) / "direct")))
    problems += check_dest(dest, how, mesh, f"rank {rank} of {world}, direct")

    # The bf16 key-mapped save, through HFLoadPlanner with the mapping given as a callable
    # this time (the 4-rank reload uses the dict form).
    mapped, how_mapped = build_dest_state_dict(rank, world, mesh)
    dcp.load(
        mapped,
        storage_reader=HFStorageReader(str(Path(ckpt4) / "mapped_direct"), thread_count=1),
        planner=HFLoadPlanner(key_mapping=lambda fqn: KEY_MAPPING.get(fqn, fqn)),
    )
    problems += check_dest(
        mapped, how_mapped, mesh, f"rank {rank} of {world}, mapped_direct", rounded=True
    )
    assert not problems, "\n".join(msg for _, msg in problems)

    # ... and back: what was loaded, saved from this world size, must give the same files.
    dcp.save(
        dest,
        storage_writer=HFStorageWriter(str(Path(out) / "back_direct"), max_shard_size=MAX_SHARD),
    )
    dcp.save(
        dest,
        storage_writer=HFStorageWriter(
            str(Path(out) / "back_staged"), max_shard_size=MAX_SHARD, direct_write=False
        ),
    )


# -- tests ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Root holding the 4-rank saves (direct, staged, mapped_direct, mapped_staged) and reports."""
    root = tmp_path_factory.mktemp("saved4")
    run_ranks(_save_on_4_ranks, SAVE_WORLD, str(root))
    return root


def _report(root: Path, stage: str) -> list[tuple[str, str]]:
    out = []
    for rank in range(SAVE_WORLD):
        out += [tuple(p) for p in json.loads((root / f"report_rank{rank}.json").read_text())[stage]]
    return out


@pytest.mark.parametrize("variant", ["direct", "staged"])
def test_files_hold_every_original_tensor(saved4: Path, variant: str) -> None:
    tensors, index = read_checkpoint(saved4 / variant)
    expected = originals()
    assert sorted(tensors) == sorted(expected)
    for name in expected:
        assert_same(
            tensors[name],
            expected[name],
            f"{variant}: {name!r} ({BY_NAME[name].kind}, {BY_NAME[name].layout})",
        )
    # the commit leaves only the shards and the index behind (no staging folder, no temp files)
    names = sorted(p.name for p in (saved4 / variant).iterdir())
    assert names == sorted({*index["weight_map"].values(), "model.safetensors.index.json"})


def test_direct_and_staged_files_are_byte_identical(saved4: Path) -> None:
    assert_same_files(saved4 / "staged", saved4 / "direct")
    assert_same_files(saved4 / "mapped_staged", saved4 / "mapped_direct")


def test_max_shard_size_gives_several_files(saved4: Path) -> None:
    tensors, index = read_checkpoint(saved4 / "direct")
    files = sorted(set(index["weight_map"].values()))
    n = len(files)
    assert n >= 3, files
    assert files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    for file in files:
        keys = [k for k, f in index["weight_map"].items() if f == file]
        nbytes = sum(tensors[k].numel() * tensors[k].element_size() for k in keys)
        assert nbytes <= MAX_SHARD or len(keys) == 1, (
            f"{file}: {nbytes} bytes of tensors in {len(keys)} keys"
        )
    # the 16 KB tensor exceeds MAX_SHARD: it gets a file of its own
    big = index["weight_map"]["big.rows"]
    assert [k for k, f in index["weight_map"].items() if f == big] == ["big.rows"]


@pytest.mark.parametrize("variant", ["direct", "staged"])
def test_every_byte_written_exactly_once(saved4: Path, variant: str) -> None:
    """Replicated tensors (plain on all ranks, Replicate DTensors, dp-replicated) are written by one
    rank."""
    written = json.loads((saved4 / f"written_{variant}.json").read_text())
    per_key: dict[str, list[dict]] = {}
    for w in written:
        per_key.setdefault(w["key"], []).append(w)
    expected = originals()
    assert set(per_key) <= set(expected), sorted(set(per_key) - set(expected))
    for name, t in expected.items():
        ws = per_key.get(name, [])
        offsets = [tuple(w["offset"]) for w in ws]
        assert len(offsets) == len(set(offsets)), (
            f"{name!r}: the same chunk was written twice: {ws}"
        )
        total = sum(w["bytes"] for w in ws)
        assert total == t.numel() * t.element_size(), (
            f"{name!r}: {total} bytes written for a {t.numel() * t.element_size()}-byte tensor: "
            f"{ws}"
        )
    for name in (
        "dt.replicate",
        "dt.replicate_2d",
        "scalar.plain",
        "tied.embed",
        "noncontig.transposed",
        "partial.ranks0and2",
    ):
        assert len(per_key[name]) == 1, (
            f"replicated {name!r} written by several ranks: {per_key[name]}"
        )
    # dp-replicated tp shards: one writer per tp shard
    assert len(per_key["uneven.rows7_over2"]) == 2, per_key["uneven.rows7_over2"]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=DTYPE_IDS)
def test_dtype_saved_and_reloaded(saved4: Path, dtype: torch.dtype) -> None:
    tag = DTYPE_IDS[ALL_DTYPES.index(dtype)]
    names = [k.name for k in KEYS if k.name.startswith(f"dtype.{tag}.")]
    assert len(names) == 3
    tensors, _ = read_checkpoint(saved4 / "direct")
    for name in names:
        assert tensors[name].dtype == dtype, f"{name}: stored as {tensors[name].dtype}"
        assert_same(tensors[name], original(BY_NAME[name]), f"{tag}: {name!r}")
    problems = [msg for key, msg in _report(saved4, "reload") if key in names or key == "*"]
    assert not problems, "\n".join(problems)


def test_original_state_dict_not_modified_by_save(saved4: Path) -> None:
    problems = [msg for _, msg in _report(saved4, "unchanged")]
    assert not problems, "\n".join(problems)


def test_reload_on_4_ranks_resharded(saved4: Path) -> None:
    problems = [msg for _, msg in _report(saved4, "reload")]
    assert not problems, "\n".join(problems)


def test_key_mapping_and_bf16_save_dtype(saved4: Path) -> None:
    tensors, _ = read_checkpoint(saved4 / "mapped_direct")
    expected = {KEY_MAPPING.get(name, name): bf16_rounded(t) for name, t in originals().items()}
    assert sorted(tensors) == sorted(expected)
    assert "model.dt.shard0" in tensors and "dt.shard1" in tensors  # renamed and kept
    for name, t in expected.items():
        assert_same(tensors[name], t, f"mapped {name!r}")
    assert tensors["model.dtype.float64.rows"].dtype == torch.bfloat16
    assert tensors["dtype.int16.mesh2d"].dtype == torch.int16
    # loaded back through HFLoadPlanner (on the 4 ranks, resharded): the bf16-rounded values
    problems = [msg for _, msg in _report(saved4, "reload_mapped")]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("world", [1, 2, 3], ids=lambda w: f"world{w}")
def test_load_on_other_world_size_and_back(saved4: Path, tmp_path: Path, world: int) -> None:
    run_ranks(_load_and_save_back, world, str(saved4), str(tmp_path))
    assert_same_files(tmp_path / "back_direct", saved4 / "direct")
    assert_same_files(tmp_path / "back_staged", saved4 / "direct")


def test_key_order_is_canonical_for_owner_keys() -> None:
    """Guard for the byte-identity tests above: owner keys come last, in rank order."""
    owners = [k for k in KEYS if k.kind == "owners"]
    assert KEYS[-len(owners) :] == owners
    for world in (1, 2, 3, 4):
        firsts = [min(_owners_in(k, world)) for k in owners]
        assert firsts == sorted(firsts), (world, firsts)
