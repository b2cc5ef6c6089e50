"""Kill tests as a chain of jobs on one run folder (shared by ``test_kill.py`` and
``scripts/experiments/kill_matrix.py``).

``kill_chain(run_url, options, moments, kind)`` runs, on 2 gloo ranks per job (``jobs``):

    job 0:  save step 1 cleanly
    job i:  save a step cleanly, check the run (below), then save the next step and die at
            ``moments[i-1]`` (every rank at once, or one rank: ``kind``)
    last:   save a step cleanly and check the run

and after every killed job checks, from this process with a filesystem of its own (nothing
cached from before the kill):

* the complete steps from before are still complete and byte-identical, and ``latest()`` is the
  newest of them (or the killed step itself when it died after its commit, while pruning);
* the killed step is never listed complete and never loaded (``load(step=...)`` refuses it);
* the ranks that were not killed ended with an error, not a hang.

The next job's clean save re-saves the killed step (every other kill) or saves the one after it;
once it is done the run must hold exactly the 2 newest complete steps, each sound by
``verify_checkpoint``, with no incomplete step, no staged object or save record and (on S3) no
open multipart upload left anywhere under the run folder.

``bare_kill(url, options, moment, kind)`` does the same for a bare ``HFStorageWriter`` save:
killed, then ``hf-dcp consolidate``, which finishes the save when every rank had recorded its
bytes and refuses (no index) otherwise; then a clean save to the same path.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from tests.support.jobs import RankEnd, run_job
from tests.support.killpoints import ASSEMBLED_URLS, S3_ONLY, STAGED_ONLY, arm

__all__ = ["KillOutcome", "bare_kill", "kill_chain", "model_state", "moments_for", "training_state"]

KEEP = 2
# A live rank beats every RANK_TIMEOUT / 10 s: 6 s is 10 missed beats of 0.6 s, which a loaded
# machine does not cause, and short enough that a survivor of a one-rank kill at the ranks'
# meeting gives up soon.
RANK_TIMEOUT = 6.0
JOB_TIMEOUT = 120.0


@dataclass
class KillOutcome:
    """One kill: where, how the ranks ended, and every check that failed (empty: survived)."""

    moment: str
    kind: str
    step: int
    ends: list[str] = field(default_factory=list)
    survivor_seconds: list[float] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def survived(self) -> bool:
        return not self.problems


def moments_for(url: str, moments: tuple[str, ...]) -> tuple[str, ...]:
    """The moments a save to ``url`` reaches (local disk writes in place: nothing to gather or
    complete)."""
    local = "://" not in url or url.startswith("file://")
    assembled = url.startswith(ASSEMBLED_URLS)
    return tuple(
        m for m in moments if not ((local and m in STAGED_ONLY) or (not assembled and m in S3_ONLY))
    )


# -- what every step holds -------------------------------------------------------------------------


def model_state(step: int) -> dict[str, torch.Tensor]:
    """The full weights of ``step``: one tensor over S3's 5 MiB part minimum per rank (own
    parts), small ones that are staged and gathered, two files."""
    g = torch.Generator().manual_seed(1000 + step)
    return {
        "emb": torch.randn(4096, 768, generator=g),
        "layers.0.w": torch.randn(256, 256, generator=g),
        "layers.0.bias": torch.randn(4096, generator=g).to(torch.bfloat16),
        "norm": torch.randn(768, generator=g),
    }


def training_state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(2000 + step)
    return {
        "state": {"m": torch.randn(4096, generator=g), "v": torch.randn(64, 8, generator=g)},
        "epoch": step,
    }


def _sharded(full: dict[str, torch.Tensor], world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    return {k: distribute_tensor(v, mesh, [Shard(0)], src_data_rank=None) for k, v in full.items()}


# -- the jobs --------------------------------------------------------------------------------------


def _manager(run_url: str, options: dict | None) -> Any:
    from hf_dcp_storage import CheckpointManager

    return CheckpointManager(
        run_url,
        keep_last_n=KEEP,
        storage_options=options,
        max_shard_size="8MB",
        rank_timeout=RANK_TIMEOUT,
    )


def _chain_job(
    rank: int,
    world: int,
    run_url: str,
    options: dict | None,
    clean: int,
    kill: tuple[str, str, int] | None,
    facts_path: str,
) -> None:
    """Save ``clean``; rank 0 writes the run's facts to ``facts_path``; then the killed save."""
    import torch.distributed as dist

    manager = _manager(run_url, options)
    manager.save(clean, _sharded(model_state(clean), world), training_state(clean))
    if rank == 0:
        with open(facts_path, "w") as f:
            json.dump(run_facts(run_url, options, verify=clean), f)
    dist.barrier()
    if kill is not None:
        moment, kind, step = kill
        arm(moment, kind, rank, step)
        manager.save(step, _sharded(model_state(step), world), training_state(step))
        with open(facts_path + f".not_killed.{rank}", "w"):
            pass


