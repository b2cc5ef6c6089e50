"""A training script's last steps, run as a real process (``test_exit.py`` starts two).

argv: rank world rendezvous-file run-folder mode. It saves steps with a ``CheckpointManager``
and ends the way scripts do: ``sync`` saves, then ``destroy_process_group()``; ``async-open``
starts an async save and ends without waiting for it or closing the manager (the exit hook
must commit it and destroy the manager's groups). At exit, after every other exit hook (this
one is registered first, so it runs last), it prints which Python threads are still alive.
"""

from __future__ import annotations

import atexit
import sys
import threading


@atexit.register
def _report() -> None:
    alive = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())
    print(f"ALIVE AT EXIT: {alive}", flush=True)


def main() -> None:
    rank, world, rendezvous, run, mode = (
        int(sys.argv[1]),
        int(sys.argv[2]),
        sys.argv[3],
        sys.argv[4],
        sys.argv[5],
    )
    import torch
    import torch.distributed as dist

    from hf_dcp_storage import CheckpointManager

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    sd = {
        "w": distribute_tensor(
            torch.arange(64.0).reshape(16, 4), mesh, [Shard(0)], src_data_rank=None
        )
    }
    manager = CheckpointManager(run, keep_last_n=2)
    manager.save(1, sd, {"opt": {"m": torch.ones(8)}, "epoch": 1})
    if mode == "sync":
        manager.save(2, sd, {"opt": {"m": torch.ones(8)}, "epoch": 2})
        manager.close()
        dist.destroy_process_group()
    else:
        manager.save(2, sd, {"opt": {"m": torch.ones(8)}, "epoch": 2}, async_save=True)
    print("MAIN DONE", flush=True)


if __name__ == "__main__":
    main()
