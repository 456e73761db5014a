"""Math prompt datasets for RL: a registry of math sets, loaders for files and hub ids (`load_math_dataset`).

Every loader returns a `datasets.Dataset` with TRL's conversational `prompt` column, a string `answer`
column and the source's metadata columns. Rows without a usable question or answer are skipped with one
warning line; multiple-choice sets are refused. The registry: docs/recipes.md ("Datasets").
"""


from __future__ import annotations

import json
import logging
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import pandas
import pyarrow.parquet

from poise_trl.core.loading import BUNDLED_DATA
from poise_trl.tasks import toy_task
from poise_trl.tasks.math_grader import answer_to_str, join_alternatives, last_boxed, normalize_gold_answer

logger = logging.getLogger(__name__)

TOY_EVAL_FILE = BUNDLED_DATA / "toy-arith" / "eval.jsonl"
# `toy_task.generate_spread_problems(SPREAD_EVAL_SIZE, SPREAD_EVAL_SEED)`, shipped so the held-out set never
# changes under a run; tests/test_data.py checks the file against the generator.
SPREAD_EVAL_FILE = TOY_EVAL_FILE.parents[1] / "toy-arith-spread" / "eval.jsonl"
SPREAD_EVAL_SIZE, SPREAD_EVAL_SEED = 240, 10_000

# Candidates in order of preference, matched case-insensitively; dotted names reach into nested fields.
QUESTION_COLUMNS = ("problem", "question", "prompt", "input", "query", "content")
CONTEXT_COLUMNS = ("body", "context", "passage")  # text that comes before the question (SVAMP, OlympiadBench)
ANSWER_COLUMNS = (
    "answer", "final_answer", "gt", "ground_truth", "gt_answer", "expected_answer", "target",
    "reward_model.ground_truth",
)
SOLUTION_COLUMN = "solution"  # a worked solution; its \boxed{} (or GSM8K's `#### x`) is the answer
CHOICE_COLUMNS = ("choices", "options", "option", "endings")
DATA_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv")
SPLIT_NAMES = ("train", "test", "validation", "valid", "val", "dev")
SHOWN_BAD_ROWS = 5  # row numbers named in the skipped-rows warning
# How the user names a column in the command that loaded the data; `poise bench` and `probe-eval` pass
# "--{role}-column COLUMN".
RECIPE_COLUMN_OPTION = "dataset_columns.{role}=COLUMN (recipe key dataset_columns)"


class DatasetFormatError(ValueError):
    """A dataset whose columns or rows cannot be turned into prompt/answer pairs."""


class DatasetUnavailableError(RuntimeError):
    """A hub dataset that could not be loaded (offline, unknown id, unknown split)."""


@dataclass(frozen=True)
class DatasetSpec:
    """A named dataset: where each split comes from and which one is held out for evaluation."""

    description: str
    hub_id: str | None = None
    config: str | None = None
    split: str = "train"  # loaded when the caller names no split
    eval_split: str | None = None  # None: a training corpus with no held-out split
    columns: dict[str, str] | None = None  # for sources whose column names mislead detection
    files: dict[str, Path] = field(default_factory=dict)  # splits shipped with the repo, by name
    generate: Callable[[int, int], list[dict]] | None = None  # builds `split` from (size, seed)
    size: int = 0  # rows in a generated split unless `limit` says otherwise
    clean_question: Callable[[str], str] | None = None


_DAPO_PREAMBLE = "Solve the following math problem step by step. The last line of your response should be"
_DAPO_REMINDER = '\n\nRemember to put your answer on its own line after "Answer:".'


def _strip_dapo_instructions(text: str) -> str:
    """Only the problem: DAPO's "end with `Answer: ...`" wrapper contradicts our `\\boxed{}` convention."""
    if text.startswith(_DAPO_PREAMBLE):
        text = text.partition("\n\n")[2] or text
    return text.split(_DAPO_REMINDER, 1)[0]


