"""A task mix as a recipe's dataset: weighted shares of each task's own rows, each row routed to its
verifier, a held-out split per task, and the mean reward of each task logged while training."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from helpers import assert_parameters_moved, build_trainer, trainable_parameters

from poise_trl.run.callbacks import HeldOutEvalCallback
from poise_trl.run.recipe import RecipeError, parse_recipe
from poise_trl.run.train import last_task_rewards
from poise_trl.tasks import TaskError, by_task_means, load_prompt_dataset, mix_rows, task_rows
from poise_trl.tasks.reasoning_gym import TEST_SEED_OFFSET
from poise_trl.tasks.rewards import get_reward_functions

CHAIN_SUM, LEG_COUNTING = "reasoning-gym:chain_sum", "reasoning-gym:leg_counting"
SMALL_SUMS = {"min_terms": 2, "max_terms": 2, "max_digits": 1}
SHORT_PROMPT = {"system_prompt": "direct"}  # reasoning-gym's shortest system prompt: faster tiny-model steps


def test_a_mix_has_the_weighted_shares_and_routes_each_row_to_its_verifier():
    mix = [{"name": CHAIN_SUM, "config": SMALL_SUMS}, {"name": LEG_COUNTING, "weight": 3}]
    rows = load_prompt_dataset(mix, limit=40, seed=5)
    assert Counter(rows["task"]) == {CHAIN_SUM: 10, LEG_COUNTING: 30}
    assert rows["task"][:10] != sorted(rows["task"])[:10]  # shuffled, not one task after the other
    task_reward = get_reward_functions(["task"])[0]
    right = [[{"role": "assistant", "content": f"<think>x</think><answer>{gold}</answer>"}] for gold in rows["answer"]]
    wrong = [[{"role": "assistant", "content": "<think>x</think><answer>-1</answer>"}]] * len(rows)
    assert task_reward(right, task=rows["task"], verifier=rows["verifier"]) == [1.0] * 40
    assert task_reward(wrong, task=rows["task"], verifier=rows["verifier"]) == [0.0] * 40


def test_each_task_of_a_mix_gives_exactly_its_own_rows_and_its_held_out_split():
    mix = [{"name": CHAIN_SUM, "size": 7, "seed": 3, "config": SMALL_SUMS}, LEG_COUNTING]
    train, test = mix_rows(mix, "train", 20, seed=11), mix_rows(mix, "test", 6, seed=11)
    by_id = lambda rows: sorted(rows, key=lambda row: row["id"])  # noqa: E731
    for name, size, seed, config in ((CHAIN_SUM, 7, 3, SMALL_SUMS), (LEG_COUNTING, 13, 11, None)):
        mine = [row for row in train if row["task"] == name]
        assert by_id(mine) == by_id(task_rows(name, "train", size, seed, config))
    held_out = {name: [row for row in test if row["task"] == name] for name in (CHAIN_SUM, LEG_COUNTING)}
    assert [len(rows) for rows in held_out.values()] == [3, 3]  # an entry's size counts train rows only
    assert by_id(held_out[CHAIN_SUM]) == by_id(task_rows(CHAIN_SUM, "test", 3, 3, SMALL_SUMS))
    assert by_id(held_out[LEG_COUNTING]) == by_id(task_rows(LEG_COUNTING, "test", 3, 11))


@pytest.mark.parametrize("entry, message", [
    ({"name": CHAIN_SUM, "wieght": 2}, "unknown key 'wieght'; did you mean 'weight'? (allowed: name, weight, size, "
                                       "seed, config)"),
    (3, "neither a task name nor a mapping"),
    ({"name": CHAIN_SUM, "weight": 0}, "weight 0 is not a positive number"),
    ({"name": CHAIN_SUM, "weight": -1}, "weight -1 is not a positive number"),
    ({"name": CHAIN_SUM, "size": 0}, "size 0 is not an integer >= 1"),
    ({"weight": 2}, "has no task name"),
    ("reasoning-gymm:chain_sum", "did you mean 'reasoning-gym'"),
    ("reasoning-gym:chain_summ", "did you mean chain_sum"),
    ({"name": CHAIN_SUM, "config": {"max_term": 2}}, "its keys are"),
])
def test_a_bad_mix_entry_is_one_line_naming_the_fix(entry, message):
    with pytest.raises(TaskError) as error:
        load_prompt_dataset([LEG_COUNTING, entry], limit=4)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_mix_refuses_what_it_cannot_honour():
    with pytest.raises(TaskError, match="set the recipe's dataset_size"):  # weights with no total to share
        mix_rows([{"name": CHAIN_SUM, "weight": 2}, LEG_COUNTING], "train", None, 0)
    with pytest.raises(TaskError, match="leaves none for 'reasoning-gym:leg_counting'"):
        mix_rows([{"name": CHAIN_SUM, "size": 4}, LEG_COUNTING], "train", 4, 0)
    with pytest.raises(TaskError, match="give each entry its own config"):
        load_prompt_dataset([CHAIN_SUM], limit=2, task_config=SMALL_SUMS)
    with pytest.raises(TaskError, match="the task mix is empty"):
        load_prompt_dataset([], limit=2)


def test_a_recipe_with_a_mix_defaults_to_the_task_reward():
    recipe = {"algo": "grpo", "dataset": [CHAIN_SUM, {"name": LEG_COUNTING, "weight": 2}]}
    assert parse_recipe(recipe).settings.rewards == ["task"]
    with pytest.raises(RecipeError, match="give dataset as a string or a list"):
        parse_recipe({"algo": "grpo", "dataset": 3})


def test_by_task_means_leaves_out_rows_no_function_scored():
    tasks = ["b", "a", "b", "a", "c"]
    assert by_task_means(tasks, [1.0, 0.0, 0.0, None, math.nan]) == {"a": 0.0, "b": 0.5}
    assert list(by_task_means(["z", "a"], [1, 2])) == ["a", "z"]


@pytest.mark.slow
def test_training_on_a_mix_logs_each_tasks_reward_and_moves_the_weights(tmp_path, bundled_model_dir):
    mix = [{"name": CHAIN_SUM, "config": {**SMALL_SUMS, **SHORT_PROMPT}},
           {"name": LEG_COUNTING, "config": SHORT_PROMPT}]
    trainer = build_trainer({
        "algo": "poise", "model": str(bundled_model_dir), "dataset": mix, "dataset_size": 8, "eval_limit": 2,
        "rewards": ["task", "fixtures.user_rewards:length_penalty"], "num_generations": 2,
        "per_device_train_batch_size": 8, "max_completion_length": 8, "max_steps": 2, "logging_steps": 1,
        "save_strategy": "no", "learning_rate": 1e-2, "beta": 0.0, "seed": 0,
    }, tmp_path / "run")
    assert Counter(trainer.train_dataset["task"]) == {CHAIN_SUM: 4, LEG_COUNTING: 4}
    held_out = next(c for c in trainer.callback_handler.callbacks if isinstance(c, HeldOutEvalCallback)).dataset
    assert Counter(held_out["task"]) == {CHAIN_SUM: 1, LEG_COUNTING: 1}  # eval_limit shared like dataset_size
    assert all(f"/{TEST_SEED_OFFSET}/" in row_id for row_id in held_out["id"])  # each task's test split
    before = trainable_parameters(trainer)
    trainer.train()
    assert_parameters_moved(before, trainer)
    # 4 prompts a step: the 2 steps see all 8, so both tasks are logged
    assert set(last_task_rewards(trainer.state.log_history)) == {CHAIN_SUM, LEG_COUNTING}
    logged = {key for entry in trainer.state.log_history for key in entry}
    assert {f"rewards/task/{CHAIN_SUM}/mean", f"rewards/task/{LEG_COUNTING}/mean",
            "rewards/task_reward/mean"} <= logged


@pytest.mark.slow
def test_a2po_on_a_mix_logs_each_tasks_reward_too(tmp_path, bundled_model_dir):
    mix = [{"name": CHAIN_SUM, "config": SHORT_PROMPT}, {"name": LEG_COUNTING, "config": SHORT_PROMPT}]
    trainer = build_trainer({
        "algo": "a2po", "model": str(bundled_model_dir), "dataset": mix, "dataset_size": 8, "eval_limit": 2,
        "rewards": ["task", "fixtures.user_rewards:length_penalty"], "num_value_samples": 2,
        "filter_all_incorrect": False, "per_device_train_batch_size": 4, "max_completion_length": 8, "max_steps": 2,
        "logging_steps": 1, "save_strategy": "no", "learning_rate": 1e-2, "seed": 0,
    }, tmp_path / "run")
    before = trainable_parameters(trainer)
    trainer.train()
    assert_parameters_moved(before, trainer)
    assert set(last_task_rewards(trainer.state.log_history)) == {CHAIN_SUM, LEG_COUNTING}


def test_a_runs_held_out_set_shares_no_question_with_its_training_rows():
    """One-digit sums repeat across seeds: 5 of 49 test questions of this config are also among 300 train
    questions. The run's held-out set drops them; a config with nothing left is refused in one line."""
    from poise_trl.run.build import load_datasets

    recipe = {"algo": "grpo", "model": "data/tiny-qwen3", "dataset": "reasoning-gym:basic_arithmetic",
              "task_config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
              "dataset_size": 300, "eval_limit": 50}
    train_set, eval_set = load_datasets(parse_recipe(recipe).settings, seed=0)
    train_prompts = {str(p) for p in train_set["prompt"]}
    assert 40 <= len(eval_set) < 50
    assert not any(str(p) in train_prompts for p in eval_set["prompt"])

    tiny_space = {**recipe, "dataset": "reasoning-gym:count_bits", "task_config": {"max_n": 20}}
    with pytest.raises(RecipeError, match="every held-out question"):
        load_datasets(parse_recipe(tiny_space).settings, seed=0)