def _bare_job(
    rank: int, world: int, url: str, options: dict | None, kill: tuple[str, str] | None
) -> None:
    import torch.distributed.checkpoint as dcp

    from hf_dcp_storage import HFStorageWriter

    if kill is not None:
        arm(kill[0], kill[1], rank)
    writer = HFStorageWriter(
        url,
        storage_options=options,
        max_shard_size="8MB",
        overwrite=True,
        rank_timeout=RANK_TIMEOUT,
    )
    dcp.save(_sharded(model_state(0), world), storage_writer=writer)


# -- what is in the store now (a filesystem of its own, never a cached one) ------------------------


def _fresh(url: str, options: dict | None) -> tuple[Any, str]:
    from hf_dcp_storage.io import fsio as _fsio

    opts = dict(options or {})
    if "://" in url and not url.startswith(("file://", "memory://")):
        opts["skip_instance_cache"] = True
    return _fsio.resolve(url, opts)


def run_facts(run_url: str, options: dict | None, verify: int | None = None) -> dict:
    """Complete and incomplete steps, each complete step's file digests, staged leftovers and
    open multipart uploads under the run folder; with ``verify``, whether that step is sound
    (``verify_checkpoint`` with every CRC32; the older ones are proven unchanged by digest)."""
    from hf_dcp_storage import list_steps, verify_checkpoint

    steps = list_steps(run_url, storage_options=options)
    complete = [s.step for s in steps if s.complete]
    tree = _tree(run_url, options)
    return {
        "complete": complete,
        "incomplete": [s.step for s in steps if not s.complete],
        "hashes": {
            s: {k: v for k, v in tree.items() if k.startswith(f"step_{s}/")} for s in complete
        },
        "unsound": [verify]
        if verify is not None
        and not verify_checkpoint(f"{run_url}/step_{verify}", storage_options=options).ok
        else [],
        "staging": sorted(k for k in tree if "/.hf_dcp_staging/" in f"/{k}"),
        "uploads": open_uploads(run_url, options),
    }


def _tree(url: str, options: dict | None) -> dict[str, str]:
    """Every file under ``url``: relative path -> a digest of its bytes (on S3 the object's
    ETag, an MD5 of its bytes or of its parts', from one listing; elsewhere a sha256)."""
    from hf_dcp_storage.io import fsio as _fsio

    fs, root = _fresh(url, options)
    base = root.rstrip("/") + "/"
    out = {}
    for path, info in (
        _fsio.find_entries(fs, root, withdirs=False).items() if _fsio.isdir(fs, root) else ()
    ):
        rel = path[len(base) :]
        etag = info.get("ETag")
        out[rel] = (
            f"{etag}:{info.get('size')}"
            if etag
            else hashlib.sha256(_fsio.read_all(fs, path)).hexdigest()
        )
    return dict(sorted(out.items()))


def open_uploads(url: str, options: dict | None) -> list[str]:
    """Keys of unfinished multipart uploads under ``url`` (S3), blobs with uncommitted blocks
    (Azure), else empty. Azurite lists no blob that has only uncommitted blocks, so on Azure
    every name a save of these state dicts can give its files (``model-0000k-of-0000N``, N <= 4,
    in the folder, its steps and their training state) is asked too."""
    from hf_dcp_storage.stores import backend_of
    from hf_dcp_storage.stores.retry import RetryPolicy
    from hf_dcp_storage.stores.s3_requests import S3

    fs, root = _fresh(url, options)
    backend = backend_of(fs)
    if backend is not None and backend.mode == "azure":
        return _uncommitted_blocks(fs, root)
    if backend is None or backend.mode != "s3":
        return []
    return sorted(k for k, _ in S3(fs, RetryPolicy()).list_uploads(root.rstrip("/") + "/"))


