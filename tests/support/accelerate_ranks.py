"""What each of 2 gloo CPU ranks runs for ``tests/test_accelerate.py`` (module-level functions: the
spawned ranks import them by name).

The model is a tiny ``transformers`` Llama (built from a ``LlamaConfig``, no download), each
decoder layer and the root ``fully_shard``-ed (FSDP2) over the 2 ranks, trained with AdamW and a
per-step LambdaLR on fixed random tokens (each rank its own). A run trains ``SAVE_AT`` steps,
saves, trains to ``STEPS``; a resume builds a fresh model (another init) and optimizer, loads the
save and trains to ``STEPS``. Each writes ``rank<r>.pt`` under ``out``: its final local shards of
every parameter and optimizer tensor, the scheduler's last LR and step, and (rank 0) the full
weights at the save.

accelerate refuses FSDP on CPU (``accelerate/state.py`` 947-974: ``DistributedType.FSDP`` is set
only for the GPU-like ``MULTI_*`` types; ``Accelerator(cpu=True)`` is ``MULTI_CPU`` and drops the
plugin). The ``save_state`` and ``Trainer`` runs therefore set the distributed type to ``FSDP``
(in PartialState's and AcceleratorState's shared state both) and give it the plugin by hand,
after which ``prepare`` keeps the model we sharded (accelerate's ``fsdp2_prepare_model`` returns
an ``FSDPModule`` as it is) and ``save_state`` / ``load_state`` / ``Trainer`` take their FSDP
branch, as on GPUs.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

STEPS, SAVE_AT, BATCH, SEQ = 5, 3, 2, 8
DIMS = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32,
    "tie_word_embeddings": False,
}


def hf_config() -> Any:
    import transformers

    return transformers.LlamaConfig(**DIMS)


def lora_config() -> Any:
    """LoRA on q_proj and v_proj."""
    import peft

    return peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


def _accelerator(rank: int, world: int, *, force_fsdp: bool) -> Any:
    # What accelerate launch would set; the gloo group itself is already up (tests/support/dist).
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="1",
    )
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    assert accelerator.distributed_type == DistributedType.MULTI_CPU  # the plugin was dropped
    if force_fsdp:
        # Both shared states: each AcceleratorState() copies PartialState's over its own.
        PartialState().distributed_type = DistributedType.FSDP
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
    return accelerator, plugin


def _model(seed: int) -> torch.nn.Module:
    import transformers

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(hf_config())
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _optim(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + 0.1 * s))
    return optimizer, scheduler


def _train(model: Any, optimizer: Any, scheduler: Any, rank: int, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(1000 * rank + step)
        tokens = torch.randint(0, DIMS["vocab_size"], (BATCH, SEQ), generator=g)
        logits = model(input_ids=tokens).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def _record(model: Any, optimizer: Any, scheduler: Any, out: str, rank: int, **more: Any) -> None:
    def local(t: Any) -> Any:
        return t.to_local().clone() if isinstance(t, DTensor) else t

    osd = get_optimizer_state_dict(model, getattr(optimizer, "optimizer", optimizer))
    record = {
        "params": {k: local(v) for k, v in get_model_state_dict(model).items()},
        "optimizer": {
            f"{fqn}.{name}": local(v)
            for fqn, values in osd["state"].items()
            for name, v in values.items()
        },
        "lr": scheduler.get_last_lr(),
        "last_epoch": getattr(scheduler, "scheduler", scheduler).last_epoch,
        **more,
    }
    Path(out).mkdir(parents=True, exist_ok=True)
    torch.save(record, Path(out) / f"rank{rank}.pt")


def _full(model: Any) -> dict[str, torch.Tensor]:
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {k: v.clone() for k, v in get_model_state_dict(model, options=options).items()}


def fsdp_utils_run(rank: int, world: int, url: str, options: Any, out: str, resume: bool) -> None:
    """accelerate's own ``save_fsdp_model`` / ``save_fsdp_optimizer`` (or the loads), called
    through ``accelerate.utils``, routed to ours; the scheduler's state is kept in memory (it is
    not theirs to save)."""
    import accelerate.utils as acc_utils

    from hf_dcp_storage.integrations.accelerate import route_fsdp_checkpoints

    accelerator, plugin = _accelerator(rank, world, force_fsdp=False)
    routing = route_fsdp_checkpoints(
        storage_options=options, companions={"config.json": hf_config().to_json_string()}
    )
    model = _model(seed=1 if resume else 0)
    optimizer, scheduler = _optim(model)
    full = {}
    if resume:
        acc_utils.load_fsdp_model(plugin, accelerator, model, url)
        acc_utils.load_fsdp_optimizer(plugin, accelerator, optimizer, model, url)
        scheduler.load_state_dict(torch.load(Path(out).parent / "scheduler.pt"))
    else:
        _train(model, optimizer, scheduler, rank, range(SAVE_AT))
        acc_utils.save_fsdp_model(plugin, accelerator, model, url)
        acc_utils.save_fsdp_optimizer(plugin, accelerator, optimizer, model, url)
        full = _full(model)
        if rank == 0:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            torch.save(scheduler.state_dict(), Path(out).parent / "scheduler.pt")
    _train(model, optimizer, scheduler, rank, range(SAVE_AT, STEPS))
    routing.remove()
    _record(model, optimizer, scheduler, out, rank, full_at_save=full if rank == 0 else {})


def save_state_run(rank: int, world: int, folder: str, out: str, resume: bool) -> None:
    """``Accelerator.save_state`` / ``load_state`` under FSDP (forced, see the module docstring)
    with the routing on: model and optimizer through ours, the scheduler, RNG and step
    accelerate's."""
    from hf_dcp_storage.integrations.accelerate import route_fsdp_checkpoints

    accelerator, _ = _accelerator(rank, world, force_fsdp=True)
    model = _model(seed=1 if resume else 0)
    optimizer, scheduler = _optim(model)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    with route_fsdp_checkpoints(companions={"config.json": hf_config().to_json_string()}):
        if resume:
            accelerator.load_state(folder)
        else:
            _train(model, optimizer, scheduler, rank, range(SAVE_AT))
            accelerator.save_state(folder)
    _train(model, optimizer, scheduler, rank, range(SAVE_AT, STEPS))
    _record(model, optimizer, scheduler, out, rank)


