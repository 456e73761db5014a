"""Reward functions are called once on a dry batch of train rows before training: a broken one stops
`poise train` with one line, exit 2, and nothing written."""

from __future__ import annotations

import pytest
from helpers import assert_one_line_error
from typer.testing import CliRunner

from poise_trl.cli.main import app
from poise_trl.core.loading import load_tokenizer
from poise_trl.tasks import load_prompt_dataset
from poise_trl.tasks.rewards import RewardFunctionError, check_reward_functions, get_reward_functions

BROKEN = [
    ("divides_by_zero", "raised ZeroDivisionError: division by zero on a dry batch of 2 rows; fix it before training"),
    ("one_reward_only", "returned 1 rewards for 2 completions"),
    ("a_number_not_a_list", "returned a float, not a list of rewards"),
    ("text_rewards", "returned '1.0' (str) among its rewards, not a number or None"),
]


@pytest.fixture(scope="module")
def tokenizer(tiny_random_model_dir):
    return load_tokenizer(str(tiny_random_model_dir))


def test_working_reward_functions_pass_the_dry_batch_with_every_argument_trl_gives(tokenizer):
    math_rows = load_prompt_dataset("toy-arith", limit=4, seed=0)
    names = ["math_accuracy", "format", "fixtures.user_rewards:length_penalty",
             "fixtures.user_rewards:needs_trl_arguments"]
    check_reward_functions(get_reward_functions(names), math_rows, tokenizer, names)
    task_rows = load_prompt_dataset("reasoning-gym:leg_counting", limit=4, seed=0)
    check_reward_functions(get_reward_functions(["task"]), task_rows, tokenizer, ["task"])


@pytest.mark.parametrize("function, problem", BROKEN)
def test_a_broken_reward_function_is_named_with_what_went_wrong(tokenizer, function, problem):
    name = f"fixtures.user_rewards:{function}"
    rows = load_prompt_dataset("toy-arith", limit=4, seed=0)
    with pytest.raises(RewardFunctionError) as error:
        check_reward_functions(get_reward_functions(["math_accuracy", name]), rows, tokenizer, ["math_accuracy", name])
    assert f"reward function {name!r} {problem}" in str(error.value)


def test_the_task_reward_on_rows_without_a_task_column_is_caught(tokenizer):
    rows = load_prompt_dataset("toy-arith", limit=2, seed=0)
    with pytest.raises(RewardFunctionError, match="reward function 'task' raised TypeError: .*'task'"):
        check_reward_functions(get_reward_functions(["task"]), rows, tokenizer, ["task"])


@pytest.mark.parametrize("function, problem", [BROKEN[0], BROKEN[1]])
def test_poise_train_stops_before_writing_anything(tmp_path, tiny_random_model_dir, function, problem):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"algo: grpo\nmodel: {tiny_random_model_dir}\ndataset_size: 8\nnum_generations: 2\n"
                      f"per_device_train_batch_size: 4\nrewards: [math_accuracy, fixtures.user_rewards:{function}]\n")
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["train", str(recipe), "--output-dir", str(out)])
    assert_one_line_error(result, result.output, f"reward function 'fixtures.user_rewards:{function}' {problem}")
    assert not out.exists()
