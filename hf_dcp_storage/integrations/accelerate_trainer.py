"""HF ``Trainer`` checkpoints (``checkpoint-N``, under FSDP2) and ``Accelerator.save_state``'s at
any fsspec URL, ``s3://`` included: ``save_total_limit`` honoured there, a commit marker per
checkpoint, resumable.

    from hf_dcp_storage.integrations.accelerate import route_fsdp_checkpoints
    from hf_dcp_storage.integrations.accelerate_trainer import TrainerCheckpointMirror

    # every rank, before the Trainer; args.output_dir is a local staging folder
    routing = route_fsdp_checkpoints(storage_options=opts, companions="path/to/hf_model")
    mirror = TrainerCheckpointMirror("s3://bucket/run1", args.output_dir, routing, opts)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[mirror])
    trainer.train(resume_from_checkpoint=mirror.resume_checkpoint())  # None: a fresh start
    mirror.remove()

    # or, with accelerate alone (staging_dir: any local folder)
    accelerator.save_state(mirror.staged(step))
    mirror.commit(step, keep=3)
    accelerator.load_state(mirror.resume_checkpoint())  # the newest complete one

**Why a callback and a staging folder.** ``Trainer`` ``os.makedirs`` its ``output_dir``, writes
its own files there (``trainer_state.json``, ``scheduler.pt``, ``rng_state_{rank}.pth``), finds
checkpoints and rotates them (``save_total_limit``) with ``os`` and ``shutil``, and marks none
complete. Replacing those methods would mean re-implementing ``Trainer``'s save and resume order
for every transformers release; instead ``Trainer`` keeps a local ``output_dir`` and runs as it
is, and the mirror adds what a store needs at the two places ``Trainer`` opens for it:

* the routed FSDP functions (``integrations.accelerate.route_fsdp_checkpoints``'s routing,
  redirected here) write ``checkpoint-N``'s model and optimizer from every rank straight to
  ``remote/checkpoint-N/`` (nothing heavy goes through the staging folder); before the model
  rank 0 removes any ``remote/checkpoint-N`` there is, marker first (a checkpoint saved anew is
  incomplete until its commit);
* ``on_save``, the ``TrainerCallback`` event ``Trainer`` calls on every rank after each
  checkpoint: each rank uploads its own files, then rank 0 writes the checkpoint's one
  ``COMMITTED`` marker last (``steps.folder.commit``: ``{"step", "world_size", ...}``) and keeps
  the newest ``args.save_total_limit`` complete checkpoints (and the best one), removing the
  others and incomplete leftovers, marker first (``steps.runs.remove_folder``).

``resume_checkpoint`` fetches the newest complete checkpoint's small files into the staging
folder (a fresh machine's is empty) and gives its path to ``resume_from_checkpoint``; ``Trainer``
loads its files from there and the routed loads read the model and optimizer remotely. A kill
during a save leaves that checkpoint without its marker: the previous one stays the newest
complete one, and is what resume picks. ``Trainer`` calls each callback event by name, so the
mirror answers every other ``on_*`` event with nothing and this module imports no transformers.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any, Protocol

import torch.distributed as dist

try:
    # The routing it redirects is integrations.accelerate's (integrations build on the public
    # API, steps/, writer and reader only: it comes in as an argument, not an import).
    import accelerate  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised where accelerate is absent
    raise ImportError(
        f"hf_dcp_storage.integrations.accelerate_trainer needs accelerate ({exc}); install it "
        "with pip install 'hf_dcp_storage[accelerate]' (accelerate 1.16.x)"
    ) from exc

from ..steps import folder as ckpt_folder
from ..steps.retention import COMMIT_MARKER, RetentionPolicy, to_remove
from ..steps.runs import remove_folder

__all__ = ["TrainerCheckpointMirror"]

# Trainer's names: PREFIX_CHECKPOINT_DIR; each rank's RNG file, Trainer's (world size 1:
# rng_state.pth, rank 0's) and Accelerator.save_state's.
_CHECKPOINT = re.compile(r"checkpoint-(0|[1-9][0-9]*)")
_RANK_FILE = re.compile(r"(?:rng_state|random_states)_([0-9]+)\.(?:pth|pkl)")
_Path = str | os.PathLike[str]


class _Routing(Protocol):
    """``integrations.accelerate.FSDPRouting``, as far as the mirror uses it."""

    def redirect(
        self, url: Callable[[_Path], str], before_save: Callable[[_Path], None]
    ) -> None: ...

    def remove(self) -> None: ...


class TrainerCheckpointMirror:
    """``Trainer``'s ``checkpoint-N`` folders at ``remote``, staged in ``staging_dir`` (the
    ``Trainer``'s ``output_dir``). Every rank makes one before the ``Trainer``, passes it in
    ``callbacks`` and calls ``resume_checkpoint`` alike; ``remove()`` puts accelerate's
    functions back.

    Args:
        remote: the run's folder, a local path or any fsspec URL (``s3://bucket/run1``).
        staging_dir: ``TrainingArguments.output_dir``, a local folder.
        routing: what ``route_fsdp_checkpoints`` returned (this rank's), redirected to
            ``remote`` for the folders under ``staging_dir``.
        storage_options: for fsspec, the routing's own.
    """

    def __init__(
        self,
        remote: str,
        staging_dir: _Path,
        routing: _Routing,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        self.routing = routing
        self.staging, self.remote = os.path.abspath(os.fspath(staging_dir)), remote.rstrip("/")
        self.fs, self.root = ckpt_folder.locate(remote, storage_options)
        routing.redirect(self._url, self._clear)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("on_"):  # Trainer's other events: nothing to do
            return lambda *args, **kwargs: None
        raise AttributeError(name)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """(every rank, ``Trainer`` calling it after ``checkpoint-N``) ``commit`` it, keeping
        ``args.save_total_limit`` and ``Trainer``'s best checkpoint."""
        self.commit(state.global_step, args.save_total_limit, state.best_model_checkpoint)

    def staged(self, step: int) -> str:
        """The staging folder of ``checkpoint-{step}``: where ``Accelerator.save_state`` saves
        it (then ``commit(step)``) for the routed functions to write it to ``remote``."""
        return os.path.join(self.staging, _name(step))

    def commit(self, step: int, keep: int | None = None, best: str | None = None) -> None:
        """(every rank, after ``checkpoint-{step}`` is saved into ``staged(step)``) Upload this
        rank's own files (``rng_state_{rank}.pth``, ``random_states_{rank}.pkl``; rank 0: every
        other file too); once every rank has, rank 0 writes the checkpoint's ``COMMITTED`` and
        keeps the newest ``keep`` complete checkpoints (and ``best``); a barrier last."""
        rank = _rank()
        local, folder = self.staged(step), self._folder(step)
        for name in sorted(os.listdir(local)):
            path, own = os.path.join(local, name), _RANK_FILE.fullmatch(name)
            if (own and int(own[1]) == rank) or (not own and rank == 0 and os.path.isfile(path)):
                self.fs.put_file(path, f"{folder}/{name}")
        _barrier()
        if rank == 0:
            world = dist.get_world_size() if dist.is_initialized() else 1
            ckpt_folder.commit(self.fs, folder, step, world)
            if keep is not None:
                self._rotate(keep, step, best)
        _barrier()

    def latest(self) -> int | None:
        """(any rank) The newest complete checkpoint's step, or ``None``."""
        return max((s for s, done in self._checkpoints().items() if done), default=None)

    def resume_checkpoint(self, step: int | None = None) -> str | None:
        """(every rank, before ``trainer.train``) Fetch the newest complete checkpoint's (or
        ``step``'s) files into the staging folder, its model and optimizer folders empty there;
        returns the local path for ``resume_from_checkpoint``, ``None`` without a complete one.

        Raises:
            FileNotFoundError: ``step`` is not a complete checkpoint, listing those that are.
        """
        done = sorted(s for s, ok in self._checkpoints().items() if ok)
        if step is not None and step not in done:
            raise FileNotFoundError(
                f"{self.remote}/{_name(step)} is not a complete checkpoint; complete: {done}"
            )
        if step is None and not done:
            return None
        step = done[-1] if step is None else step
        local, folder = os.path.join(self.staging, _name(step)), self._folder(step)
        os.makedirs(local, exist_ok=True)
        for entry in ckpt_folder.entries(self.fs, folder):
            name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
            if entry["type"] == "directory":  # Trainer spots an FSDP checkpoint by its folders
                os.makedirs(os.path.join(local, name), exist_ok=True)
            elif name != COMMIT_MARKER:
                tmp = os.path.join(local, f".{name}.{_rank()}.tmp")  # ranks may share the folder
                self.fs.get_file(entry["name"], tmp)
                os.replace(tmp, os.path.join(local, name))
        return local

    def remove(self) -> None:
        """Put accelerate's functions back (``FSDPRouting.remove``)."""
        self.routing.remove()

    def _rel(self, path: _Path) -> str | None:
        """``path``'s place under the staging folder (``/``-separated), ``None`` outside it."""
        rel = os.path.relpath(os.path.abspath(os.fspath(path)), self.staging)
        return None if rel == ".." or rel.startswith(f"..{os.sep}") else rel.replace(os.sep, "/")

    def _url(self, path: _Path) -> str:
        """Where the routed functions write or read a folder: under ``remote`` for one under the
        staging folder, else where it is."""
        rel = self._rel(path)
        return os.fspath(path) if rel is None else f"{self.remote}/{rel}".removesuffix("/.")

    def _clear(self, output_dir: _Path) -> None:
        """(every rank, before a model save) For a ``checkpoint-N`` of the staging folder: make it
        (``Trainer`` writes its files there); rank 0 removes the remote one, marker first."""
        rel = self._rel(output_dir)
        if rel is not None and _CHECKPOINT.fullmatch(rel):
            os.makedirs(output_dir, exist_ok=True)
            if _rank() == 0:
                remove_folder(self.fs, f"{self.root.rstrip('/')}/{rel}")
            _barrier()

    def _rotate(self, limit: int, step: int, best: str | None) -> None:
        keep = [step]  # the checkpoint just committed, and Trainer's best one
        if best and (m := _CHECKPOINT.fullmatch(os.path.basename(best.rstrip("/")))):
            keep.append(int(m[1]))
        for old in to_remove(self._checkpoints(), RetentionPolicy(max(limit, 1)), keep):
            remove_folder(self.fs, self._folder(old))

    def _folder(self, step: int) -> str:
        return f"{self.root.rstrip('/')}/{_name(step)}"

    def _checkpoints(self) -> dict[int, bool]:
        """``{step: complete?}`` of the remote ``checkpoint-N`` folders, asked of the store."""
        entries = ckpt_folder.entries(self.fs, self.root)
        names = [e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries]
        steps = [int(m[1]) for m in map(_CHECKPOINT.fullmatch, names) if m]
        return {s: ckpt_folder.is_complete(self.fs, self._folder(s)) for s in steps}


def _name(step: int) -> str:
    return f"checkpoint-{step}"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