def test_poise_on_a_mix_keeps_one_probe_per_task_unless_the_recipe_says_otherwise():
    mix = {"algo": "poise", "model": "data/tiny-qwen3",
           "dataset": ["reasoning-gym:leg_counting", "reasoning-gym:chain_sum"]}
    assert parse_recipe(mix).args.probe_domain_column == "task"
    assert parse_recipe({**mix, "probe_domain_column": None}).args.probe_domain_column is None
    assert parse_recipe({**mix, "dataset": "reasoning-gym:leg_counting"}).args.probe_domain_column is None


def test_math_is_a_task_with_the_datasets_own_rows_and_the_math_grader():
    """`math:toy-arith` holds exactly the rows `dataset: toy-arith` trains and evaluates on, scored as
    `math_accuracy` scores them, so math sits in a mix beside the other families."""
    plain_train = load_prompt_dataset("toy-arith", limit=6, seed=3)
    as_task = task_rows("math:toy-arith", "train", 6, 3)
    assert [r["prompt"] for r in as_task] == plain_train["prompt"]
    assert [r["answer"] for r in as_task] == plain_train["answer"]
    plain_test = load_prompt_dataset("toy-arith", split="test", limit=5, seed=3)
    assert [r["prompt"] for r in task_rows("math:toy-arith", "test", 5, 3)] == plain_test["prompt"]

    mix = mix_rows(["math:toy-arith", "reasoning-gym:leg_counting"], "train", 8, 0)
    texts = [f"\\boxed{{{r['answer']}}}" if r["task"] == "math:toy-arith" else f"<answer>{r['answer']}</answer>"
             for r in mix]
    assert get_reward_functions(["task"])[0](completions=texts, task=[r["task"] for r in mix],
                                            verifier=[r["verifier"] for r in mix]) == [1.0] * 8
    math_rows = [r for r in mix if r["task"] == "math:toy-arith"]
    assert get_reward_functions(["math_accuracy"])[0](completions=["\\boxed{-1}"] * len(math_rows),
                                                     answer=[r["answer"] for r in math_rows]) == [0.0] * len(math_rows)
    with pytest.raises(TaskError, match="registered dataset"):
        task_rows("math:toy-arithm", "train", 2, 0)
