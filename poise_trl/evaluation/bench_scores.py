"""How `poise bench` grades and scores samples: math-verify or a task's own verifier per sample, the answer each
sample votes for, and Avg@n, maj@n and pass@k over problems (per task and per problem for task rows)."""

from __future__ import annotations

import math
import re
from decimal import Decimal

from poise_trl.core.metrics import mean_and_stderr, pass_at_k, pass_ks
from poise_trl.evaluation.bench_data import BenchError
from poise_trl.tasks import completion_text, get_family, row_verifiers, score_rows
from poise_trl.tasks.family import extract_tagged_answer
from poise_trl.tasks.math_grader import extract_final_answer

# ------------------------------------------------------------------------------------------- grading


def grade_batch(completions: list, rows: list[dict]) -> list[dict]:
    """What bench stores per completion (a text or a tool-calling conversation) of a batch: `reward` in [0, 1],
    `correct` (reward 1), vote answer."""
    tasks, verifiers = row_verifiers(rows)
    rewards = score_rows(completions, tasks, verifiers)
    return [{"reward": reward, "correct": reward >= 1.0, "answer": voted_answer(task, completion_text(completion))}
            for completion, task, reward in zip(completions, tasks, rewards, strict=True)]


def voted_answer(task: str, text: str) -> str | None:
    """The answer a completion votes for in maj@n: its `<answer>` or its final `\\boxed{}`, as the task asks;
    None for a program, tool calls or a free response."""
    answer_format = get_family(task).answer_format
    if "<answer>" in answer_format:
        return extract_tagged_answer(text)
    return extract_final_answer(text) if "\\boxed" in answer_format else None


def votes_on_answers(task: str) -> bool:
    """Whether maj@n means something for a task: its completions end in an answer to vote on."""
    answer_format = get_family(task).answer_format
    return "<answer>" in answer_format or "\\boxed" in answer_format


_LATEX_NOISE = re.compile(r"\\(?:left|right)(?![A-Za-z])|\\[!,;: ]|\$|\s+|\^\{?\\circ\}?|\\%|%")
_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")
_NUMBER = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|[+-]?\.\d+")


def vote_key(answer: str | None) -> str | None:
    """The form answers are compared in for majority voting, or None (no boxed answer: no vote).

    Formatting is dropped and plain numbers compare by value (`070`, `70.0`, `70`); anything else compares as
    text, so `\\frac{1}{2}` and `0.5` are two answers here.
    """
    if answer is None:
        return None
    key = _TEXT_WRAPPER.sub(r"\1", answer)
    key = _LATEX_NOISE.sub("", key).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").rstrip(".")
    if _NUMBER.fullmatch(key):
        value = Decimal(key.replace(",", ""))
        return format(value.normalize(), "f") if value else "0"
    return key or None


def majority_correct(records: list[dict]) -> bool:
    """maj@n of one problem: the most frequent vote key wins; ties go to the key whose first vote came
    from the lowest sample index. The winner is correct when the earliest sample that voted for it was
    graded correct. No votes at all counts as wrong."""
    counts: dict[str, int] = {}
    first: dict[str, dict] = {}
    for record in sorted(records, key=lambda r: r["sample"]):
        key = vote_key(record["answer"])
        if key is not None:
            counts[key] = counts.get(key, 0) + 1
            first.setdefault(key, record)
    if not counts:
        return False
    winner = max(counts, key=lambda k: (counts[k], -first[k]["sample"]))
    return bool(first[winner]["correct"])


# ------------------------------------------------------------------------------------------- metrics


def reward_of(record: dict) -> float:
    """A graded sample's reward: a task's (partial credit possible) or 1/0 for a math answer, which records
    written before bench stored math rewards give by `correct`."""
    return float(record.get("reward", record["correct"]))