def _toy_spec(description: str, generate: Callable[[int, int], list[dict]], test_file: Path) -> DatasetSpec:
    """A toy set: 4000 train rows generated from a seed, the test split shipped in data/."""
    return DatasetSpec(description, generate=generate, size=4000, files={"test": test_file}, eval_split="test")


DATASETS: dict[str, DatasetSpec] = {
    "toy-arith": _toy_spec("integer additions in words, levels 1-4; train generated from a seed, test shipped in "
                           "data/toy-arith", toy_task.generate_problems, TOY_EVAL_FILE),
    "toy-arith-spread": _toy_spec(
        "toy-arith with levels 1-6; the tiny model never solves levels 5-6 (prompt difficulty that varies as much "
        "as a real math set's); train generated from a seed, test shipped in data/toy-arith-spread",
        toy_task.generate_spread_problems, SPREAD_EVAL_FILE),
    "dapo-math-17k": DatasetSpec(
        "DAPO-Math-17k, deduplicated, English subset (open-r1's processing)",
        hub_id="open-r1/DAPO-Math-17k-Processed",
        config="en",
        columns={"question": "prompt", "answer": "solution"},  # here `solution` is the bare answer
        clean_question=_strip_dapo_instructions,
    ),
    "math-500": DatasetSpec("MATH-500", hub_id="HuggingFaceH4/MATH-500", split="test", eval_split="test"),
    "aime24": DatasetSpec("AIME 2024 I and II", hub_id="HuggingFaceH4/aime_2024", eval_split="train"),
    "aime25": DatasetSpec("AIME 2025 I and II", hub_id="math-ai/aime25", split="test", eval_split="test"),
    "amc23": DatasetSpec("AMC 2023", hub_id="math-ai/amc23", split="test", eval_split="test"),
}


def _spec(name: str) -> DatasetSpec:
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; registered datasets: {', '.join(DATASETS)}")
    return DATASETS[name]


def held_out_split(name: str) -> str | None:
    """The split of registered dataset `name` to evaluate on, or None when it has none (pick a benchmark)."""
    return _spec(name).eval_split


# ------------------------------------------------------------------------------------------ reading rows


def _read_json(path: Path) -> list[dict | None]:
    """Rows of a JSON array, a JSON object (one row, or {"data": [rows]}) or JSON lines; a line that is not
    a JSON object becomes None, so that it is reported with the other unusable rows."""
    text = path.read_text(encoding="utf-8-sig")
    try:
        whole = json.loads(text)
    except ValueError:
        whole = None
    if isinstance(whole, list):
        return [row if isinstance(row, dict) else None for row in whole]
    if isinstance(whole, dict):  # {"data": [rows]}, or a file holding one row (MATH's per-problem files)
        table = next(iter(whole.values())) if len(whole) == 1 else None
        return table if isinstance(table, list) and all(isinstance(r, dict) for r in table) else [whole]
    rows = []
    for line in text.splitlines():
        if line.strip():
            try:
                row = json.loads(line)
            except ValueError:
                row = None
            rows.append(row if isinstance(row, dict) else None)
    return rows


def _read_csv(path: Path) -> list[dict]:
    frame = pandas.read_csv(path)
    return [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}
            for row in frame.to_dict("records")]


def _read_file(path: Path) -> list[dict | None]:
    if path.suffix in (".json", ".jsonl"):
        return _read_json(path)
    if path.suffix == ".parquet":
        return pyarrow.parquet.read_table(path).to_pylist()
    return _read_csv(path)


