"""A soak of saves and loads to S3 through the fault proxy (``faultproxy.py``), with seeded faults.

    report = soak(upstream, n_saves, seed, multi_rank_saves=..., world=2)

``upstream`` is a moto server (``http://127.0.0.1:PORT``); the soak puts a :class:`FaultProxy`
in front of it and makes a bucket of its own. Each save gets a state dict and a fault schedule
drawn from a ``random.Random`` of the seed and the save's number (so any save can be rerun on
its own): one to three faults (503 SlowDown, 500, TCP reset, truncated
body, latency) on a kind of request (part uploads, staged objects, records, the commit,
creating or completing uploads, listings, any request), fewer fires in all than the retry
policy has attempts (``BOUNDED_FIRES``), so the save must complete; about one save in six
(``fatal_rate``) also gets a fault that fires on every attempt of a request the save surely
makes, so it must fail. Then, with a fresh s3fs client straight to moto:

* a completed save is loaded twice: through the proxy with its own bounded faults, and straight
  from moto; both must give every tensor bit-exact (bytes lost otherwise), and the folder must
  hold no ``.hf_dcp_staging/`` object and no open multipart upload;
* a failed save must leave no index and no open upload (unclean otherwise); the next save to
  the same path, without faults, must then succeed and leave neither staging objects nor
  uploads, and load bit-exact.

``n_saves`` run in this process (``dcp.save(..., no_dist=True)``); ``multi_rank_saves`` run one
after another in one ``run_ranks`` job of ``world`` gloo ranks (each rank half of every tensor,
so the staged and gathered multipart path runs), whose faults are scoped to each save's folder
by path. The loads and checks run here. Every problem found goes into ``SoakReport.problems``
with the save's number, its schedule and the error.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import tempfile
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed.checkpoint as dcp

from hf_dcp_storage import HFStorageReader, HFStorageWriter, RetryPolicy
from tests.support.data import random_tensor, same
from tests.support.dist import run_ranks
from tests.support.faultproxy import Fault, FaultProxy
from tests.support.storage_options import s3_storage_options

__all__ = ["BOUNDED_FIRES", "KINDS", "POLICY", "SoakReport", "draw_schedule", "soak"]

KINDS = ("503", "500", "reset", "truncate", "latency")
# Drawn with these weights for bounded faults; a fatal fault is one of the first three (a
# truncated answer to a PUT still completes the PUT, so it cannot make a save fail).
_KIND_WEIGHTS = (3, 2, 2, 2, 1)
_FATAL_KINDS = ("503", "500", "reset")

# Fast backoff so that a soak spends its time on requests, not sleeps.
# The deadline only bounds a broken retry loop (attempts end the retries): near the time the
# attempts take, it would fail saves "within the policy" on a loaded machine.
POLICY = RetryPolicy(max_attempts=5, base_delay=0.01, max_delay=0.1, deadline=300)
# Fires of all of a save's (or load's) bounded faults together: under the policy's attempts, so
# even if every one hits the same request, its last attempt goes through.
BOUNDED_FIRES = POLICY.max_attempts - 2
INDEX = "model.safetensors.index.json"
STAGING = ".hf_dcp_staging/"

# A kind of request: (name, method, path regex, query condition), as ``Fault`` matches them.
_Target = tuple[str, str | None, str | None, str | None]
_SAVE_TARGETS: list[_Target] = [
    ("any request", None, None, None),
    ("any PUT", "PUT", None, None),
    ("part upload", "PUT", None, "partNumber"),
    ("shard object", "PUT", r"\.safetensors$", None),
    ("staged object", "PUT", r"\.rank\d+$", None),
    ("staged read", "GET", r"\.rank\d+$", None),
    ("record", "PUT", r"\.json$", None),
    ("commit", "PUT", r"model\.safetensors\.index\.json$", None),
    ("create upload", "POST", None, "uploads"),
    ("complete upload", "POST", None, "uploadId"),
    ("any POST", "POST", None, None),
    ("any GET", "GET", None, None),  # listings, and on 2 ranks the staged reads
    ("delete", None, None, "delete"),  # the staging folder's removal (DeleteObjects)
]
# Requests every save makes (a fatal fault on one of them must fail the save); multipart
# uploads where a file has several parts (one process: a file over 16 MiB, ``RANK_PART_BYTES``),
# staged objects and their reads only on several ranks.
_FATAL_ALWAYS = ["shard object", "record", "commit"]
_FATAL_MULTIPART = ["part upload", "create upload"]
_FATAL_STAGED = ["staged object", "staged read"]
_LOAD_TARGETS: list[_Target] = [
    ("any GET", "GET", None, None),
    ("shard read", "GET", r"\.safetensors$", None),
    ("index read", "GET", r"index\.json$", None),
    ("shard HEAD", "HEAD", r"\.safetensors$", None),  # verify=True reads each file's own header
    ("any request", None, None, None),
]


@dataclass(frozen=True)
class FaultSpec:
    """One fault of a schedule, before it is scoped to a folder and handed to the proxy."""

    kind: str
    target: str
    method: str | None
    path: str | None
    query_has: str | None
    times: int | None  # None: every matching request (a fatal fault)
    seconds: float = 0.0

    def fault(self, scope: str | None) -> Fault:
        """The proxy's fault; ``scope``: only requests for objects under this
        ``/bucket/prefix/``."""
        path = self.path
        if scope is not None:
            path = "^" + scope + (".*" + self.path if self.path else "")
        return Fault(
            self.kind,
            method=self.method,
            path=path,
            query_has=self.query_has,
            times=self.times,
            seconds=self.seconds,
        )  # type: ignore[arg-type]

    def __str__(self) -> str:
        times = "always" if self.times is None else f"x{self.times}"
        extra = f" {self.seconds:.2f}s" if self.kind == "latency" else ""
        return f"{self.kind}{extra} on {self.target} {times}"


def draw_schedule(
    rng: random.Random,
    targets: list[_Target],
    *,
    first_kind: str | None = None,
    fatal: list[str] | None = None,
) -> list[FaultSpec]:
    """One to three bounded faults (``first_kind`` for the first), at most ``BOUNDED_FIRES`` fires
    in all; plus, if ``fatal`` names targets, one fault on one of them that fires on every
    attempt."""
    by_name = {t[0]: t for t in targets}
    specs: list[FaultSpec] = []
    if fatal:
        name, method, path, query = by_name[rng.choice(fatal)]
        specs.append(FaultSpec(rng.choice(_FATAL_KINDS), name, method, path, query, None))
    budget = BOUNDED_FIRES
    for i in range(rng.randint(1, 3)):
        kind = first_kind if i == 0 and first_kind else rng.choices(KINDS, _KIND_WEIGHTS)[0]
        name, method, path, query = rng.choice(targets)
        if kind == "latency":  # slows a request down, never fails it: outside the budget
            specs.append(
                FaultSpec(
                    kind,
                    name,
                    method,
                    path,
                    query,
                    rng.randint(1, 3),
                    round(rng.uniform(0.05, 0.5), 2),
                )
            )
            continue
        if budget == 0:
            continue
        times = rng.randint(1, min(2, budget))
        budget -= times
        specs.append(FaultSpec(kind, name, method, path, query, times))
    return specs


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str
    seed: int

    def make(self) -> torch.Tensor:
        return random_tensor(self.shape, getattr(torch, self.dtype), self.seed)

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


def draw_tensors(rng: random.Random, seed: int, *, world: int) -> list[TensorSpec]:
    """A state dict of 6-22 MiB: one big float32 matrix (over 5 MiB per rank: real multipart
    parts on several ranks; one process makes parts only of a file over 16 MiB), maybe a second
    mid-sized one, and two to five small tensors of mixed dtypes."""
    rows = (
        rng.randint(1536 * world, 3072) if world > 1 else rng.randint(1536, 4608)
    )  # 6 MiB per rank, or 6-18 MiB
    specs = [TensorSpec("embed.weight", (rows, 1024), "float32", seed)]
    if rng.random() < 0.5:
        specs.append(
            TensorSpec(
                "mlp.weight",
                (rng.randint(128, 512) * world, 1024),
                rng.choice(["float32", "bfloat16"]),
                seed + 1,
            )
        )
    for j in range(rng.randint(2, 5)):
        dtype = rng.choice(["float32", "bfloat16", "float16", "int64", "int8", "uint8", "bool"])
        specs.append(
            TensorSpec(
                f"layers.{j}.small",
                (rng.randint(1, 300) * world, rng.choice([1, 64, 129, 1024])),
                dtype,
                seed + 2 + j,
            )
        )
    return specs


@dataclass
class _Save:
    """One save of the soak: what it holds, its faults, and what happened."""

    number: int
    world: int
    prefix: str  # bucket/soak/sNNNN
    tensors: list[TensorSpec]
    max_shard_size: str
    schedule: list[FaultSpec]
    fatal: bool
    error: str | None = None
    fired: Counter[str] = field(default_factory=Counter)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def describe(self) -> str:
        return (
            f"save {self.number} ({self.world} rank(s), {self.nbytes / 2**20:.1f} MiB, "
            f"s3://{self.prefix}; faults: {'; '.join(map(str, self.schedule))})"
        )


@dataclass
class SoakReport:
    """What a soak did and found; ``problems`` lists each finding (empty when all was well)."""

    seed: int
    saves: int = 0
    multi_rank_saves: int = 0
    completed: int = 0
    completed_after_faults: int = 0  # completed although at least one fault failed a request of it
    failed: int = 0
    failed_clean: int = 0
    failed_bounded: int = 0  # failed although its faults stayed within the retry policy
    resaves: int = 0
    resaves_ok: int = 0
    loads: int = 0
    loads_ok: int = 0
    faults: Counter[str] = field(default_factory=Counter)  # fires per kind, saves and loads
    save_faults: Counter[str] = field(default_factory=Counter)
    load_faults: Counter[str] = field(default_factory=Counter)
    bytes_saved: int = 0  # tensor bytes of completed saves and re-saves
    bytes_lost: int = 0  # of those, bytes that did not load back identically
    unclean: int = 0  # failed saves that left an index or an open upload
    leftovers: int = 0  # completed saves or re-saves that left staging objects or open uploads
    lost_saves: int = 0  # saves whose bytes (or their re-save's) did not all load back
    wall_s: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def survived(self) -> int:
        """Saves that completed and loaded bit-exact, or failed cleanly."""
        return self.completed - self.lost_saves + self.failed_clean

    def rows(self) -> list[tuple[str, str]]:
        kinds = ", ".join(f"{k} {self.faults[k]}" for k in KINDS)
        return [
            ("saves (of which on several ranks)", f"{self.saves} ({self.multi_rank_saves})"),
            (
                "completed (after retried faults)",
                f"{self.completed} ({self.completed_after_faults})",
            ),
            ("failed (under bounded faults only)", f"{self.failed} ({self.failed_bounded})"),
            ("failed cleanly: no index, no open upload", f"{self.failed_clean}"),
            ("next save to a failed one's path: ok", f"{self.resaves_ok} / {self.resaves}"),
            ("loads ok (through faults + straight from moto)", f"{self.loads_ok} / {self.loads}"),
            (
                "faults injected: saves + loads = total",
                (
                    f"{sum(self.save_faults.values())} + {sum(self.load_faults.values())} = "
                    f"{sum(self.faults.values())}"
                ),
            ),
            ("faults by kind", kinds),
            (
                "survived (completed and bit-exact, or failed cleanly)",
                f"{self.survived} / {self.saves}",
            ),
            ("tensor bytes of completed saves and re-saves", f"{self.bytes_saved:,}"),
            ("bytes lost", f"{self.bytes_lost:,}"),
            ("unclean failures", f"{self.unclean}"),
            ("leftover staging objects or uploads after a completed save", f"{self.leftovers}"),
            ("problems", f"{len(self.problems)}"),
            ("wall time", f"{self.wall_s:.1f} s"),
        ]

    def markdown(self) -> str:
        lines = ["| figure | value |", "|---|---:|", *(f"| {k} | {v} |" for k, v in self.rows())]
        if self.problems:
            lines += ["", "Problems:", "", *(f"- {p}" for p in self.problems)]
        return "\n".join(lines) + "\n"


def _client_options(endpoint: str) -> dict:
    """s3fs options through ``endpoint`` with botocore's retries off: only the library's remain.

    fsspec's instance cache is on, as by default: the saves and loads of a process share one
    ``S3FileSystem`` per endpoint (its first request costs ~0.8 s: the client is built), and
    the library never answers from its listings cache (``_fsio``).
    """
    options = {
        **s3_storage_options(endpoint),
        "config_kwargs": {"retries": {"total_max_attempts": 1, "mode": "standard"}},
    }
    options["skip_instance_cache"] = False
    return options


def soak(
    upstream: str,
    n_saves: int,
    seed: int,
    *,
    multi_rank_saves: int = 0,
    world: int = 2,
    fatal_rate: float = 0.17,
    bucket_faults: bool = True,
    log: Callable[[str], None] | None = None,
) -> SoakReport:
    """Run ``n_saves`` single-process and ``multi_rank_saves`` ``world``-rank saves, each with
    its loads and checks (see the module docstring); the report holds the figures and problems.

    ``bucket_faults=False``: the single-process saves' faults never hit a bucket's own requests
    (the writer's listings and DeleteObjects, which go through s3fs without the library's
    retries); the multi-rank saves' faults never do (they are scoped to a folder by path).
    """
    import s3fs

    report = SoakReport(seed)
    started = time.monotonic()
    direct = s3fs.S3FileSystem(**s3_storage_options(upstream))
    bucket = f"hf-dcp-soak-{uuid.uuid4().hex[:16]}"
    direct.mkdir(bucket)
    log = log or (lambda _: None)
    try:
        with FaultProxy(upstream=upstream) as proxy:
            ctx = _Context(proxy, direct, bucket, report, log, bucket_faults)
            saves = [ctx.plan(i, 1, fatal_rate) for i in range(n_saves)]
            for save in saves:
                ctx.run_single(save)
                ctx.check(save)
            if multi_rank_saves:
                batch = [ctx.plan(n_saves + i, world, fatal_rate) for i in range(multi_rank_saves)]
                ctx.run_batch(batch, world)
                for save in batch:
                    ctx.check(save)
            if proxy.errors:
                report.problems += [f"proxy error: {e!r}" for e in proxy.errors]
    finally:
        with contextlib.suppress(Exception):
            direct.rm(bucket, recursive=True)
        # the cached clients point at the proxy, now closed
        s3fs.S3FileSystem.clear_instance_cache()
    report.wall_s = time.monotonic() - started
    return report


class _Context:
    """The soak's shared state: the proxy, the client straight to moto, the bucket, the report."""

    def __init__(
        self,
        proxy: FaultProxy,
        direct,
        bucket: str,
        report: SoakReport,
        log: Callable[[str], None],
        bucket_faults: bool,
    ) -> None:
        self.proxy, self.direct, self.bucket, self.report, self.log = (
            proxy,
            direct,
            bucket,
            report,
            log,
        )
        self.bucket_faults = bucket_faults
        self.options = _client_options(proxy.endpoint)
        self.direct_options = _client_options(direct.client_kwargs["endpoint_url"])

    def plan(self, number: int, world: int, fatal_rate: float) -> _Save:
        # A random source per save (and per load of it): any save is reproduced alone, whatever ran
        # before.
        rng = random.Random(f"soak-{self.report.seed}-{number}")
        tensors = draw_tensors(rng, 1000 * self.report.seed + 16 * number, world=world)
        shard = rng.choice(["5GB", "5GB", "12MB"])  # 12MB: two files, or a big tensor alone in one
        multipart = world > 1 or (shard == "5GB" and sum(t.nbytes for t in tensors) > 16 << 20)
        fatal = rng.random() < fatal_rate
        fatal_targets = _FATAL_ALWAYS + _FATAL_MULTIPART * multipart + _FATAL_STAGED * (world > 1)
        targets = [t for t in _SAVE_TARGETS if world > 1 or t[0] not in _FATAL_STAGED]
        if world > 1 or not self.bucket_faults:  # DeleteObjects is a request to the bucket
            targets = [t for t in targets if t[0] != "delete"]
        schedule = draw_schedule(
            rng,
            targets,
            first_kind=KINDS[number % len(KINDS)],
            fatal=fatal_targets if fatal else None,
        )
        return _Save(
            number, world, f"{self.bucket}/soak/s{number:04d}", tensors, shard, schedule, fatal
        )

    # -- saves ----------------------------------------------------------------------------------

    def run_single(self, save: _Save) -> None:
        self.proxy.clear()
        # Without bucket faults, only the requests for the save's own objects (as on several ranks).
        scope = None if self.bucket_faults else f"/{save.prefix}/"
        faults = [self.proxy.add_fault(s.fault(scope)) for s in save.schedule]
        save.error = self._save_once(save)
        save.fired = _fired(faults)

    def _save_once(self, save: _Save) -> str | None:
        """Save ``save``'s tensors in this process; the error, shortened, if it failed."""
        try:
            writer = HFStorageWriter(
                f"s3://{save.prefix}",
                storage_options=self.options,
                retry=POLICY,
                thread_count=2,
                max_shard_size=save.max_shard_size,
            )
            dcp.save({t.name: t.make() for t in save.tensors}, storage_writer=writer, no_dist=True)
        except BaseException as exc:  # CheckpointException derives from BaseException
            if isinstance(exc, KeyboardInterrupt):
                raise
            return _short(exc)
        return None

    def run_batch(self, batch: list[_Save], world: int) -> None:
        """The saves one after another on ``world`` gloo ranks, every save's faults scoped to its
        folder."""
        self.proxy.clear()
        faults = {
            save.number: [self.proxy.add_fault(s.fault(f"/{save.prefix}/")) for s in save.schedule]
            for save in batch
        }
        jobs = [(save.prefix, save.tensors, save.max_shard_size) for save in batch]
        with tempfile.TemporaryDirectory(prefix="hf_dcp_soak_") as out:
            try:
                run_ranks(_save_batch_on_rank, world, jobs, self.options, out)
            except Exception as exc:  # noqa: BLE001 - a rank that crashed or hung: a problem, not an outcome
                self.report.problems.append(
                    f"run_ranks of saves {[s.number for s in batch]} failed: {_short(exc)}"
                )
                for save in batch:
                    save.error = save.error or "run_ranks failed"
                return
            outcomes = [
                json.loads(open(os.path.join(out, f"rank{r}.json")).read()) for r in range(world)
            ]
        for i, save in enumerate(batch):
            errors = [o[i] for o in outcomes]
            if any(e is None for e in errors) and any(e is not None for e in errors):
                self.report.problems.append(
                    f"{save.describe()}: ranks disagree on the outcome: {errors}"
                )
            save.error = next((e for e in errors if e is not None), None)
            save.fired = _fired(faults[save.number])

    # -- checks ---------------------------------------------------------------------------------

    def check(self, save: _Save) -> None:
        r = self.report
        r.saves += 1
        r.multi_rank_saves += save.world > 1
        r.save_faults.update(save.fired)
        r.faults.update(save.fired)
        failing = sum(n for k, n in save.fired.items() if k != "latency")
        self.log(
            f"{save.describe()}: {'ok' if save.error is None else 'FAILED'}; fired "
            f"{dict(save.fired)}"
        )
        if save.error is None:
            r.completed += 1
            r.completed_after_faults += failing > 0
            self._check_completed(save, "", through_proxy=True)
        else:
            r.failed += 1
            if not save.fatal:
                r.failed_bounded += 1
                r.problems.append(
                    f"{save.describe()}: failed under faults within the retry policy: {save.error}"
                )
            self._check_failed(save)
        with contextlib.suppress(Exception):
            self.direct.rm(save.prefix, recursive=True)  # keeps moto's memory bounded

    def _check_completed(self, save: _Save, what: str, *, through_proxy: bool) -> bool:
        """A completed save (``what``: of a re-save) left no staging object or open upload, and
        loads bit-exact straight from moto, and (``through_proxy``) through bounded faults."""
        r = self.report
        r.bytes_saved += save.nbytes
        left = self._leftovers(save.prefix)
        if left:
            r.leftovers += 1
            r.problems.append(f"{save.describe()}{what}: completed but left {left}")
        expected = {t.name: t for t in save.tensors}
        lost: set[str] = set()
        for proxied in (True, False)[not through_proxy :]:
            lost |= self._load(save, expected, proxied, what)
        r.bytes_lost += sum(expected[k].nbytes for k in lost)
        r.lost_saves += bool(lost)
        return not lost and not left

    def _load(
        self, save: _Save, expected: dict[str, TensorSpec], through_proxy: bool, what: str
    ) -> set[str]:
        """Load the save (through bounded faults, or straight from moto); the keys that did not come
        back bit-exact."""
        r = self.report
        r.loads += 1
        rng = random.Random(f"soak-{r.seed}-{save.number}-load-{through_proxy}{what}")
        self.proxy.clear()
        faults: list[Fault] = []
        schedule: list[FaultSpec] = []
        if through_proxy:
            schedule = draw_schedule(rng, _LOAD_TARGETS)
            faults = [self.proxy.add_fault(s.fault(None)) for s in schedule]
        originals = {k: t.make() for k, t in expected.items()}
        out = {k: torch.zeros_like(v) for k, v in originals.items()}
        options = self.options if through_proxy else self.direct_options
        try:
            reader = HFStorageReader(
                f"s3://{save.prefix}",
                storage_options=options,
                retry=POLICY,
                thread_count=2,
                verify=rng.random() < 0.5,
            )
            dcp.load(out, storage_reader=reader, no_dist=True)
        except BaseException as exc:  # CheckpointException derives from BaseException
            if isinstance(exc, KeyboardInterrupt):
                raise
            fired = _fired(faults)
            self._count_load_faults(fired)
            where = (
                f"through faults {'; '.join(map(str, schedule))}"
                if through_proxy
                else "straight from moto"
            )
            r.problems.append(
                f"{save.describe()}{what}: the load {where} failed (fired {dict(fired)}): "
                f"{_short(exc, where=True)}"
            )
            return set(expected) if not through_proxy else set()
        self._count_load_faults(_fired(faults))
        r.loads_ok += 1
        wrong = {k for k, v in originals.items() if not same(out[k], v)}
        if wrong:
            r.problems.append(
                f"{save.describe()}{what}: loaded {sorted(wrong)} with different bytes "
                f"({'through the proxy' if through_proxy else 'straight from moto'})"
            )
        return wrong

    def _count_load_faults(self, fired: Counter[str]) -> None:
        self.report.load_faults.update(fired)
        self.report.faults.update(fired)

    def _check_failed(self, save: _Save) -> None:
        r = self.report
        names = self._names(save.prefix)
        uploads = self._uploads(save.prefix)
        if INDEX in names or uploads:
            r.unclean += 1
            left = (["the index"] if INDEX in names else []) + (
                [f"{len(uploads)} open upload(s)"] if uploads else []
            )
            r.problems.append(
                f"{save.describe()}: failed ({save.error}) but left {' and '.join(left)}"
            )
        else:
            r.failed_clean += 1
        # The next save to the same path, without faults, succeeds and leaves nothing behind.
        r.resaves += 1
        self.proxy.clear()
        error = self._save_once(save)
        if error is not None:
            r.problems.append(
                f"{save.describe()}: the next save to its path, without faults, failed: {error}"
            )
            return
        r.resaves_ok += self._check_completed(save, " (re-saved)", through_proxy=False)

    def _names(self, prefix: str) -> set[str]:
        return {p[len(prefix) + 1 :] for p in self.direct.find(prefix)}

    def _uploads(self, prefix: str) -> list[dict]:
        bucket, _, key = prefix.partition("/")
        return [
            u for u in self.direct.list_multipart_uploads(bucket) if u["Key"].startswith(key + "/")
        ]

    def _leftovers(self, prefix: str) -> str:
        staged = sorted(n for n in self._names(prefix) if n.startswith(STAGING))
        uploads = self._uploads(prefix)
        parts = ([f"staging objects {staged}"] if staged else []) + (
            [f"{len(uploads)} open upload(s)"] if uploads else []
        )
        return ", ".join(parts)


