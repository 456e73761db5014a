"""Cross-process helpers: sums, gathers and broadcasts over the processes of a launch (a no-op in one
process). Trainers pass their accelerator; the critics, which train outside the Trainer, use
torch.distributed directly."""

from __future__ import annotations

import torch
import torch.distributed as dist


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