def _data_files(path: Path, split: str | None) -> list[Path]:
    """The data files of a folder: those at its top level, else anywhere below it (MATH's per-problem
    files), narrowed to `split` (`test.jsonl`, `test-00000-of-00002.parquet`, `test/...`) when given."""
    files = sorted(p for p in path.iterdir() if p.suffix in DATA_SUFFIXES and p.is_file())
    files = files or sorted(p for p in path.rglob("*") if p.suffix in DATA_SUFFIXES and p.is_file())
    if split and len(files) > 1:
        files = [
            p for p in files
            if p.stem == split or p.stem.startswith(f"{split}-") or split in p.relative_to(path).parts[:-1]
        ]
    splits = {label for p in files for label in (*p.relative_to(path).parts[:-1], p.stem.split("-")[0])}
    splits &= set(SPLIT_NAMES)
    if not files or len({p.suffix for p in files}) > 1 or (not split and len(splits) > 1):
        found = sorted(p.name for p in path.iterdir())
        raise DatasetFormatError(
            f"{path}: need {'/'.join(DATA_SUFFIXES)} files of one kind (one split's when it holds several: "
            f"pass the split), found {found}"
        )
    return files


def _load_local(path: Path, split: str | None) -> list[dict | None]:
    """Rows of a data file, of the data files in a folder, or of a `datasets` save_to_disk folder."""
    if path.is_dir() and ((path / "dataset_dict.json").exists() or (path / "state.json").exists()):
        saved = datasets.load_from_disk(str(path))
        return _pick_split(saved, split, str(path)).to_list()
    files = _data_files(path, split) if path.is_dir() else [path]
    if files[0].suffix not in DATA_SUFFIXES:
        raise DatasetFormatError(f"{path}: cannot read a {files[0].suffix or 'suffix-less'} file; "
                                 f"give a {'/'.join(DATA_SUFFIXES)} file or a folder holding them")
    rows = []
    for file in files:
        try:
            rows += _read_file(file)
        except Exception as error:  # pyarrow, pandas and json each raise their own kinds
            raise DatasetFormatError(
                f"{file}: could not read it as {file.suffix[1:]}; is it malformed? ({type(error).__name__}: {error})"
            ) from error
    return rows


def _pick_split(loaded, split: str | None, source: str) -> datasets.Dataset:
    if not isinstance(loaded, datasets.DatasetDict):
        return loaded
    if split is not None:
        if split not in loaded:
            raise DatasetFormatError(f"{source} has no split {split!r}; its splits: {', '.join(loaded)}")
        return loaded[split]
    if len(loaded) != 1 and "train" not in loaded:
        raise DatasetFormatError(f"{source} has splits {list(loaded)}; pass the split")
    return loaded["train"] if "train" in loaded else next(iter(loaded.values()))


def _load_hub(hub_id: str, config: str | None, split: str | None) -> list[dict]:
    try:
        loaded = datasets.load_dataset(hub_id, config, split=split)
    except Exception as error:
        raise DatasetUnavailableError(
            f"could not load {hub_id!r}{f' (config {config!r})' if config else ''} from the Hugging Face Hub: "
            f"{type(error).__name__}: {error}\nIf the hub is unreachable here (no network, HF_HUB_OFFLINE=1), "
            "fetch the data where it is reachable and pass a local .jsonl/.json/.parquet/.csv file, or a "
            "directory holding one, instead of the hub id (recipe key `dataset`, or `--data-file` for `poise bench`)."
        ) from error
    return _pick_split(loaded, None, hub_id).to_list()


def _load_registered(name: str, split: str | None, limit: int | None, seed: int) -> list[dict | None]:
    spec = _spec(name)
    split = split or spec.split
    if split in spec.files:
        return _load_local(spec.files[split], None)
    if spec.generate is not None and split == spec.split:
        return spec.generate(limit or spec.size, seed)
    if spec.hub_id is None:
        raise ValueError(f"{name} has no split {split!r}; its splits: {', '.join([spec.split, *spec.files])}")
    return _load_hub(spec.hub_id, spec.config, split)


# --------------------------------------------------------------------------------------------- columns


def _column_names(rows: list[dict], depth: int = 3) -> list[str]:
    """Every column of any row, in first-seen order, nested fields as dotted names."""
    names: dict[str, None] = {}

    def visit(row: dict, prefix: str, level: int) -> None:
        for key, value in row.items():
            names.setdefault(prefix + key, None)
            if isinstance(value, dict) and level < depth:
                visit(value, f"{prefix}{key}.", level + 1)

    for row in rows:
        visit(row, "", 1)
    return list(names)