def _uncommitted_blocks(fs: Any, root: str) -> list[str]:
    from fsspec.asyn import sync

    from hf_dcp_storage.io import fsio as _fsio
    from hf_dcp_storage.stores.azure_requests import Azure
    from hf_dcp_storage.stores.retry import RetryPolicy

    folders = (
        {root}
        | {
            f"{root}/{p.split('/', 1)[0]}"
            for p in _fsio.list_tree(fs, root)
            if p.startswith("step_")
        }
        | {f"{root}/step_{s}" for s in range(1, 40)}
    )
    folders |= {f"{f}/training_state" for f in folders}
    names = [
        f"{f}/model-{k:05d}-of-{n:05d}.safetensors"
        for f in sorted(folders)
        for n in range(1, 5)
        for k in range(1, n + 1)
    ]
    azure = Azure(fs, RetryPolicy())

    async def count(path: str) -> int:
        container, _, blob = path.partition("/")
        async with fs.service_client.get_blob_client(container, blob) as bc:
            try:
                return len((await bc.get_block_list("uncommitted"))[1])
            except Exception:  # noqa: BLE001 - no such blob: nothing uncommitted
                return 0

    async def every() -> list[int]:
        import asyncio

        return list(await asyncio.gather(*(count(n) for n in names)))

    found = sorted(
        set(azure.uncommitted(root.rstrip("/") + "/"))
        | {n for n, c in zip(names, sync(fs.loop, every), strict=True) if c}
    )
    return [n[len(root) + 1 :] for n in found]


# -- the chain -------------------------------------------------------------------------------------


def kill_chain(
    run_url: str,
    options: dict | None,
    moments: tuple[str, ...],
    kind: str,
    scratch: str,
    world: int = 2,
) -> list[KillOutcome]:
    """Kill a ``CheckpointManager`` save at each of ``moments`` in turn (see the module
    docstring); ``scratch``: a local folder for the jobs' reports."""
    import os

    facts_path = os.path.join(scratch, "facts.json")
    run_job(
        _chain_job, world, run_url, options, 1, None, facts_path, timeout=JOB_TIMEOUT
    ).check_returned()
    before = run_facts(run_url, options)
    outcomes: list[KillOutcome] = []
    clean, next_step = 2, 3
    for i, moment in enumerate((*moments, None)):
        kill = None if moment is None else (moment, kind, next_step)
        for stale in [n for n in os.listdir(scratch) if n.startswith("facts.json")]:
            os.remove(os.path.join(scratch, stale))
        result = run_job(
            _chain_job, world, run_url, options, clean, kill, facts_path, timeout=JOB_TIMEOUT
        )
        ends = result.ranks
        if moment is None:
            result.check_returned()
        if not os.path.exists(facts_path):
            raise AssertionError(
                f"the clean save of step {clean} did not finish:\n"
                + "\n".join(f"rank {e.rank} {e.how}: {e.error[-3000:]}" for e in ends)
            )
        with open(facts_path) as f:
            facts = json.load(f)
        facts["hashes"] = {int(s): h for s, h in facts["hashes"].items()}
        problems = _clean_save_problems(facts, before, clean)
        if problems and outcomes:
            outcomes[-1].problems += [f"the next save (step {clean}): {p}" for p in problems]
        elif problems:
            raise AssertionError(
                f"the first clean save (step {clean}) failed its checks: {problems}"
            )
        before = {k: facts[k] for k in ("complete", "hashes")}
        if moment is None:
            break
        outcome = KillOutcome(moment, kind, next_step, [e.how for e in ends])
        outcome.problems += _ending_problems(ends, kind, None)
        if any(n.startswith("facts.json.not_killed") for n in os.listdir(scratch)):
            outcome.problems.append("a rank completed the save that was to be killed")
        outcome.survivor_seconds = _after_the_kill(ends)
        after, problems = _after_kill(run_url, options, before, moment, next_step)
        outcome.problems += problems
        outcomes.append(outcome)
        before = after
        # Every other kill the next save re-saves the killed step; otherwise it saves the next one.
        committed = moment == "pruning"
        clean = next_step if (i % 2 == 0 and not committed) else next_step + 1
        next_step = clean + 1
    return outcomes


