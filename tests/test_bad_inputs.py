"""Bad input, across every command: exit code 2, exactly one `error:` line on stderr naming
the problem, no traceback, and no file of an existing (finished) run folder changed."""

import json
import os
import shutil

import pytest
from helpers import VARYING_REWARD, assert_saved_weights_moved
from typer.testing import CliRunner

from poise_trl.cli.main import app
from poise_trl.run.recipe import load_recipe
from poise_trl.run.train import train_from_recipe

TINY = {
    "algo": "poise", "dataset": "toy-arith", "dataset_size": 16, "eval_limit": 4, "eval_every": 0,
    "eval_num_samples": 1, "eval_max_new_tokens": 8, "num_generations": 2, "per_device_train_batch_size": 4,
    "max_completion_length": 8, "max_steps": 1, "logging_steps": 1, "save_steps": 1, "learning_rate": 1e-3,
    "seed": 0, "probe_bootstrap_steps": 1, "probe_prompt_components": 2, "probe_response_components": 2,
    "rewards": [VARYING_REWARD],
}

# (command line, text the one error line must contain). Placeholders: {recipe} a valid tiny
# POISE recipe ({grpo_recipe} the same for GRPO), {model} its model, {run} a finished run of it (the output
# folder of every train case), {truncated} / {bad_tokenizer} / {no_template} broken copies of the model, {file} a
# plain file, {foreign} a folder of someone's files, {no_answers} a jsonl without answers.
CASES = [
    # poise train: the recipe and its overrides
    (["train", "{dir}/missing.yaml"], "not found"),
    (["train", "{dir}/not_yaml.yaml"], "is not valid YAML"),
    (["train", "{dir}/a_list.yaml"], "must be a mapping"),
    (["train", "{recipe}", "num_generation=2"], "did you mean 'num_generations'"),
    (["train", "{recipe}", "max_steps"], "is not of the form key=value"),
    (["train", "{recipe}", "=3"], "has an empty key"),
    (["train", "{recipe}", "learning_rate=abc"], "learning_rate: 'abc' is not a number"),
    (["train", "{recipe}", "max_steps=ten"], "max_steps: 'ten' is not an integer"),
    (["train", "{recipe}", "max_steps=2.5"], "max_steps: 2.5 is not an integer"),
    (["train", "{recipe}", "max_steps=0"], "max_steps: 0 is not a number of steps"),
    (["train", "{recipe}", "max_steps=-5"], "max_steps: -5 is not a number of steps"),
    (["train", "{recipe}", "max_steps=-1"], "max_steps: -1 is not a number of steps"),
    (["train", "{recipe}", "num_generations=1"], "POISE needs at least 2 rollouts per prompt"),
    (["train", "{grpo_recipe}", "num_generations=1"], "GRPO needs at least 2 rollouts per prompt"),
    (["train", "{recipe}", "num_generations=0"], "num_generations: 0 is out of range"),
    (["train", "{recipe}", "temperature=0"], "temperature: 0 is out of range: give temperature > 0"),
    (["train", "{recipe}", "top_p=1.5"], "top_p: 1.5 is out of range: give top_p a probability in [0, 1]"),
    (["train", "{recipe}", "learning_rate=-1e-3"], "learning_rate: -0.001 is out of range"),
    (["train", "{recipe}", "per_device_train_batch_size=0"], "per_device_train_batch_size: 0 is out of range"),
    (["train", "{recipe}", "per_device_train_batch_size=3"], "not divisible by num_generations=2"),
    (["train", "{recipe}", "eval_every=-1"], "eval_every: -1 is out of range"),
    (["train", "{recipe}", "eval_temperature=-1"], "eval_temperature: -1 is out of range"),
    (["train", "{recipe}", "dataset_size=0"], "dataset_size: 0 is out of range"),
    (["train", "{recipe}", "epsilon=-0.2"], "epsilon: -0.2 is out of range"),
    (["train", "{recipe}", "seed=abc"], "seed: 'abc' is not an integer"),
    (["train", "{recipe}", "peft.r=0"], "peft.r: 0 is out of range"),
    (["train", "{recipe}", "peft.r=4", "peft.lora_dropout=2"], "peft.lora_dropout: 2 is out of range"),
    (["train", "{recipe}", "peft=[1]"], "peft: [1] is not a mapping"),
    (["train", "{recipe}", "rewards=[nonsense]"], "unknown reward function(s): nonsense"),
    (["train", "{recipe}", "rewards=7"], "rewards: 7 is not a list"),
    (["train", "{recipe}", "algo=poisee"], "unknown algo 'poisee'; did you mean 'poise'?"),
    (["train", "{recipe}", "budget_tokens=100", "budget_rollouts=8"],
     "set budget_tokens or budget_rollouts, not both"),
    (["train", "{recipe}", "--push-to-hub"], "push_to_hub needs the repository to push to"),
    # poise train: model, data, output folder
    (["train", "{recipe}", "model={dir}/nowhere"], "cannot load a tokenizer"),
    (["train", "{recipe}", "model={truncated}"], "model.safetensors is truncated or corrupt"),
    (["train", "{recipe}", "model={bad_tokenizer}"], "tokenizer.json is not valid JSON"),
    (["train", "{recipe}", "model={no_template}"], "has no chat template"),
    (["train", "{recipe}", "dataset=no-such-dataset"], "no-such-dataset"),
    (["train", "{recipe}", "dataset=toy-arithh"], "unknown dataset 'toy-arithh'; did you mean 'toy-arith'?"),
    (["train", "{recipe}", "dataset={no_answers}"], "answer"),
    (["train", "{recipe}", "resume_from_checkpoint={dir}/nowhere"], "resume_from_checkpoint: "),
    (["train", "{recipe}", "-o", "{file}"], "is a file: give a folder path"),
    (["train", "{recipe}", "-o", "{file}/run"], "cannot be created"),
    (["train", "{recipe}", "-o", "{foreign}"], "holds files that are not from poise train (notes.txt)"),
    (["train", "{recipe}", "-o", "{foreign}", "--overwrite"], "holds files that are not from poise train"),
    (["train", "{recipe}", "max_steps=2"], "holds a run made with other settings (max_steps (1 -> 2))"),
    (["train", "{recipe}", "resume_from_checkpoint=false", "-o", "{cut}"], "resume_from_checkpoint: false, but"),
    (["train", "{recipe}", "--no-such-flag"], "No such option: --no-such-flag"),
    (["train"], "Missing argument 'RECIPE'"),
    # poise compare
    (["compare", "{recipe}"], "give exactly one budget"),
    (["compare", "{recipe}", "--budget-tokens", "100", "--seeds", "0"], "--seeds must be >= 1"),
    (["compare", "{recipe}", "--budget-tokens", "abc"], "Invalid value for '--budget-tokens'"),
    (["compare", "{dir}/missing.yaml", "--budget-tokens", "100"], "not found"),
    (["compare", "{recipe}", "--budget-tokens", "100", "--set", "max_steps=ten"],
     "max_steps: 'ten' is not an integer"),
    # poise bench / probe-eval
    (["bench", "toy-arith", "--model", "{truncated}", "-o", "{run}"], "model.safetensors is truncated or corrupt"),
    (["bench", "no-such-benchmark", "--model", "{model}", "-o", "{run}"], "no-such-benchmark"),
    (["bench", "toy-arith", "--model", "{model}", "--n-samples", "zero", "-o", "{run}"],
     "Invalid value for '--n-samples'"),
    (["bench", "toy-arith", "--model", "{model}", "--n-samples", "0", "-o", "{run}"],
     "--n-samples, --batch-size and --max-new-tokens must be at least 1"),
    (["bench", "toy-arith", "--model", "{model}", "--n", "2", "-o", "{run}"], "No such option: --n"),
    (["bench", "toy-arithh", "--model", "{model}", "-o", "{run}"], "did you mean 'toy-arith'?"),
    (["probe-eval", "--model", "{model}", "--dataset", "math500", "-o", "{run}"], "did you mean 'math-500'?"),
    (["probe-eval", "--model", "{model}", "--dataset", "no-such-dataset", "-o", "{run}"], "no-such-dataset"),
    (["probe-eval", "--model", "{truncated}", "--dataset", "toy-arith", "-o", "{run}"],
     "model.safetensors is truncated or corrupt"),
    # poise toy
    (["toy", "build", "-o", "{model}"], "already holds a model: give --overwrite"),
    (["toy", "build", "-o", "{file}"], "is a file"),
    (["toy", "build-critic", "-o", "{model}"], "already holds a model: give --overwrite"),
    (["toy", "build", "--max-steps", "many"], "Invalid value for '--max-steps'"),
    (["no-such-command"], "No such command 'no-such-command'"),
]


