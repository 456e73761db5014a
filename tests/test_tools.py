"""Tools and environments run where a hang can be killed (poise_trl/engines/tools.py): a tool that raises, hangs or
gets bad arguments answers the model with one error line, counted, and training goes on; an environment's state
lives in its worker between calls, one instance per rollout."""

from __future__ import annotations

import json
import textwrap
import time

import pytest
import torch
from fixtures.user_rollouts import add, fail, hang
from helpers import build_trainer

from poise_trl.engines.tools import ToolError, ToolRuntime
from poise_trl.run.toy import build_model, build_tokenizer
from poise_trl.tasks import load_prompt_dataset

TOOLS = [f"fixtures.user_rollouts:{name}" for name in ("add", "fail", "hang")]  # in MyEnv's order: one schema
# What the taught model writes: a call that hangs, one that raises, one with arguments add() does not take.
CALLS = [("hang", {"seconds": 60}), ("fail", {"text": "x"}), ("add", {"x": 1})]
MY_ENV = '''
class MyEnv:
    """A running total whose methods are the model's tools (their schema is that of fixtures.user_rollouts' tools,
    which the taught model was shown); the reward reads its state."""

    def reset(self, **row):
        self.total = 0

    def add(self, a: int, b: int) -> int:
        """Adds two integers.

        Args:
            a: The first integer.
            b: The second integer.

        Returns:
            The sum of a and b.
        """
        self.total += a + b
        return self.total

    def fail(self, text: str) -> str:
        """Always raises, as a tool with a bug does.

        Args:
            text: Anything.

        Returns:
            Nothing: it raises.
        """
        raise ValueError(f"cannot handle {text!r}")

    def hang(self, seconds: int) -> str:
        """Waits, as a tool stuck on a network call does.

        Args:
            seconds: How long to wait.

        Returns:
            Never in time.
        """
        import time

        time.sleep(seconds)
        return "woke up"

    def get_reward(self) -> float:
        return float(self.total)
'''


@pytest.fixture
def my_env(tmp_path, monkeypatch):
    """`my_env.py` in the working directory, as a user's own environment module."""
    (tmp_path / "my_env.py").write_text(textwrap.dedent(MY_ENV))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # what import_object does for the working directory
    return "my_env:MyEnv"


def runtime(tool_paths=(), environment=None, timeout_s=2.0, result_tokens=64):
    return ToolRuntime(list(tool_paths), environment, timeout_s, result_tokens, build_tokenizer())


def test_a_raising_a_hanging_and_a_badly_called_tool_each_answer_one_line_and_are_counted():
    tools = runtime(TOOLS, timeout_s=1.0)
    add_tool, fail_tool, hang_tool = tools.tools([add, fail, hang])
    assert add_tool(a=2, b=3) == "5"
    with pytest.raises(ToolError, match="^ValueError: cannot handle 'x'$"):
        fail_tool(text="x")
    with pytest.raises(ToolError, match=r"bad arguments for add: .*'a'.*call it as add\(a: int, b: int\)"):
        add_tool(x=1)
    started = time.monotonic()
    with pytest.raises(ToolError, match="hang did not answer within 1s and was stopped"):
        hang_tool(seconds=60)
    assert time.monotonic() - started < 10
    assert add_tool(a=1, b=1) == "2"  # a fresh worker took the killed one's place
    assert (tools.calls, tools.errors, tools.timeouts) == (5, 2, 1)
    tools.close()


def test_a_long_result_is_cut_at_the_token_limit():
    tools = runtime(TOOLS, result_tokens=8)
    (add_tool,) = tools.tools([add])
    assert add_tool(a=10**30, b=0) == "10000000 [... cut at 8 tokens]"
    tools.close()


def test_an_environment_keeps_its_state_per_rollout_and_restarts_after_a_timeout(my_env):
    from my_env import MyEnv

    tools = runtime(environment=my_env, timeout_s=1.0)
    stand_in = tools.environment_factory(MyEnv)
    assert stand_in.__name__ == "MyEnv" and stand_in.add.__doc__ == MyEnv.add.__doc__
    first, second = stand_in(), stand_in()
    first.reset(prompt="a"), second.reset(prompt="b")
    assert first.add(a=1, b=2) == "3" and first.add(a=1, b=1) == "5"  # state survives between calls
    assert second.add(a=0, b=1) == "1"  # and is not shared with another rollout
    assert first.total == 5 and first.get_reward() == 5.0  # a reward reads the instance's state
    with pytest.raises(ToolError, match="the environment restarted from its initial state"):
        first.hang(seconds=60)
    assert first.total == 0 and second.total == 1
    first.reset(prompt="c")
    assert first.add(a=2, b=2) == "4"
    tools.close()


