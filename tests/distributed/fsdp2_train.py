"""Run by tests/test_fsdp.py under `accelerate launch --config_file recipes/accelerate/fsdp2.yaml
--num_processes 2` (CPU, gloo): `train_from_recipe`, what `poise train` runs, under accelerate's
own FSDP2 path (its `fully_shard` of every decoder block and the root, sharded optimizer,
FSDP checkpoint save and load).

accelerate 1.15 enables FSDP only for GPU-like devices: with no GPU its state is MULTI_CPU and
the Trainer would wrap the model in DDP. The one change made here is to that decision: where
accelerate would pick MULTI_CPU while its FSDP plugin is configured, it picks FSDP, which is the
branch a GPU launch takes. Everything after it (preparing, sharding, saving, loading) is
accelerate's and the Trainer's own code, unpatched."""

import json
import sys

import torch.distributed
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType

_accelerator_state_init = AcceleratorState.__init__


def _fsdp_on_cpu(self, *args, fsdp_plugin=None, **kwargs):
    _accelerator_state_init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
        self.distributed_type = DistributedType.FSDP
        self.fsdp_plugin = fsdp_plugin
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # as AcceleratorState does on GPUs


AcceleratorState.__init__ = _fsdp_on_cpu

from poise_trl.train import train_from_recipe  # noqa: E402


def main(recipe_json: str, out: str) -> None:
    train_from_recipe(json.loads(recipe_json), out, show_progress=False)
    # Tear gloo down before exit: left to interpreter shutdown, its threads can abort the process.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