def save_state_mirror_run(
    rank: int, world: int, staging: str, remote: str, options: Any, out: str, resume: bool
) -> None:
    """``save_state`` / ``load_state`` to ``remote`` through ``TrainerCheckpointMirror``: saved
    into ``staged(SAVE_AT)`` and committed; the resume from a fresh staging folder (another
    machine's) takes the newest complete checkpoint."""
    from hf_dcp_storage.integrations.accelerate import route_fsdp_checkpoints
    from hf_dcp_storage.integrations.accelerate_trainer import TrainerCheckpointMirror

    accelerator, _ = _accelerator(rank, world, force_fsdp=True)
    model = _model(seed=1 if resume else 0)
    optimizer, scheduler = _optim(model)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    companions = {"config.json": hf_config().to_json_string()}
    with route_fsdp_checkpoints(storage_options=options, companions=companions) as routing:
        mirror = TrainerCheckpointMirror(
            remote, f"{staging}-{'resumed' if resume else 'first'}", routing, options
        )
        full = {}
        if resume:
            accelerator.load_state(mirror.resume_checkpoint())
        else:
            _train(model, optimizer, scheduler, rank, range(SAVE_AT))
            accelerator.save_state(mirror.staged(SAVE_AT))
            mirror.commit(SAVE_AT, keep=1)
            full = _full(model)
    _train(model, optimizer, scheduler, rank, range(SAVE_AT, STEPS))
    _record(model, optimizer, scheduler, out, rank, full_at_save=full if rank == 0 else {})


def step_checkpoints_run(
    rank: int, world: int, root: str, options: Any, out: str, resume: bool
) -> None:
    """``AcceleratorCheckpoints``: a step folder every step, keep the last 2; the resume loads
    the step ``SAVE_AT`` (not the newest) and trains on."""
    from hf_dcp_storage.integrations.accelerate import AcceleratorCheckpoints

    accelerator, _ = _accelerator(rank, world, force_fsdp=False)
    model = _model(seed=1 if resume else 0)
    optimizer, scheduler = _optim(model)
    optimizer, scheduler = accelerator.prepare(optimizer, scheduler)
    ckpts = AcceleratorCheckpoints(
        root,
        keep_last_n=2,
        keep_every=SAVE_AT,
        storage_options=options,
        companions={"config.json": hf_config().to_json_string()},
    )
    extra = {"epoch": 0}
    full = {}
    if resume:
        assert ckpts.load(model, optimizer, scheduler, step=SAVE_AT, extra=extra) == SAVE_AT
        assert extra == {"epoch": SAVE_AT * 10}
        _train(model, optimizer, scheduler, rank, range(SAVE_AT, STEPS))
    else:
        for step in range(STEPS):
            _train(model, optimizer, scheduler, rank, range(step, step + 1))
            extra["epoch"] = (step + 1) * 10
            ckpts.save(step + 1, model, optimizer, scheduler, extra=extra)
            if step + 1 == SAVE_AT:
                full = _full(model)
    ckpts.close()
    _record(model, optimizer, scheduler, out, rank, full_at_save=full if rank == 0 else {})