def _after_the_kill(ends: tuple[RankEnd, ...]) -> list[float]:
    """Seconds from the kill to each surviving rank's end (its failure, or its hang's kill)."""
    return [e.ended_at - e.fired_at for e in ends if e.how != "killed" and e.fired_at is not None]


def _ending_problems(ends: tuple[RankEnd, ...], kind: str, facts: dict | None) -> list[str]:
    problems: list[str] = []
    how = [e.how for e in ends]
    if "killed" not in how:
        problems.append(f"nobody was killed (the moment was never reached): {how}")
    if kind == "job" and how.count("killed") != len(ends):
        problems.append(f"a whole-job kill left ranks alive: {how}")
    for e in ends:
        if e.how == "hung":
            problems.append(
                f"rank {e.rank} hung after its peer died (killed after {e.seconds:.0f} s)"
            )
        if e.how == "returned":
            problems.append(f"rank {e.rank} finished a save whose peer was killed")
    return problems


def _after_kill(
    run_url: str, options: dict | None, before: dict, moment: str, step: int
) -> tuple[dict, list[str]]:
    """The run's facts after a kill, and what is wrong with them."""
    from hf_dcp_storage import CheckpointManager

    now = run_facts(run_url, options)
    problems = []
    committed = moment == "pruning"  # died after the step's commit, while removing an old one
    kept = before["complete"][-1:] if committed else before["complete"]
    for s in kept:
        if s not in now["complete"]:
            problems.append(f"step {s}, complete before the kill, is not complete after it")
        elif now["hashes"][s] != before["hashes"][s]:
            changed = sorted(set(now["hashes"][s].items()) ^ set(before["hashes"][s].items()))
            problems.append(f"step {s} changed: {changed[:4]}")
    if committed != (step in now["complete"]):
        problems.append(
            f"step {step} killed at {moment} is {'not ' if committed else ''}listed complete"
        )
    expected_latest = step if committed else before["complete"][-1]
    manager = CheckpointManager(run_url, storage_options=options)
    if manager.latest() != expected_latest:
        problems.append(f"latest() is {manager.latest()}, expected {expected_latest}")
    problems += _load_problems(manager, expected_latest)
    if not committed:
        try:
            manager.load({k: torch.zeros_like(v) for k, v in model_state(step).items()}, step=step)
            problems.append(f"the killed step {step} loaded")
        except FileNotFoundError:
            pass
    return now, problems


def _load_problems(manager: Any, step: int) -> list[str]:
    """Load ``step`` in this process (one rank, whole tensors) and compare with what it saved."""
    dest = {k: torch.zeros_like(v) for k, v in model_state(step).items()}
    state = {"state": {"m": torch.zeros(4096), "v": torch.zeros(64, 8)}, "epoch": -1}
    loaded = manager.load(dest, state, step=step)
    want, want_state = model_state(step), training_state(step)
    bad = [k for k in want if not torch.equal(dest[k], want[k])]
    bad += [
        f"state.{k}"
        for k in want_state["state"]
        if not torch.equal(state["state"][k], want_state["state"][k])
    ]
    if state["epoch"] != step or loaded != step:
        bad.append("epoch")
    return [f"step {step} loaded wrong: {bad}"] if bad else []


def _clean_save_problems(facts: dict, before: dict, clean: int) -> list[str]:
    problems = []
    expected = sorted(set(before["complete"]) | {clean})[-KEEP:]
    if facts["complete"] != expected:
        problems.append(f"complete steps {facts['complete']}, expected {expected}")
    problems.extend(
        f"{key}: {facts[key][:6]}"
        for key in ("incomplete", "unsound", "staging", "uploads")
        if facts[key]
    )
    return problems


