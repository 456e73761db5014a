"""Every GRPO-based algorithm trains through the seam in each rollout mode of TRL's GRPOTrainer beyond one
turn: `tools=`, `environment_factory=` and `rollout_func=`, given in the recipe by import path. The bundled
tokenizers carry Qwen3's chat template, which TRL recognises for tool calls."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import VARYING_REWARD, assert_parameters_moved, build_trainer, trainable_parameters
from transformers import AutoTokenizer
from trl.chat_template_utils import add_response_schema, supports_tool_calling

from poise_trl.algorithms import algorithms
from poise_trl.core.loading import resolve_model_path
from poise_trl.run.recipe import RecipeError
from poise_trl.run.toy import SFT_CHAT_TEMPLATE
from poise_trl.seam.grpo import GRPOSeam

GRPO_BASED = sorted(name for name, algorithm in algorithms().items() if issubclass(algorithm.trainer_class, GRPOSeam))
MODES = {
    "tools": {"tools": ["fixtures.user_rollouts:add"]},
    "environment": {"environment": "fixtures.user_rollouts:Counter"},
    "rollout_func": {"rollout_func": "fixtures.user_rollouts:sample_twice"},
}


def mode_recipe(model_dir, algo, mode):
    return {"algo": algo, "model": str(model_dir), "dataset": "toy-arith", "dataset_size": 8, "eval_limit": 2,
            "eval_every": 0, "per_device_train_batch_size": 4, "num_generations": 2, "max_completion_length": 8,
            "max_steps": 1, "save_strategy": "no", "learning_rate": 1e-3, "seed": 0, "rewards": [VARYING_REWARD],
            **({"probe_bootstrap_steps": 1} if algo.startswith("poise") else {}),
            **({"value_warmup_steps": 0} if algo == "vapo" else {}), **MODES[mode]}


@pytest.mark.parametrize("world", ["tiny-qwen3", "tiny-qwen3-multitask"])
def test_bundled_tokenizers_take_tools_and_render_prompts_as_in_supervised_training(world):
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(f"data/{world}"))
    assert supports_tool_calling(tokenizer)
    parsed = add_response_schema(tokenizer).parse_response(
        '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>', prefix="")
    assert parsed["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 3, "b": 4}}
    questions = [json.loads(line)["question"] for line in Path(resolve_model_path("data/toy-arith"), "eval.jsonl")
                 .read_text().splitlines()]
    prompts = [[{"role": "user", "content": question}] for question in questions] + [
        [{"role": "system", "content": "Answer in \\boxed{}."}, {"role": "user", "content": questions[0]}]]
    for prompt in prompts:
        assert tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True) == \
            tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True,
                                          chat_template=SFT_CHAT_TEMPLATE)


@pytest.mark.slow
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("algo", GRPO_BASED)
def test_every_algorithm_trains_in_every_rollout_mode(tmp_path, tiny_random_model_dir, algo, mode):
    trainer = build_trainer(mode_recipe(tiny_random_model_dir, algo, mode), tmp_path / "run")
    assert bool(trainer.tools) == (mode in ("tools", "environment"))  # an environment's methods are tools
    assert (trainer.environment_factories is not None) == (mode == "environment")
    assert (trainer.rollout_func is not None) == (mode == "rollout_func")
    before = trainable_parameters(trainer)
    trainer.train()
    assert_parameters_moved(before, trainer)
    if algo.startswith("poise"):  # no TRL no-grad pass, and several generate calls build a rollout
        assert trainer.feature_sources == {"trl_pass": 0, "generation": 0, "extra_pass": 1}


@pytest.mark.slow
def test_poise_with_tools_reads_its_features_on_trls_own_pass_where_trl_runs_one(tmp_path, tiny_random_model_dir):
    """Tool calls build a rollout from several generate calls, so the generate call cannot serve the features;
    with num_iterations 2, TRL runs its own no-grad pass over the whole rollout and the features ride on it."""
    recipe = mode_recipe(tiny_random_model_dir, "poise", "tools") | {"num_iterations": 2}
    trainer = build_trainer(recipe, tmp_path / "run")
    assert trainer.generation_capture_blocker is not None and trainer.trl_runs_no_grad_pass()
    trainer.train()
    assert trainer.feature_sources == {"trl_pass": 1, "generation": 0, "extra_pass": 0}
    assert [e["probe/features_from_trl_pass"] for e in trainer.state.log_history if "probe/features_from_trl_pass"
            in e] == [1.0]


def test_a_trainer_without_rollout_modes_refuses_them_in_one_line(tmp_path, tiny_random_model_dir):
    recipe = {"algo": "a2po", "model": str(tiny_random_model_dir), "tools": "fixtures.user_rollouts:add"}
    with pytest.raises(RecipeError, match="algo a2po cannot take tools"):
        build_trainer(recipe, tmp_path / "run")


def test_a_tool_that_does_not_import_is_one_line(tmp_path, tiny_random_model_dir):
    recipe = mode_recipe(tiny_random_model_dir, "grpo", "tools") | {"tools": ["fixtures.user_rollouts:nowhere"]}
    with pytest.raises(ValueError, match="tool 'fixtures.user_rollouts:nowhere': module 'fixtures.user_rollouts' "
                                         "has no 'nowhere'"):
        build_trainer(recipe, tmp_path / "run")
    assert not (tmp_path / "run").exists()
