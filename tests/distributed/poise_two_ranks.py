"""Run by tests/test_distributed.py under `torchrun --nproc_per_node 2` (CPU, gloo):
3 POISE steps, then every rank writes its probe state so the test can compare them."""

import sys
from pathlib import Path

import torch.distributed

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import assert_parameters_moved, trainable_parameters  # noqa: E402
from test_poise_trainer import make_trainer  # noqa: E402


def main(model_dir: str, out: str) -> None:
    trainer = make_trainer(model_dir, Path(out) / "run", save_steps=100, per_device_train_batch_size=4)
    before = trainable_parameters(trainer)
    trainer.train()
    assert_parameters_moved(before, trainer)
    rank = trainer.accelerator.process_index
    trainer.value_estimator.save(Path(out) / f"rank{rank}")
    # Tear gloo down before exit: left to interpreter shutdown, its threads can abort the
    # process ("terminate called without an active exception"), seen once on a busy machine.
    trainer.accelerator.wait_for_everyone()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