def _fired(faults: list[Fault]) -> Counter[str]:
    c: Counter[str] = Counter()
    for f in faults:
        c[f.kind] += f.fired
    return +c


def _short(exc: BaseException, limit: int = 900, *, where: bool = False) -> str:
    """One line: the exception, or a ``CheckpointException``'s per-rank failures (not their
    tracebacks; ``where``: the innermost three frames of each)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        text = "; ".join(
            f"rank {r}: {type(e).__name__}: {e}{_frames(tb) if where else ''}"
            for r, (e, tb) in sorted(failures.items())
        )
    else:
        text = f"{type(exc).__name__}: {exc}"
    text = text.replace("\n", " ")
    return text if len(text) <= limit else text[:limit] + "..."


def _frames(tb: object) -> str:
    frames = tb if isinstance(tb, traceback.StackSummary) else []
    return (
        " [at "
        + " < ".join(
            f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames[-3:])
        )
        + "]"
    )


def _save_batch_on_rank(rank: int, world: int, jobs: list, options: dict, out: str) -> None:
    """(each spawned rank) Save each job's state dict as ``Shard(0)`` DTensors; record each
    outcome."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    outcomes: list[str | None] = []
    for prefix, tensors, max_shard_size in jobs:
        sd = {
            t.name: distribute_tensor(t.make(), mesh, [Shard(0)], src_data_rank=None)
            for t in tensors
        }
        try:
            writer = HFStorageWriter(
                f"s3://{prefix}",
                storage_options=options,
                retry=POLICY,
                thread_count=2,
                max_shard_size=max_shard_size,
            )
            dcp.save(sd, storage_writer=writer)
            outcomes.append(None)
        except BaseException as exc:  # CheckpointException derives from BaseException
            if isinstance(exc, KeyboardInterrupt):
                raise
            outcomes.append(
                _short(exc) + " | " + traceback.format_exc(limit=2).replace("\n", " ")[-300:]
            )
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(outcomes, f)