def compute_metrics(records: dict[tuple[int, int], dict], num_problems: int, num_samples: int,
                    voting: bool = True, problems: list[int] | None = None) -> dict:
    """Avg@n, maj@n (`voting`), unbiased pass@k with standard errors, mean length and truncated share."""
    problems = list(range(num_problems)) if problems is None else problems
    by_problem: dict[int, list[dict]] = {i: [] for i in problems}
    for (problem, _), record in records.items():
        if problem in by_problem:
            by_problem[problem].append(record)
    if any(len(rs) != num_samples for rs in by_problem.values()):
        raise BenchError("cannot score an incomplete run: some problems lack samples")
    groups = list(by_problem.values())
    correct = [sum(bool(r["correct"]) for r in rs) for rs in groups]
    scores = {"avg": mean_and_stderr([sum(reward_of(r) for r in rs) / num_samples for rs in groups])}
    if voting:
        scores["maj"] = mean_and_stderr([float(majority_correct(rs)) for rs in groups])
    for k in pass_ks(num_samples):
        scores[f"pass@{k}"] = mean_and_stderr([pass_at_k(num_samples, c, k) for c in correct])
    flat = [r for rs in groups for r in rs]
    return {
        "num_problems": len(problems),
        "num_samples": num_samples,
        "scores": scores,
        "mean_tokens": sum(r["num_tokens"] for r in flat) / len(flat),
        "truncated_fraction": sum(r["truncated"] for r in flat) / len(flat),
        # tool-calling conversations: tool calls per rollout; their tokens count the policy's own
        **({"mean_tool_calls": sum(r["tool_calls"] for r in flat) / len(flat)} if "tool_calls" in flat[0] else {}),
    }


def per_problem_scores(records: dict[tuple[int, int], dict], dataset, num_samples: int) -> list[dict]:
    """Each problem's samples passed, Avg@n and pass@k (HumanEval reports these per problem), with its task
    row id where it has one."""
    ids = dataset["id"] if "id" in dataset.column_names else None
    rows = []
    for problem in range(len(dataset)):
        samples = [records[(problem, j)] for j in range(num_samples)]
        passed = sum(bool(r["correct"]) for r in samples)
        rows.append({"problem": problem, **({"id": ids[problem]} if ids else {}), "passed": passed,
                     "avg": sum(reward_of(r) for r in samples) / num_samples,
                     **{f"pass@{k}": pass_at_k(num_samples, passed, k) for k in pass_ks(num_samples)}})
    return rows


def dataset_metrics(records: dict[tuple[int, int], dict], dataset, num_samples: int) -> dict:
    """A benchmark's scores; for task rows also each task's own (`by_task`, a mix's breakdown) and each
    problem's (`per_problem`)."""
    if "task" not in dataset.column_names:
        return compute_metrics(records, len(dataset), num_samples)
    tasks = dataset["task"]
    names = list(dict.fromkeys(tasks))
    metrics = compute_metrics(records, len(dataset), num_samples, voting=all(map(votes_on_answers, names)))
    metrics["by_task"] = {
        name: compute_metrics(records, len(dataset), num_samples, voting=votes_on_answers(name),
                              problems=[i for i, t in enumerate(tasks) if t == name])
        for name in names
    }
    metrics["per_problem"] = per_problem_scores(records, dataset, num_samples)
    return metrics


def average_over_benchmarks(metrics: list[dict]) -> dict:
    """Unweighted mean over benchmarks of each score they all have; standard errors add in quadrature
    (benchmarks are independent samples)."""
    shared = [key for key in metrics[0]["scores"] if all(key in m["scores"] for m in metrics)]
    count = len(metrics)
    return {
        "num_benchmarks": count,
        "scores": {
            key: {
                "value": sum(m["scores"][key]["value"] for m in metrics) / count,
                "stderr": math.sqrt(sum(m["scores"][key]["stderr"] ** 2 for m in metrics)) / count,
            }
            for key in shared
        },
        "mean_tokens": sum(m["mean_tokens"] for m in metrics) / count,
        "truncated_fraction": sum(m["truncated_fraction"] for m in metrics) / count,
    }
