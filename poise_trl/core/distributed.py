"""Cross-process helpers: sums, gathers and broadcasts over the processes of a launch (a no-op in one
process). Trainers pass their accelerator; the critics, which train outside the Trainer, use
torch.distributed directly."""

from __future__ import annotations

import datetime
import os
import re
from contextlib import contextmanager

import torch
import torch.distributed as dist

# What gloo and NCCL raise when a peer died or stopped answering (a collective past its timeout,
# a closed or reset connection): only these send a rank looking for the one it lost. Any other
# error is the rank's own and is raised unchanged.
_PEER_FAILURE = re.compile(r"gloo|nccl|connection (closed|reset)|timed out|broken pipe|watchdog", re.IGNORECASE)


class LostRankError(RuntimeError):
    """A rank or machine of the launch died or stopped answering: the run ends on every other rank."""


def summed_over_processes(accelerator, values: list[float] | torch.Tensor) -> list[float]:
    """Each entry of a small vector of counts or sums, added over all processes (every process passes
    the same number of entries)."""
    local = torch.as_tensor(values, device=accelerator.device)
    return accelerator.gather(local).view(-1, local.numel()).sum(dim=0).tolist()


def gather_padded(accelerator, tensor: torch.Tensor) -> torch.Tensor:
    """(B_local, T_local) -> (B_global, T_max): pad the token dim across processes, then gather."""
    if accelerator.num_processes == 1:
        return tensor
    return accelerator.gather(accelerator.pad_across_processes(tensor, dim=1, pad_index=0))


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def summed_in_place(tensor: torch.Tensor) -> torch.Tensor:
    if world_size() > 1:
        dist.all_reduce(tensor)
    return tensor


def broadcast_from_main(module: torch.nn.Module) -> None:
    if world_size() > 1:
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.data, src=0)


@contextmanager
def naming_a_lost_rank(collective_timeout_s: float):
    """Around training with several processes: every collective of the default group gives up after
    `collective_timeout_s` (the recipe's `ddp_timeout`; transformers hands it to NCCL but not to
    gloo, so it is set here for both). A collective that fails because a peer died (closed
    connection) or stopped answering (past that timeout) becomes a `LostRankError`
    naming that rank and its machine, on every rank still alive, instead of a backend traceback or
    a hang. `torch.distributed.monitored_barrier` names a stopped rank but not a dead one (gloo
    reports a closed connection without its rank), so each rank checks in with rank 0 on a side
    gloo group created here, before training: rank 0 names every rank that fails to check in
    within min(60 s, the collective timeout); the others, whose only peer in that check is rank 0, name rank 0."""
    if world_size() == 1:
        yield
        return
    timeout = datetime.timedelta(seconds=collective_timeout_s)
    dist.distributed_c10d._set_pg_timeout(timeout)  # torch's own setter, also for gloo
    side = dist.new_group(backend="gloo", timeout=timeout)  # every rank creates it, before training starts
    try:
        yield
    except RuntimeError as exc:
        if not _PEER_FAILURE.search(str(exc)):
            raise
        lost = _ranks_not_checking_in(side, min(60.0, collective_timeout_s))
        if not lost:
            raise
        per_machine = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or None
        named = ", ".join(f"rank {r}" + (f" (machine {r // per_machine})" if per_machine else "") for r in lost)
        how = "its connection closed" if re.search(r"connection (closed|reset)|broken pipe", str(exc), re.I) else (
            "no answer within the collective timeout (recipe key ddp_timeout)")
        raise LostRankError(f"{named} of {world_size()} stopped answering ({how}); rank {dist.get_rank()} stops "
                            "too: check that machine, then rerun the same launch on every machine to resume from the "
                            "last checkpoint") from None


def _ranks_not_checking_in(group, timeout_s: float) -> list[int]:
    """Rank 0 waits up to `timeout_s` for each other rank's one-element message on `group`; the
    ranks it does not get are lost. Every other rank sends one; if that fails, rank 0 is lost."""
    timeout = datetime.timedelta(seconds=timeout_s)
    token = torch.zeros(1)
    if dist.get_rank() != 0:
        try:
            dist.isend(token, dst=0, group=group).wait(timeout)
            return []
        except RuntimeError:
            return [0]
    lost = []
    for rank in range(1, world_size()):
        try:
            dist.irecv(token, src=rank, group=group).wait(timeout)
        except RuntimeError:
            lost.append(rank)
    return lost