def _resolve(name: str, names: list[str]) -> str | None:
    """The column `name` refers to, matching case-insensitively when there is no exact match."""
    if name in names:
        return name
    return next((n for n in names if n.lower() == name.lower()), None)


def _value(row, name: str):
    """`row[name]`, following a dotted name into nested fields; None where the row lacks it."""
    if not isinstance(row, dict):
        return None
    if name in row:
        return row[name]
    head, dot, rest = name.partition(".")
    while dot:
        if head in row:
            return _value(row[head], rest)
        more, dot, rest = rest.partition(".")
        head = f"{head}.{more}"
    return None


def _is_conversation(value) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)
    )


def _has_values(rows: list[dict], name: str) -> bool:
    return any(_value(row, name) not in (None, "", []) for row in rows)


@dataclass(frozen=True)
class _Columns:
    question: list[str]  # joined in order: a context column, then the question
    answer: str | None
    solution: str | None  # where a row's answer is dug out of when `answer` has none


def _find_columns(rows: list[dict], columns: dict[str, str] | None, source: str, option: str) -> _Columns:
    names = _column_names(rows)
    columns = columns or {}
    for key, column in columns.items():
        parts = str(column).split("+") if key == "question" else [str(column)]
        if key not in ("question", "answer") or any(_resolve(p.strip(), names) is None for p in parts):
            raise DatasetFormatError(f"{source}: bad column mapping {key!r}: {column!r}; columns found: {names}")

    if "question" in columns:
        question = [_resolve(p.strip(), names) for p in str(columns["question"]).split("+")]
    else:
        main = next((c for c in (_resolve(c, names) for c in QUESTION_COLUMNS) if c), None)
        context = [c for c in (_resolve(c, names) for c in CONTEXT_COLUMNS) if c and c != main]
        question = [*[c for c in context if _has_values(rows, c)], main] if main else []
    if "answer" in columns:
        answer, solution = _resolve(columns["answer"], names), None
    else:
        # A candidate column that is empty in every row loses to a later one with values.
        found = [c for c in (_resolve(c, names) for c in ANSWER_COLUMNS) if c]
        answer = next((c for c in found if _has_values(rows, c)), found[0] if found else None)
        solution = _resolve(SOLUTION_COLUMN, names)

    if not columns:  # before the missing-column error: AQuA's answer column is `correct`
        _refuse_multiple_choice(rows, names, answer, source, option)
    missing = [role for role, ok in (("question", question), ("answer", answer or solution)) if not ok]
    if missing:
        fixes = " and ".join(option.format(role=role) for role in missing)
        raise DatasetFormatError(
            f"{source}: no {' or '.join(missing)} column among {names}. Looked for a question in "
            f"{list(QUESTION_COLUMNS)} and an answer in {list(ANSWER_COLUMNS)} or a '{SOLUTION_COLUMN}' with a "
            f"\\boxed{{}} answer (any case); name it with {fixes}."
        )
    return _Columns(question, answer, solution)


def _refuse_multiple_choice(rows: list[dict], names: list[str], answer: str | None, source: str,
                            option: str) -> None:
    """Multiple-choice sets (MMLU, AQuA, SAT) would be graded on option letters or indices, which a math
    verifier cannot compare to a free-form answer."""
    choices = [c for c in (_resolve(c, names) for c in CHOICE_COLUMNS) if c and _has_values(rows, c)]
    lettered = all(letter in names for letter in "ABCD")
    golds = [answer_to_str(_value(row, answer)).strip("() ") for row in rows] if answer else []
    letters = bool(golds) and all(len(g) == 1 and g in "ABCDE" for g in golds)
    if choices or lettered or letters:
        why = f"column {choices[0]!r}" if choices else "columns A-D" if lettered else "answers are option letters"
        raise DatasetFormatError(
            f"{source}: multiple-choice sets are not supported ({why}): poise grades free-form math answers; "
            f"use a free-answer version of the set, or name the columns with {option.format(role='answer')} "
            "if the answers are free-form after all."
        )