def teach_tool_calls(out, tools) -> None:
    """A tiny random model overfit to answer every toy question with CALLS in Qwen3's tool-call format."""
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=0, hidden_size=64, num_layers=2)
    model.config.max_position_embeddings = 4096  # the tool schemas in the system prompt take ~1,000 tokens
    answer = "\n".join(f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'
                       for name, arguments in CALLS) + "<|im_end|>"
    rows = []
    for row in load_prompt_dataset("toy-arith", split=None, seed=0, limit=8):  # the runs' own prompts
        prompt = tokenizer.apply_chat_template(row["prompt"], tools=tools, tokenize=False, add_generation_prompt=True)
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
        rows.append((torch.tensor(prompt_ids + answer_ids), len(prompt_ids)))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    for step in range(300):
        ids, start = rows[step % len(rows)]
        labels = ids.clone()
        labels[:start] = -100
        loss = model(input_ids=ids[None], labels=labels[None]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


@pytest.fixture(scope="module")
def tool_calling_model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tool-calling-qwen3")
    teach_tool_calls(out, [add, fail, hang])
    return out


def toy_recipe(model_dir, algo, **mode):
    return {"algo": algo, "model": str(model_dir), "dataset": "toy-arith", "dataset_size": 4, "eval_limit": 2,
            "eval_every": 0, "per_device_train_batch_size": 2, "num_generations": 2, "max_completion_length": 768,
            "max_steps": 1, "logging_steps": 1, "save_strategy": "no", "learning_rate": 1e-3, "seed": 0,
            "rewards": ["helpers:length_parity_reward"], "tool_timeout": 0.5, "max_tool_calling_iterations": 1,
            "temperature": 0.2,  # the taught model writes its calls whole
            **({"probe_bootstrap_steps": 1} if algo == "poise" else {}), **mode}


def trained_log(trainer) -> dict:
    trainer.train()
    (log,) = [entry for entry in trainer.state.log_history if "tools/calls" in entry]
    return log


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["poise", "grpo", "asyppo"])
def test_hanging_raising_and_badly_called_tools_leave_the_run_going_counted(tmp_path, tool_calling_model_dir, algo):
    trainer = build_trainer(toy_recipe(tool_calling_model_dir, algo, tools=TOOLS), tmp_path / "run")
    log = trained_log(trainer)
    assert log["tools/timeouts"] >= 1 and log["tools/errors"] >= 1, log
    assert log["tools/calls"] >= log["tools/errors"] + log["tools/timeouts"]
    assert log["tools/turns_per_rollout"] > 1  # the model answered again after the tool results
    assert trainer.state.global_step == 1


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["poise", "grpo", "asyppo"])
def test_an_environment_from_the_working_directory_trains(tmp_path, tool_calling_model_dir, my_env, algo):
    trainer = build_trainer(toy_recipe(tool_calling_model_dir, algo, environment=my_env), tmp_path / "run")
    log = trained_log(trainer)
    assert log["tools/timeouts"] >= 1 and log["tools/errors"] >= 1, log
    assert "rewards/MyEnv/mean" in log  # the environment's own reward, read from its worker
    assert trainer.state.global_step == 1


@pytest.mark.slow
@pytest.mark.parametrize("span", ["last_turn", "all_turns"])
def test_poise_with_tools_reads_the_policys_own_tokens_on_one_extra_pass(tmp_path, tool_calling_model_dir, span):
    """With tools, each round's features come from one extra pass (no generate call sees a whole rollout, and TRL
    runs no pass of its own here), counted and logged; they read the span of the policy's own tokens, TRL's
    `tool_mask` masking the tool results as in its loss: the same as `extract_features` over that span, and not
    what reading every completion token gives."""
    from poise_trl.probe.capture import extract_features
    from poise_trl.probe.features import policy_span

    trainer = build_trainer(toy_recipe(tool_calling_model_dir, "poise", tools=TOOLS, probe_span=span),
                            tmp_path / "run")
    seen = []

    def compute_advantages(rewards, output):
        need, model = trainer.feature_need, trainer.model
        read = {name: extract_features(model, output["prompt_ids"], output["prompt_mask"], output["completion_ids"],
                                       output["completion_mask"], need.think_end_id, [need.layer], 2,
                                       trainer.temperature, need.pool_tokens, mask)[need.layer]
                for name, mask in (("span", policy_span(output["completion_mask"], output["tool_mask"], span)),
                                   ("every_token", None))}
        seen.append((trainer.round.features, read, output["tool_mask"] * output["completion_mask"]))
        return type(trainer).compute_advantages(trainer, rewards, output)

    trainer.compute_advantages = compute_advantages
    log = trained_log(trainer)
    assert trainer.feature_need.span == span
    assert trainer.feature_sources == {"trl_pass": 0, "generation": 0, "extra_pass": 1}
    assert log["probe/features_from_extra_pass"] == 1.0
    ((features, read, own),) = seen
    assert (own == 0).any()  # the rollouts hold tool results
    torch.testing.assert_close(features.to_matrix(), read["span"].to_matrix(), rtol=0, atol=1e-5)
    assert not torch.allclose(features.entropy, read["every_token"].entropy, atol=1e-3)
