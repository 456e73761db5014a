"""`poise grade`: score completions that already exist (saved outputs, another system's generations) with each
dataset row's verifier, the same grading `poise bench` and training use.

The completions file is JSONL with a `completion` field per line: either one line per dataset row, in the
dataset's order, or lines with an `index` field naming their row (several lines may name one row: n samples).
The output is JSONL, one line per completion, in the input's order: `index`, `reward` (in [0, 1]), `correct`
(reward 1), the task where the row has one, and the answer bench would vote for.
"""

from __future__ import annotations

import json
from pathlib import Path

from poise_trl.bench_data import BenchError
from poise_trl.bench_scores import grade_batch, reward_of
from poise_trl.provenance import package_versions, write_json, write_text


def read_completions(path: str | Path, num_rows: int) -> list[tuple[int, str]]:
    """(row index, completion text) for each line of the completions file; one line naming the problem when
    the file does not match the dataset."""
    path = Path(path)
    if not path.is_file():
        raise BenchError(f"--completions {path}: no such file")
    lines = [(number, line) for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if line.strip()]
    if not lines:
        raise BenchError(f"{path} holds no completions")
    items, indexed = [], None
    for number, line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            raise BenchError(f"{path} line {number} is not JSON: write one JSON object per line") from None
        if not isinstance(record, dict) or not isinstance(record.get("completion"), str):
            raise BenchError(f"{path} line {number} has no `completion` string field")
        has_index = "index" in record
        if indexed is None:
            indexed = has_index
        elif indexed != has_index:
            raise BenchError(f"{path} line {number}: give `index` on every line or on none")
        index = record["index"] if has_index else len(items)
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < num_rows:
            raise BenchError(f"{path} line {number}: index {index!r} is not a row of the dataset (0..{num_rows - 1})")
        items.append((index, record["completion"]))
    if not indexed and len(items) != num_rows:
        raise BenchError(f"{path} has {len(items)} completions for {num_rows} dataset rows: give one per row in "
                         "order, or an `index` field on each line")
    return items


def grade_completions(dataset, items: list[tuple[int, str]]) -> list[dict]:
    """One graded record per (row index, completion), by the row's own verifier (math rows: math-verify)."""
    graded = grade_batch([text for _, text in items], [dataset[index] for index, _ in items])
    tasks = dataset["task"] if "task" in dataset.column_names else None
    return [{"index": index, **({"task": tasks[index]} if tasks else {}), "reward": reward_of(record),
             "correct": bool(record["correct"]), "answer": record["answer"]}
            for (index, _), record in zip(items, graded, strict=True)]


def summarize(records: list[dict]) -> dict:
    """Mean reward and share correct, overall and per task (the dataset's name where rows have no task)."""
    groups: dict[str, list[dict]] = {}
    for record in records:
        groups.setdefault(record.get("task", "all"), []).append(record)

    def stats(rs: list[dict]) -> dict:
        return {"completions": len(rs), "mean_reward": sum(r["reward"] for r in rs) / len(rs),
                "correct": sum(r["correct"] for r in rs) / len(rs)}

    return {**stats(records), "by_task": {name: stats(rs) for name, rs in groups.items()}}


def run_grade(dataset, completions: str | Path, output: str | Path, source: dict, overwrite: bool = False) -> dict:
    """Grade `completions` against `dataset`; writes the per-completion rewards to `output` (JSONL) and the
    summary beside it (`<output>.summary.json`); refuses to replace an existing output unless `overwrite`."""
    output = Path(output)
    summary_path = output.with_name(output.name + ".summary.json")
    if not overwrite and (output.exists() or summary_path.exists()):
        raise BenchError(f"{output} exists: give another --output, or --overwrite to replace it")
    records = grade_completions(dataset, read_completions(completions, len(dataset)))
    summary = {"completions": str(completions), "dataset": source, **summarize(records), "versions": package_versions()}
    write_text(output, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    write_json(summary_path, summary)
    return summary