# ------------------------------------------------------------------------------------------------ rows


def _answer_text(value) -> str | None:
    """One gold answer value as text: numbers as written, GSM8K's `reasoning #### 72` as `72`."""
    if value is None or isinstance(value, (dict, list, tuple)) or (isinstance(value, float) and math.isnan(value)):
        return None
    text = answer_to_str(value)
    if "####" in text:
        text = text.rpartition("####")[2]
    return text.strip() or None


def _solution_answer(value) -> str | None:
    """The final answer of a worked solution: its last `\\boxed{}`, or what follows GSM8K's `####`."""
    if isinstance(value, (list, tuple)):  # OlympiadBench keeps several solutions; any of them will do
        value = next((v for v in value if isinstance(v, str) and _solution_answer(v)), None)
    if not isinstance(value, str):
        return None
    if (boxed := last_boxed(value)) is not None:
        return boxed.strip() or None
    if "####" in value:
        return value.rpartition("####")[2].strip() or None
    return None


def _gold(row, columns: _Columns) -> str | None:
    """The row's normalised gold answer; a list holds alternatives (`rewards.join_alternatives`).

    Unless the row marks its elements as parts of one answer (OlympiadBench's `is_multiple_answer`): joined
    with `, `, which the grader reads as a tuple.
    """
    value = _value(row, columns.answer) if columns.answer else None
    texts = [_answer_text(item) for item in (value if isinstance(value, (list, tuple)) else [value])]
    if not any(texts) and columns.solution:
        texts = [_solution_answer(_value(row, columns.solution))]
    golds = [gold for text in texts if text and (gold := normalize_gold_answer(text))]
    if not golds:
        return None
    return ", ".join(golds) if _value(row, "is_multiple_answer") is True else join_alternatives(golds)


def _prompt(row, parts: list[str], prompt_suffix, system_prompt, clean) -> list[dict] | None:
    """TRL conversational prompt for one row; None when its question is empty or not text."""
    question = _value(row, parts[-1])
    if len(parts) == 1 and _is_conversation(question):  # already a chat: the source knows best
        return question
    if not isinstance(question, str) or not question.strip():
        return None
    texts = [v.strip() for v in (_value(row, p) for p in parts[:-1]) if isinstance(v, str) and v.strip()]
    text = "\n".join([*texts, (clean(question) if clean else question).strip()])
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return messages + [{"role": "user", "content": f"{text}\n{prompt_suffix}" if prompt_suffix else text}]


def _metadata(rows: list[dict], skip: set[str]) -> dict[str, list]:
    """The source's other flat columns (level, subject, id, ...), each of one type: numbers of mixed kinds
    become floats, other mixtures strings; nested columns are dropped."""
    kept = {}
    for name in dict.fromkeys(key for row in rows for key in row):
        if name in skip or name.lower() in skip:
            continue
        values = [row.get(name) for row in rows]
        kinds = {type(v) for v in values if v is not None}
        if not kinds or kinds & {list, dict, tuple}:
            continue
        if kinds <= {int, float}:
            values = [v if v is None or len(kinds) == 1 else float(v) for v in values]
        elif len(kinds) > 1:
            values = [None if v is None else str(v) for v in values]
        kept[name] = values
    return kept


def _skipped(bad: dict[str, list[int]], total: int) -> str:
    """`3 of 40 rows (2 with no usable answer in 'answer', 1 with ...; rows 4, 9, 17, counting from 1)`."""
    rows = sorted(i for indices in bad.values() for i in indices)
    reasons = ", ".join(f"{len(indices)} with {what}" for what, indices in bad.items() if indices)
    shown = ", ".join(str(i + 1) for i in rows[:SHOWN_BAD_ROWS]) + (", ..." if len(rows) > SHOWN_BAD_ROWS else "")
    return f"{len(rows)} of {total} rows ({reasons}; row{'s' if len(rows) > 1 else ''} {shown}, counting from 1)"