def peft_run(rank: int, world: int, url: str, options: Any, out: str) -> None:
    """A LoRA adapter on the sharded model, trained a step, saved by accelerate's
    ``save_fsdp_model(adapter_only=True)`` routed to ours; rank 0 records the full adapter."""
    import accelerate.utils as acc_utils
    import peft

    from hf_dcp_storage.integrations.accelerate import route_fsdp_checkpoints

    accelerator, plugin = _accelerator(rank, world, force_fsdp=False)
    import transformers

    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(hf_config())
    model = peft.get_peft_model(base, lora_config())
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, DIMS["vocab_size"], (BATCH, SEQ), generator=g)
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    with route_fsdp_checkpoints(storage_options=options):
        acc_utils.save_fsdp_model(plugin, accelerator, model, url, adapter_only=True)
    adapter = peft.get_peft_model_state_dict(model, state_dict=_full(model))
    if rank == 0:
        Path(out).mkdir(parents=True, exist_ok=True)
        torch.save(adapter, Path(out) / "adapter.pt")


def trainer_run(
    rank: int,
    world: int,
    output_dir: str,
    out: str,
    resume: bool,
    remote: str | None = None,
    options: Any = None,
    kill_at_save: int | None = None,
    resume_step: int | None = None,
) -> None:
    """HF ``Trainer`` under FSDP (forced, as for ``save_state_run``: a documented subclass sets
    it after Trainer made its Accelerator), 6 steps, ``checkpoint-N`` every 2 steps,
    ``save_total_limit=2``, the routing on; the resume continues from ``checkpoint-4``.

    With ``remote``, ``output_dir`` is the local staging folder of a ``TrainerCheckpointMirror``
    to ``remote``, and the resume continues from what ``resume_checkpoint(resume_step)``
    fetched (by default the newest complete checkpoint). ``kill_at_save=k``: the job is
    SIGKILLed during the ``k``-th save, once rank 1's weights bytes are written (``run_job``)."""
    import transformers
    from accelerate import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    from hf_dcp_storage.integrations.accelerate import FSDPRouting, route_fsdp_checkpoints
    from hf_dcp_storage.integrations.accelerate_trainer import TrainerCheckpointMirror

    _accelerator(rank, world, force_fsdp=False)  # the environment accelerate launch would set
    if kill_at_save is not None:
        _die_at_save(FSDPRouting, "save_fsdp_model", kill_at_save)

    class FSDPOnCPUTrainer(transformers.Trainer):
        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            plugin = FullyShardedDataParallelPlugin(
                fsdp_version=2, state_dict_type="SHARDED_STATE_DICT"
            )
            PartialState().distributed_type = DistributedType.FSDP
            self.accelerator.state.distributed_type = DistributedType.FSDP
            self.accelerator.state.fsdp_plugin = plugin
            self.is_fsdp_enabled = True

    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, DIMS["vocab_size"], (16, SEQ), generator=g)
    data = [{"input_ids": t, "labels": t} for t in tokens]
    args = transformers.TrainingArguments(
        output_dir=output_dir,
        use_cpu=True,
        per_device_train_batch_size=2,
        max_steps=6,
        save_steps=2,
        save_total_limit=2,
        learning_rate=1e-2,
        lr_scheduler_type="linear",
        logging_steps=1,
        report_to=[],
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
    )
    model = _model(seed=1 if resume else 0)
    companions = {"config.json": hf_config().to_json_string()}
    routing = route_fsdp_checkpoints(storage_options=options, companions=companions)
    if remote is None:
        start = f"{output_dir}/checkpoint-4" if resume else None
        callbacks = []
    else:
        mirror = TrainerCheckpointMirror(remote, output_dir, routing, options)
        start = mirror.resume_checkpoint(resume_step) if resume else None
        callbacks = [mirror]
    trainer = FSDPOnCPUTrainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
    trainer.train(resume_from_checkpoint=start)
    routing.remove()
    full = _full(trainer.model)  # a collective: every rank gathers
    _record(
        trainer.model,
        trainer.optimizer,
        trainer.lr_scheduler,
        out,
        rank,
        global_step=trainer.state.global_step,
        resumed_from=start,
        full_at_save=full if rank == 0 else {},
    )


def _die_at_save(owner: Any, name: str, k: int) -> None:
    """Arm the kill (rank 1's weights written: the job dies) at the ``k``-th call of
    ``owner.name`` in this rank."""
    from tests.support.killpoints import arm

    save, calls = getattr(owner, name), []

    @functools.wraps(save)  # route_fsdp_checkpoints checks the signature
    def kth_call_dies(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == k:
            arm("late-write", "job", 1)
        return save(*args, **kwargs)

    setattr(owner, name, kth_call_dies)


def killed_step_checkpoints_run(rank: int, world: int, root: str, options: Any) -> None:
    """``step_checkpoints_run``'s saves, the job SIGKILLed during the 2nd (step 2's weights)."""
    from hf_dcp_storage.integrations.accelerate import AcceleratorCheckpoints

    _die_at_save(AcceleratorCheckpoints, "save", 2)
    step_checkpoints_run(rank, world, root, options, "/nonexistent", False)