# -- a bare writer save, then hf-dcp consolidate ---------------------------------------------------


def bare_kill(
    url: str, options: dict | None, moment: str, kind: str, world: int = 2
) -> KillOutcome:
    """Kill a bare ``HFStorageWriter`` save to ``url`` at ``moment``; then ``hf-dcp consolidate``
    it; then save it again cleanly (see the module docstring)."""
    from hf_dcp_storage import verify_checkpoint
    from hf_dcp_storage.format.index import INDEX_NAME
    from hf_dcp_storage.io import fsio as _fsio
    from hf_dcp_storage.tools.cli import main

    outcome = KillOutcome(moment, kind, 0)
    result = run_job(_bare_job, world, url, options, (moment, kind), timeout=JOB_TIMEOUT)
    outcome.ends = result.how()
    outcome.problems += _ending_problems(result.ranks, kind, None)
    outcome.survivor_seconds = _after_the_kill(result.ranks)
    fs, root = _fresh(url, options)
    recorded = {f"rank{r:05d}.json" for r in range(world)} <= {
        n.rsplit("/", 1)[-1] for n in _fsio.list_tree(fs, root)
    }
    finishable = recorded or moment == "index-written"
    argv = ["consolidate", url]
    for key, value in _flat_options(options or {}).items():
        argv += ["-o", f"{key}:={json.dumps(value)}"]
    code = main(argv)
    committed = _fsio.exists(fs, _fsio.join(root, INDEX_NAME))
    if finishable and (code != 0 or not committed):
        outcome.problems.append(
            "consolidate could not finish a save whose ranks had all recorded their bytes (exit "
            f"{code})"
        )
    if not finishable and (code == 0 or committed):
        outcome.problems.append(
            f"consolidate committed a save a rank never finished (exit {code}, index {committed})"
        )
    if committed:
        outcome.problems += _bare_problems(url, options, "after consolidate")
    run_job(_bare_job, world, url, options, None, timeout=JOB_TIMEOUT).check_returned()
    outcome.problems += _bare_problems(url, options, "after the next save")
    if not verify_checkpoint(url, storage_options=options).ok:
        outcome.problems.append("the next save is not sound")
    return outcome


def _bare_problems(url: str, options: dict | None, when: str) -> list[str]:
    import torch.distributed.checkpoint as dcp

    from hf_dcp_storage import HFStorageReader

    problems = []
    want = model_state(0)
    dest = {k: torch.zeros_like(v) for k, v in want.items()}
    try:
        dcp.load(
            dest,
            storage_reader=HFStorageReader(url, storage_options=options, verify=True),
            no_dist=True,
        )
    except BaseException as exc:  # noqa: BLE001 - CheckpointException: a problem to report, not a crash of the matrix
        return [f"{when}: the load failed: {str(exc).splitlines()[-1][:300]}"]
    bad = [k for k in want if not torch.equal(dest[k], want[k])]
    if bad:
        problems.append(f"{when}: loaded wrong {bad}")
    leftovers = [k for k in _tree(url, options) if ".hf_dcp_staging" in k] + open_uploads(
        url, options
    )
    if leftovers:
        problems.append(f"{when}: left {leftovers[:6]}")
    return problems


def _flat_options(options: dict, prefix: str = "") -> dict[str, Any]:
    """``{"client_kwargs": {"endpoint_url": u}}`` as the CLI's dotted ``-o`` keys."""
    out: dict[str, Any] = {}
    for k, v in options.items():
        if isinstance(v, dict):
            out.update(_flat_options(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def summary(outcomes: list[KillOutcome]) -> str:
    """One line per kill, for a failing assertion or the matrix script."""
    return "\n".join(
        f"{o.kind:4} {o.moment:15} step {o.step:3}: {'survived' if o.survived else 'FAILED'} "
        f"ends={o.ends} survivors={[round(s, 1) for s in o.survivor_seconds]} {o.problems}"
        for o in outcomes
    )


def wall(fn: Any, *args: Any) -> tuple[Any, float]:
    started = time.monotonic()
    return fn(*args), time.monotonic() - started
