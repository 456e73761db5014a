"""Run by tests/test_multinode.py under `torchrun --nproc_per_node 2` (CPU, gloo): rank 1 fails with an
error of its own (not a peer's) between two all-reduces inside `naming_a_lost_rank`; each rank prints
what reached it."""

import datetime
import sys

import torch
import torch.distributed as dist

from poise_trl.core.distributed import naming_a_lost_rank

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
try:
    with naming_a_lost_rank(collective_timeout_s=10):
        values = torch.ones(1)
        dist.all_reduce(values)
        if dist.get_rank() == 1:
            raise RuntimeError("CUDA out of memory (the rank's own failure)")
        dist.all_reduce(values)
except RuntimeError as exc:
    print(f"rank {dist.get_rank()}: {type(exc).__name__}: {exc}", flush=True)
    sys.exit(2)
