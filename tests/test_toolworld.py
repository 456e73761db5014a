"""The tool world (poise_trl/tasks/toolworld.py, `poise toy build --world toolworld`): a question that takes two
dependent tool calls, its environment fresh for every rollout, the oracle conversation scoring 1 and a slipped one 0,
the world's model built small, and GRPO training on it with the tool calls counted."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import build_trainer
from transformers import AutoTokenizer

from poise_trl.engines.tools import ToolError, ToolRuntime
from poise_trl.run.toy import (
    TOOLWORLD_ENVIRONMENT,
    build_model,
    build_toolworld_model,
    toolworld_sft_dataset,
    toolworld_tokenizer,
)
from poise_trl.tasks import score_rows, task_rows
from poise_trl.tasks.toolworld import ToolWorld, solution


def verifier(row) -> dict:
    return json.loads(row["verifier"])


def test_every_row_hides_its_own_table_and_the_splits_are_drawn_apart():
    train, test = task_rows("toolworld", "train", 500, 0), task_rows("toolworld", "test", 100, 0)
    assert not {r["prompt"][0]["content"] for r in train} & {r["prompt"][0]["content"] for r in test}
    for row in train + test:  # the table is hidden: the question names the key and the addend only
        v = verifier(row)
        assert row["prompt"][0]["content"] == f"What is the value of key {v['key']} plus {v['addend']}?"
        assert int(row["answer"]) == v["table"][v["key"]] + v["addend"] and len(v["table"]) == 4
    assert task_rows("toolworld", "test", 100, 0) == test  # deterministic from the seed
    assert task_rows("toolworld", "test", 100, 1) != test


def test_the_oracle_conversation_scores_1_and_a_slipped_one_0():
    rows = task_rows("toolworld", "test", 50, 3)
    environment = ToolWorld()
    finals = []
    for row in rows:
        environment.reset(**row)
        (lookup, value), (add, total), (final, _) = solution(verifier(row))
        assert str(environment.lookup(**json.loads(lookup.split("\n")[1])["arguments"])) == value
        assert str(environment.add(**json.loads(add.split("\n")[1])["arguments"])) == total
        finals.append(final)
    assert score_rows(finals, [r["task"] for r in rows], [r["verifier"] for r in rows]) == [1.0] * len(rows)
    wrong = [final.replace(">", ">1", 1) for final in finals]  # another number
    assert score_rows(wrong, [r["task"] for r in rows], [r["verifier"] for r in rows]) == [0.0] * len(rows)
    # a conversation whose add() was fed a miscopied value ends on a wrong answer
    import random

    slipped = solution(verifier(rows[0]), slip_rate=1.0, rng=random.Random(0))
    assert score_rows([slipped[-1][0]], ["toolworld"], [rows[0]["verifier"]]) == [0.0]


def test_each_rollout_gets_a_fresh_environment_with_its_own_table():
    first, second = task_rows("toolworld", "test", 2, 0)
    tools = ToolRuntime([], TOOLWORLD_ENVIRONMENT, 10.0, 64, toolworld_tokenizer())
    environment = tools.environment_factory(ToolWorld)
    a, b = environment(), environment()
    a.reset(**first), b.reset(**second)
    key = verifier(first)["key"]
    assert a.lookup(key=key) == str(verifier(first)["table"][key])
    with pytest.raises(ToolError, match="no key"):  # the other rollout's table does not hold it
        b.lookup(key=key)
    assert a.calls == [["lookup", key]] and b.calls == [["lookup", key]]
    a.reset(**second)  # the next prompt: its own table, no call of the last rollout left
    assert a.calls == [] and a.table == verifier(second)["table"]
    tools.close()


@pytest.mark.slow
def test_the_world_builds_end_to_end(tmp_path):
    """The build's every part, cut short (the study builds it with the default settings)."""
    card = build_toolworld_model(tmp_path, max_steps=2, batch_size=4, stages=1, eval_samples=1, eval_rows=4,
                                 progress=False)
    assert (tmp_path / "model.safetensors").stat().st_size < 3_000_000
    assert card["heldout_sampled_accuracy"]["num_prompts"] == 4 and card["sft"]["max_steps"] == 2
    assert card["heldout_accuracy_without_tools"]["accuracy"] == 0.0  # the table is out of its reach
    saved = AutoTokenizer.from_pretrained(tmp_path)  # the compact template, and TRL's parser of Qwen3's tool calls
    assert saved.chat_template == toolworld_tokenizer().chat_template and saved.response_template is not None


@pytest.fixture(scope="module")
def taught_model(tmp_path_factory):
    """A tiny model overfit to the oracle conversations of the 8 training rows a run of seed 0 draws: it calls
    lookup and add as the world's model does, in seconds rather than the build's minutes."""
    out = tmp_path_factory.mktemp("toolworld-taught")
    tokenizer = toolworld_tokenizer()
    model = build_model(tokenizer, seed=0, hidden_size=64, num_layers=2)
    rows = toolworld_sft_dataset(8, 0, tokenizer, slip_rate=0.0)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    for step in range(200):
        row = rows[step % len(rows)]
        ids, mask = torch.tensor(row["input_ids"]), torch.tensor(row["assistant_masks"])
        model(input_ids=ids[None], labels=ids.masked_fill(mask == 0, -100)[None]).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.mark.slow
def test_grpo_trains_with_the_tools_and_counts_their_calls(tmp_path, taught_model):
    recipe = {"algo": "grpo", "model": str(taught_model), "dataset": "toolworld", "environment": TOOLWORLD_ENVIRONMENT,
              "max_tool_calling_iterations": 3, "dataset_size": 8, "eval_limit": 4, "eval_every": 0,
              "eval_num_samples": 1, "per_device_train_batch_size": 4, "num_generations": 2,
              "max_completion_length": 320, "max_steps": 1, "logging_steps": 1, "save_strategy": "no",
              "learning_rate": 1e-4, "seed": 0, "rewards": ["task"], "temperature": 0.2}
    trainer = build_trainer(recipe, tmp_path / "run")
    trainer.train()
    (log,) = [entry for entry in trainer.state.log_history if "tools/calls" in entry]
    assert log["tools/calls"] >= 4 and log["tools/turns_per_rollout"] > 2, log  # lookup, add, then the answer
    assert trainer.state.global_step == 1