def write_recipe(path, **values):
    path.write_text("\n".join(f"{k}: {json.dumps(v)}" for k, v in values.items()) + "\n")
    return path


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_random_model_dir):
    """The files the cases name, and a finished run every train case points at."""
    root = tmp_path_factory.mktemp("bad-inputs")
    model = root / "model"
    shutil.copytree(tiny_random_model_dir, model)
    recipe = write_recipe(root / "recipe.yaml", model=str(model), **TINY)
    grpo = {k: v for k, v in TINY.items() if not k.startswith("probe_")}
    grpo_recipe = write_recipe(root / "grpo.yaml", model=str(model), **{**grpo, "algo": "grpo"})
    train_from_recipe(load_recipe(recipe), str(root / "run"), show_progress=False)
    cut = root / "cut"  # an unfinished run of the same recipe
    shutil.copytree(root / "run", cut)
    (cut / "summary.json").unlink()
    (root / "not_yaml.yaml").write_text("algo: [poise\n")
    (root / "a_list.yaml").write_text("- algo: poise\n")
    (root / "file").write_text("not a folder\n")
    (root / "foreign").mkdir()
    (root / "foreign" / "notes.txt").write_text("someone's notes\n")
    (root / "no_answers.jsonl").write_text('{"question": "1 + 1?"}\n')
    broken = {}
    for name in ("truncated", "bad_tokenizer", "no_template"):
        broken[name] = root / name
        shutil.copytree(model, broken[name])
    os.truncate(broken["truncated"] / "model.safetensors", 2000)
    text = (broken["bad_tokenizer"] / "tokenizer.json").read_text()
    (broken["bad_tokenizer"] / "tokenizer.json").write_text(text[: len(text) // 2])
    config = json.loads((broken["no_template"] / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (broken["no_template"] / "tokenizer_config.json").write_text(json.dumps(config))
    (broken["no_template"] / "chat_template.jinja").unlink(missing_ok=True)
    return {"dir": root, "recipe": recipe, "grpo_recipe": grpo_recipe, "model": model, "run": root / "run", "cut": cut,
            "file": root / "file", "foreign": root / "foreign", "no_answers": root / "no_answers.jsonl", **broken}


def snapshot(*folders):
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns, p.read_bytes())
            for folder in folders for p in sorted(folder.rglob("*")) if p.is_file()}


def fill(args, world):
    args = [arg.format(**world) for arg in args]
    if args and args[0] == "train" and "-o" not in args and len(args) > 1:
        args += ["-o", str(world["run"])]
    return args + (["--no-progress"] if args and args[0] == "train" and len(args) > 1 else [])


def test_the_finished_run_trained(world):
    assert_saved_weights_moved(world["model"], world["run"] / "final")


def test_the_table_covers_every_command():
    assert len(CASES) >= 40
    assert {case[0][0] for case in CASES} >= {"train", "compare", "bench", "probe-eval", "toy"}


@pytest.mark.slow
@pytest.mark.parametrize(("args", "expected"), CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_input_is_one_line_and_changes_nothing(world, args, expected):
    before = snapshot(world["run"], world["cut"], world["model"], world["foreign"])
    result = CliRunner().invoke(app, fill(args, world), env={"COLUMNS": "1000"})
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 2, (result.exit_code, result.stderr[-2000:], repr(result.exception))
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
    assert "Traceback" not in result.output
    assert expected in lines[0], lines[0]
    assert snapshot(world["run"], world["cut"], world["model"], world["foreign"]) == before
