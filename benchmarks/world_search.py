"""A candidate multitask world: the bundled multitask world's build with some tasks' configs and slip rates
replaced, and a GRPO recipe for it, so that a learning curve can say whether RL learns every task there.

    python benchmarks/world_search.py OUT [--config TASK KEY VALUE]... [--slip TASK RATE]... [--drop TASK]...
    poise compare OUT/grpo.yaml --budget-tokens 100000 --seeds 1 --eval-points 5 \
        --set learning_rate=5e-5 --set eval_limit=500 -o CURVE_DIR

Writes the model to OUT/model (`poise_trl.run.toy.build_multitask_model`, seed 0, its defaults) and
OUT/grpo.yaml (`recipes/toy/grpo_multitask.yaml` with the model and the replaced configs). VALUE is YAML;
a dropped task leaves the world (its SFT share goes to the others).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

from poise_trl.run import toy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output_dir", type=Path)
    parser.add_argument("--config", nargs=3, action="append", default=[], metavar=("TASK", "KEY", "VALUE"))
    parser.add_argument("--slip", nargs=2, action="append", default=[], metavar=("TASK", "RATE"))
    parser.add_argument("--drop", action="append", default=[], metavar="TASK")
    cli = parser.parse_args()
    for task in cli.drop:
        if task not in toy.MULTITASK_TASKS:
            parser.error(f"--drop {task}: not a task of the multitask world ({', '.join(toy.MULTITASK_TASKS)})")
        del toy.MULTITASK_TASKS[task], toy.MULTITASK_SLIP_RATES[task]
    for task, key, value in cli.config:
        if task not in toy.MULTITASK_TASKS:
            parser.error(f"--config {task}: not a task of the multitask world ({', '.join(toy.MULTITASK_TASKS)})")
        toy.MULTITASK_TASKS[task][key] = yaml.safe_load(value)
    for task, rate in cli.slip:
        if task not in toy.MULTITASK_SLIP_RATES:
            parser.error(f"--slip {task}: not a task of the multitask world")
        toy.MULTITASK_SLIP_RATES[task] = float(rate)
    card = toy.build_multitask_model(cli.output_dir / "model", progress=False)
    recipe = yaml.safe_load(Path("recipes/toy/grpo_multitask.yaml").read_text())
    recipe["model"] = str(cli.output_dir / "model")
    recipe["dataset"] = toy.multitask_mix()
    (cli.output_dir / "grpo.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    print(json.dumps(card["heldout_sampled_accuracy"]["by_task"], indent=1))


if __name__ == "__main__":
    main()
