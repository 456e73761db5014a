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
from pathlib import Path

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

from safetensors.torch import save_file  # noqa: E402
from transformers import Trainer  # noqa: E402

from poise_trl.run.train import train_from_recipe  # noqa: E402

_trainer_train = Trainer.train
trained = []


def _recording_train(self, *args, **kwargs):
    trained.append(self)
    return _trainer_train(self, *args, **kwargs)


Trainer.train = _recording_train


def save_rank_state(trainer, out: Path) -> None:
    """This process's probe (POISE) or critic weights (AsyPPO / PPO / VAPO), for a test to compare across processes."""
    rank = trainer.accelerator.process_index
    if hasattr(trainer, "value_estimator"):
        trainer.value_estimator.save(out / f"rank{rank}-probe")
    if hasattr(trainer, "critics"):
        save_file({f"critic{m}.{name}": tensor.detach().contiguous()
                   for m, critic in enumerate(trainer.critics.critics)
                   for name, tensor in critic.state_dict().items()},
                  out / f"rank{rank}-critics.safetensors")


def main(recipes_json: str, out: str, rank_state: str = "") -> None:
    """Train each recipe of the JSON list into OUT/<index>-<algo> (one recipe: into OUT itself);
    with `rank_state`, every process also writes its probe / critic state there."""
    recipes = json.loads(recipes_json)
    recipes = recipes if isinstance(recipes, list) else [recipes]
    for index, recipe in enumerate(recipes):
        folder = Path(out) if len(recipes) == 1 else Path(out) / f"{index}-{recipe['algo']}"
        train_from_recipe(recipe, str(folder), show_progress=False)
        if rank_state:
            save_rank_state(trained[-1], folder)
    # Tear gloo down before exit: left to interpreter shutdown, its threads can abort the process.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