def load_math_dataset(
    source: str | Path,
    split: str | None = None,
    columns: dict[str, str] | None = None,
    prompt_suffix: str | None = None,
    system_prompt: str | None = None,
    limit: int | None = None,
    seed: int = 0,
    config: str | None = None,
    column_option: str = RECIPE_COLUMN_OPTION,
) -> datasets.Dataset:
    """Load math dataset `source` as prompt/answer pairs for RL.

    `source`: a registered name (DATASETS), a local .json/.jsonl/.parquet/.csv file, a folder, or a hub id
    (with `config`). `columns` maps "question"/"answer" to column names (dotted for nested fields,
    `body+question` joins columns) and overrides detection. The user message is the question plus "\\n" +
    `prompt_suffix`. `limit` keeps a random `limit` usable rows chosen by `seed`, in order (for a generated
    split, the number generated). `column_option` is how errors name a column option, with `{role}`.
    """
    clean = None
    if str(source) in DATASETS:
        rows = _load_registered(str(source), split, limit, seed)
        columns = columns or DATASETS[str(source)].columns
        clean = DATASETS[str(source)].clean_question
    elif Path(source).exists():
        rows = _load_local(Path(source), split)
    elif Path(source).suffix in DATA_SUFFIXES:
        raise FileNotFoundError(f"no such data file: {source}")
    else:
        rows = _load_hub(str(source), config, split)
    if not rows:
        raise DatasetFormatError(f"{source}: the dataset is empty (0 rows)")

    readable = [row for row in rows if isinstance(row, dict)]
    found = _find_columns(readable, columns, str(source), column_option)
    prompts = [_prompt(row, found.question, prompt_suffix, system_prompt, clean) for row in rows]
    answers = [_gold(row, found) for row in rows]
    question_name = "+".join(found.question)
    no_answer = (
        f"no usable answer in '{found.answer}'" if found.answer else f"no \\boxed{{}} answer in '{found.solution}'"
    ) + (f" or its '{found.solution}'" if found.answer and found.solution else "")
    bad = {
        "an unreadable line": [i for i, row in enumerate(rows) if not isinstance(row, dict)],
        f"an empty or non-text question in '{question_name}'": [
            i for i, row in enumerate(rows) if isinstance(row, dict) and prompts[i] is None
        ],
        no_answer: [
            i for i, row in enumerate(rows) if isinstance(row, dict) and prompts[i] is not None and answers[i] is None
        ],
    }
    fix = f"Fix or drop those rows, or name the right columns with {column_option.format(role='answer')}"
    keep = [i for i in range(len(rows)) if prompts[i] is not None and answers[i] is not None]
    if not keep:
        raise DatasetFormatError(f"{source}: no usable row: {_skipped(bad, len(rows))}. {fix}.")
    if len(keep) < len(rows):
        logger.warning("%s: skipped %s. %s.", source, _skipped(bad, len(rows)), fix)
    if limit is not None and len(keep) > limit:
        keep = sorted(random.Random(seed).sample(keep, limit))

    # The question and answer now live in `prompt` and `answer`; other candidate columns would only be
    # stale copies of them, while metadata (level, subject, id, ...) stays for per-group evaluation.
    used = {c.partition(".")[0].lower() for c in [*found.question, found.answer or "", found.solution or ""] if c}
    skip = used | {c.partition(".")[0] for c in (*QUESTION_COLUMNS, *ANSWER_COLUMNS, SOLUTION_COLUMN)}
    metadata = _metadata([rows[i] for i in keep], skip | {"prompt", "answer"})
    return datasets.Dataset.from_dict(
        {"prompt": [prompts[i] for i in keep], "answer": [answers[i] for i in keep], **metadata}
    )
