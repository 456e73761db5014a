"""`poise bench`: sample n completions per problem on math benchmarks, grade them with the toolkit's
math-verify reward, and report Avg@n, pass@k, maj@n and response lengths.

Runs are resumable. Every graded sample is appended to `<output_dir>/<bench>/samples.jsonl` as soon as its
batch finishes (flush + fsync), keyed by (problem index, sample index); a re-run with the same settings
generates only what is missing. Samples are drawn in *blocks* (up to `batch_size` samples of one problem)
whose seed depends only on (seed, block size, problem, block), so what a resumed run generates does not
depend on what an interrupted one had finished: resumed results are those of a fresh run.
`<output_dir>/<bench>/settings.json` records what the samples depend on, and a run with other settings is
refused instead of mixing samples.

A benchmark is a registered name (BENCHMARKS), a registered dataset, a local file or folder, or a hub id, in
any schema poise_trl.prompts reads. The `poise` preset is the paper's protocol (seed 000, Sec. 4.1: Avg@32 at
T=0.6, top-p 0.95 on AMC23/24, AIME24/25/26, HMMT25, BRUMO25). Results are also written as EvalScope
reports (`<output_dir>/reports/<model>/<bench>.json`, so `evalscope app --outputs <parent of output_dir>`
lists them) and can be added to a hub model card as model-index entries (`eval_results`).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

from poise_trl.generation import ENGINES, Engine, Sample, close_vllm_engines, load_engine
from poise_trl.loading import resolve_model_path
from poise_trl.metrics import mean_and_stderr, pass_at_k, pass_ks
from poise_trl.progress import progress_bars
from poise_trl.prompts import (
    DATA_SUFFIXES,
    DATASETS,
    DatasetUnavailableError,
    held_out_split,
    load_prompt_dataset,
)
from poise_trl.provenance import package_versions, write_json
from poise_trl.tasks import FAMILIES, extract_tagged_answer, get_family, is_task, score_rows
from poise_trl.tasks.math_grader import extract_final_answer, is_correct

# The instruction of the reference protocol (DeepSeek-R1 / MathArena style evaluations).
REFERENCE_SUFFIX = "Please output the final answer within \\boxed{}."


class BenchError(ValueError):
    """A benchmark run the user must fix; the message says how."""


@dataclass(frozen=True)
class Benchmark:
    source: str | None  # a name in poise_trl.prompts's registry, or a hub dataset id; None: --data-file only
    split: str | None = None  # a hub id's split; registered names use their held-out split
    prompt_suffix: str | None = REFERENCE_SUFFIX
    max_new_tokens: int = 32768  # reasoning models need long budgets on competition math


# Names that poise_trl.prompts already registers are passed to it as names, so hub ids live in one place.
# The other ids were checked by searching stored copies of huggingface.co pages and public code, not by
# downloading (no network here): MathArena/aime_2026's dataset card lists `problem` and `answer` columns
# and 30 problems in a `train` split; MathArena/hmmt_feb_2025 and MathArena/brumo_2025 are in MathArena's
# dataset list (30 rows each) and other evaluation code loads them with split="train". No public AMC 2024
# copy with integer answers was found (the AMC is multiple choice; the known integer-answer sets stop at
# 2023), so amc24 needs --data-file.
BENCHMARKS: dict[str, Benchmark] = {
    "aime24": Benchmark("aime24"),
    "aime25": Benchmark("aime25"),
    "aime26": Benchmark("MathArena/aime_2026", "train"),
    "amc23": Benchmark("amc23"),
    "amc24": Benchmark(None),
    "hmmt25": Benchmark("MathArena/hmmt_feb_2025", "train"),
    "brumo25": Benchmark("MathArena/brumo_2025", "train"),
    "math-500": Benchmark("math-500"),
    # The tiny model was trained on bare questions; 96 tokens is the budget training evaluates it with.
    "toy-arith": Benchmark("toy-arith", prompt_suffix=None, max_new_tokens=96),
}


@dataclass(frozen=True)
class Preset:
    """A published evaluation protocol: its benchmarks and sampling settings."""

    benchmarks: tuple[str, ...]
    num_samples: int
    temperature: float
    top_p: float
    max_new_tokens: int


# The POISE paper's protocol (seed 000, Sec. 4.1; max new tokens from the reference evaluation in
# docs/poise-spec.md). amc24 has no verified hub copy: give it with --data-file amc24=FILE.
PRESETS: dict[str, Preset] = {
    "poise": Preset(("amc23", "amc24", "aime24", "aime25", "aime26", "hmmt25", "brumo25"), 32, 0.6, 0.95, 8192),
}
DEFAULT_SAMPLING = {"num_samples": 32, "temperature": 0.6, "top_p": 0.95}
COLUMN_FLAG = "--{role}-column COLUMN"  # how bench's errors tell the user to name a column
_BENCH_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")

# The settings samples depend on; a resumed run must match them all.
RESULT_SETTINGS = ("model", "num_samples", "temperature", "top_p", "max_new_tokens", "seed", "data_fingerprint")


# ---------------------------------------------------------------------------------------------- data


@dataclass(frozen=True)
class DataRequest:
    """Which rows to evaluate on, beyond the benchmark's own source: `--split`, `--limit` (a seeded subset),
    `--question-column` / `--answer-column` (dotted paths for nested fields) and a hub `--config`."""

    split: str | None = None
    limit: int | None = None
    columns: dict[str, str] | None = None
    config: str | None = None
    task_config: dict | None = None  # a task family's own settings (`poise_trl.tasks`), e.g. a generator's


def benchmark_source(target: str, data_file: str | Path | None = None) -> Benchmark:
    """Where a benchmark named on the command line comes from: a registered benchmark (its `data_file`
    copy when given), any name given with a `data_file`, a registered dataset, a local file or folder, or a
    hub id."""
    if data_file is not None and not Path(data_file).exists():
        raise BenchError(f"--data-file {data_file}: no such file")
    if target in BENCHMARKS:
        spec = BENCHMARKS[target]
        if data_file is not None:
            return Benchmark(str(data_file), None, spec.prompt_suffix, spec.max_new_tokens)
        if spec.source is None:
            raise BenchError(f"{target} has no verified hub copy registered: give a local copy with "
                             f"--data-file {target}=FILE")
        return spec
    if data_file is not None:
        return Benchmark(str(data_file))
    if is_task(target):  # rows, prompts (with their answer format) and verifiers come from the task family
        get_family(target)
        return Benchmark(target, "test", prompt_suffix=None)
    if target in DATASETS or Path(target).exists() or re.fullmatch(r"[\w.-]+/[\w.-]+", target):
        return Benchmark(target)
    hint = " (no such file)" if Path(target).suffix in DATA_SUFFIXES else ""
    raise BenchError(
        f"unknown benchmark {target!r}{hint}: give a registered benchmark ({', '.join(BENCHMARKS)}), a task "
        f"({', '.join(sorted(FAMILIES))}, e.g. reasoning-gym:leg_counting), a local file or folder, or a hub id "
        "(owner/name); to run a local copy under this name add --data-file FILE"
    )


def benchmark_name(target: str, data_file: str | Path | None = None, name: str | None = None) -> str:
    """The folder a benchmark's results go to: `name`, else the benchmark as named (with a data file, or
    registered), a file's stem, or a folder's or hub id's last part."""
    if name is None:
        path = Path(target)
        name = (target.replace(":", "-") if is_task(target) else target if target in BENCHMARKS or data_file
                else path.stem if path.suffix else path.name)
    if not _BENCH_NAME.fullmatch(name) or name == "reports":  # reports/ holds the EvalScope reports
        raise BenchError(f"{name!r} cannot name a results folder; pass --name NAME (letters, digits, . _ + -)")
    return name


def load_benchmark(name: str, data_file: str | Path | None = None, request: DataRequest | None = None,
                   seed: int = 0):
    """The benchmark's prompts (`prompt`, `answer`): from `data_file` (a file or folder in any schema
    poise_trl.prompts reads) when given, else from its source (see `benchmark_source`)."""
    request = request or DataRequest()
    spec = benchmark_source(name, data_file)
    split = request.split or (held_out_split(spec.source) if spec.source in DATASETS else spec.split)
    try:
        return load_prompt_dataset(
            spec.source, split=split, columns=request.columns, prompt_suffix=spec.prompt_suffix,
            limit=request.limit, seed=seed, config=request.config, column_option=COLUMN_FLAG,
            task_config=request.task_config,
        )
    except DatasetUnavailableError as exc:
        cause = exc.__cause__.__class__.__name__ if exc.__cause__ else "unavailable"
        how = f"--data-file {name}=FILE" if name in BENCHMARKS else f"its file or folder instead of {name}"
        raise BenchError(
            f"cannot load {name} from the hub ({spec.source}: {cause}); offline? "
            f"Download a copy where the hub is reachable and pass {how}"
        ) from None


def resolve_preset(preset: str | None, benchmarks: list[str], **sampling) -> tuple[list[str], dict]:
    """Benchmarks and sampling settings (num_samples, temperature, top_p, max_new_tokens; None: unset) once
    `preset` is applied. A preset fixes its protocol: a setting that contradicts it is refused."""
    if preset is None:
        return benchmarks, {k: DEFAULT_SAMPLING.get(k) if v is None else v for k, v in sampling.items()}
    if preset not in PRESETS:
        raise BenchError(f"unknown preset {preset!r}; presets: {', '.join(PRESETS)}")
    fixed = PRESETS[preset]
    for key, value in sampling.items():
        if value is not None and value != getattr(fixed, key):
            flag = {"num_samples": "--n"}.get(key, "--" + key.replace("_", "-"))
            raise BenchError(f"--preset {preset} fixes {flag} {getattr(fixed, key)}; drop {flag} {value} or the preset")
    return benchmarks or list(fixed.benchmarks), {key: getattr(fixed, key) for key in sampling}


def data_fingerprint(dataset) -> str:
    """Hash of the prompts (suffix included) and answers (and a task's verifiers): a changed file, suffix or task
    config changes the results."""
    fields = {"prompt": dataset["prompt"], "answer": dataset["answer"]}
    if "verifier" in dataset.column_names:
        fields["verifier"] = dataset["verifier"]
    payload = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


# ------------------------------------------------------------------------------------------- grading


def grade(text: str, gold) -> dict:
    """What bench stores about a completion: whether math-verify accepts it and the answer it votes for."""
    return {"correct": is_correct(text, gold), "answer": extract_final_answer(text)}


def grade_batch(texts: list[str], rows: list[dict]) -> list[dict]:
    """`grade` for math rows; task rows (`task`, `verifier` columns) by their own verifier, all at once (a code
    family runs its programs in one sandbox pool): `reward` in [0, 1], `correct` when it is 1 (pass@k counts
    those), and the `<answer>` it votes for where the family asks for one."""
    if not rows or "task" not in rows[0]:
        return [grade(text, row["answer"]) for text, row in zip(texts, rows, strict=True)]
    rewards = score_rows(texts, [row["task"] for row in rows], [row["verifier"] for row in rows])
    return [{"reward": reward, "correct": reward >= 1.0, "answer": voted_answer(row["task"], text)}
            for text, row, reward in zip(texts, rows, rewards, strict=True)]


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

    Spacing, `$`, `\\left`/`\\right`, degree and percent signs and `\\text{}` wrappers are dropped,
    `\\dfrac`/`\\tfrac` read as `\\frac`, a trailing period goes, and plain numbers are compared by value
    (`070`, `70.0` and `70` are one answer, so are `1,000` and `1000`). Anything else is compared as text:
    `\\frac{1}{2}` and `0.5` are two answers here, even though math-verify grades both correct for 1/2.
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
    """A graded sample's reward: a task's (partial credit possible), or 1/0 for a math answer."""
    return float(record.get("reward", record["correct"]))


def compute_metrics(records: dict[tuple[int, int], dict], num_problems: int, num_samples: int,
                    voting: bool = True, problems: list[int] | None = None) -> dict:
    """Avg@n (mean reward), maj@n (when `voting`) and pass@k by the unbiased estimator (a sample passes when its
    reward is 1) over problems, each with its standard error; mean response length in tokens and the
    fraction of responses cut off by the token budget. `problems` restricts the scores to those problems
    (one task of a mix)."""
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


# ----------------------------------------------------------------------------------- resumable store


def check_settings(bench_dir: Path, settings: dict) -> None:
    """Refuse to add samples to `bench_dir` when the samples there were made with other settings."""
    samples, recorded = bench_dir / "samples.jsonl", bench_dir / "settings.json"
    if not samples.exists():
        return
    if recorded.exists():
        previous = json.loads(recorded.read_text())
        differing = [key for key in RESULT_SETTINGS if previous.get(key) != settings[key]]
        if differing:
            changes = ", ".join(f"{key} {previous.get(key)!r} -> {settings[key]!r}" for key in differing)
            raise BenchError(
                f"{bench_dir} holds samples made with other settings ({changes}); "
                "use a new --output-dir, or --overwrite to discard them"
            )
    else:
        raise BenchError(f"{samples} has no settings.json beside it; use a new --output-dir, or --overwrite")


def read_samples(path: Path) -> dict[tuple[int, int], dict]:
    """The samples already graded, keyed by (problem, sample). A torn last line (the process was killed
    while writing it) is cut off the file, so that appending continues on a clean line."""
    if not path.exists():
        return {}
    data = path.read_bytes()
    lines = data.split(b"\n")
    tail = lines.pop()  # what follows the last newline: empty, or a write that never finished
    records: dict[tuple[int, int], dict] = {}
    good_end = 0
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line) if line.strip() else None
        except ValueError:
            if number == len(lines) and not tail:  # the last write, cut short by a crash: drop it
                break
            raise BenchError(f"{path}: line {number} is corrupt; delete it, or rerun with --overwrite") from None
        if record is not None:
            records[(record["problem"], record["sample"])] = record
        good_end += len(line) + 1
    if good_end < len(data):
        with open(path, "r+b") as handle:
            handle.truncate(good_end)
    return records


@contextmanager
def sample_writer(path: Path) -> Iterator[Callable[[list[dict]], None]]:
    """`write(records)` appends records and makes them durable before returning."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as handle:

        def write(records: list[dict]) -> None:
            handle.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
            handle.flush()
            os.fsync(handle.fileno())

        yield write


# ------------------------------------------------------------------------------------------ sampling


def block_seed(seed: int, block_size: int, problem: int, block: int) -> int:
    """Seed of one block of samples: a function of what the block is, not of when it is generated."""
    digest = hashlib.sha256(f"{seed}:{block_size}:{problem}:{block}".encode()).digest()
    return int.from_bytes(digest[:4], "little") % 2**31


def generate_missing(engine: Engine, dataset, settings: dict, done: set, batch_size: int, on_samples) -> None:
    """Generate the samples not in `done` and pass them to `on_samples(list of (problem, sample, Sample))`.

    transformers: one call per block of up to `batch_size` samples of one problem, seeded by `block_seed`;
    a block with some samples done is regenerated whole (same seed, same samples) and only the missing
    ones are kept. vLLM seeds every problem's request from the seed and the problem (`request_seed`), so a
    problem's n samples do not depend on the other problems in the call; problems with anything missing
    are regenerated whole.
    """
    n = settings["num_samples"]
    sampling = dict(temperature=settings["temperature"], top_p=settings["top_p"],
                    max_new_tokens=settings["max_new_tokens"])
    prompts = dataset["prompt"]

    def keep_missing(starts: dict[int, int]):
        next_index = dict(starts)  # samples of a problem arrive in order within one call

        def on_batch(batch: list[Sample]) -> None:
            kept = []
            for s in batch:
                key = (s.prompt_index, next_index[s.prompt_index])
                next_index[s.prompt_index] += 1
                if key not in done:
                    kept.append((*key, s))
            on_samples(kept)

        return on_batch

    if engine.kind == "vllm":
        problems = [i for i in range(len(prompts)) if any((i, j) not in done for j in range(n))]
        if problems:
            engine.sample([prompts[i] for i in problems], n, seed=settings["seed"],
                          on_batch=keep_missing(dict.fromkeys(problems, 0)), prompt_indices=problems, **sampling)
        return
    block = min(batch_size, n)
    for problem, start in itertools.product(range(len(prompts)), range(0, n, block)):
        size = min(block, n - start)
        if all((problem, j) in done for j in range(start, start + size)):
            continue
        engine.sample([prompts[problem]], size, seed=block_seed(settings["seed"], block, problem, start // block),
                      on_batch=keep_missing({problem: start}), prompt_indices=[problem], **sampling)


# ------------------------------------------------------------------------------------------- the run


def resolve_model(model: str) -> str:
    """Local folders as absolute paths (so `data/tiny-qwen3` and its full path are one model); hub ids as is."""
    path = resolve_model_path(model)
    return str(Path(path).resolve()) if Path(path).exists() else path


def run_benchmarks(
    benchmarks: list[str],
    model: str,
    num_samples: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    max_new_tokens: int | None = None,
    output_dir: str | Path = "runs/bench",
    data_files: dict[str, str | Path] | None = None,
    seed: int = 0,
    batch_size: int = 32,
    overwrite: bool = False,
    show_progress: bool = True,
    preset: str | None = None,
    request: DataRequest | None = None,
    name: str | None = None,
    engine: str = "auto",
) -> dict:
    """Run (or finish) each benchmark, write `output_dir/summary.json` and the EvalScope reports, and return
    the summary.

    `benchmarks` are registered names, local files or folders, or hub ids (see `benchmark_source`); `name`
    renames a single one. `data_files` maps benchmark names to local copies that replace their source.
    `preset` (see PRESETS) supplies the benchmarks when none are named and fixes the sampling settings;
    without it, unset settings are Avg@32 at T=0.6, top-p 0.95. `max_new_tokens=None` takes each
    benchmark's own budget. `request` narrows every benchmark's rows (split, limit, columns). `engine`
    (auto, vllm, transformers) picks what generates (`generation.resolve_engine`). Every
    benchmark's data and settings are checked before anything is generated or deleted, so a refusal never
    comes after hours of sampling.
    """
    benchmarks, sampling = resolve_preset(preset, list(benchmarks), num_samples=num_samples,
                                          temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens)
    num_samples, temperature, top_p, max_new_tokens = (
        sampling["num_samples"], sampling["temperature"], sampling["top_p"], sampling["max_new_tokens"])
    if not benchmarks:
        raise BenchError("name at least one benchmark (" + ", ".join(BENCHMARKS) + ", a file or a hub id), "
                         "or a --preset (" + ", ".join(PRESETS) + ")")
    if name is not None and len(benchmarks) != 1:
        raise BenchError(f"--name names one benchmark; {len(benchmarks)} were given")
    data_files = data_files or {}
    if set(data_files) - set(benchmarks):
        raise BenchError(f"data files given for benchmarks not run: {', '.join(set(data_files) - set(benchmarks))}")
    request = request or DataRequest()
    if request.limit is not None and request.limit < 1:
        raise BenchError(f"--limit must be at least 1, got {request.limit}")
    if num_samples < 1 or batch_size < 1 or (max_new_tokens is not None and max_new_tokens < 1):
        raise BenchError("--n, --batch-size and --max-new-tokens must be at least 1")
    if temperature < 0 or not 0 < top_p <= 1:
        raise BenchError(f"need temperature >= 0 and 0 < top-p <= 1, got {temperature} and {top_p}")
    output_dir = Path(output_dir)
    model_path = resolve_model(model)

    targets = list(dict.fromkeys(benchmarks))  # a benchmark named twice runs once
    # Names and sources first: a missing --data-file is reported before any download.
    specs = {target: benchmark_source(target, data_files.get(target)) for target in targets}
    folders = {target: benchmark_name(target, data_files.get(target), name) for target in targets}
    if len(set(folders.values())) < len(folders):
        raise BenchError(f"two benchmarks would be saved under one name ({', '.join(folders.values())}); "
                         "run them separately with --name")
    plans = []
    for target in targets:
        bench_name, spec = folders[target], specs[target]
        dataset = load_benchmark(target, data_files.get(target), request, seed)
        settings = {
            "benchmark": bench_name,
            "model": model_path,
            "num_samples": num_samples,
            "temperature": temperature,
            "top_p": top_p,
            "max_new_tokens": max_new_tokens or spec.max_new_tokens,
            "seed": seed,
            "data_fingerprint": data_fingerprint(dataset),
            "data_source": spec.source,
            "split": request.split,
            "limit": request.limit,
            "columns": request.columns,
            "prompt_suffix": spec.prompt_suffix,
            "num_problems": len(dataset),
            "preset": preset,
        }
        if not overwrite:
            check_settings(output_dir / bench_name, settings)
        plans.append((dataset, settings))
    for _, settings in plans:
        bench_dir = output_dir / settings["benchmark"]
        if overwrite:
            (bench_dir / "samples.jsonl").unlink(missing_ok=True)
        write_json(bench_dir / "settings.json", settings)

    done = {s["benchmark"]: read_samples(output_dir / s["benchmark"] / "samples.jsonl") for _, s in plans}
    pending = any(len(done[s["benchmark"]]) < len(ds) * num_samples for ds, s in plans)
    if engine not in ENGINES:
        raise BenchError(f"--engine {engine!r} is not one of {', '.join(ENGINES)}")
    try:
        generator = load_engine(model_path, engine, batch_size) if pending else None
    except ValueError as exc:
        raise BenchError(str(exc)) from None
    results = {}
    with progress_bars("bench", "samples", show_progress and pending) as progress:
        for dataset, settings in plans:
            name = settings["benchmark"]
            if generator is not None:
                finish_benchmark(generator, dataset, settings, done[name], output_dir / name, batch_size, progress)
            results[name] = {"settings": settings, "metrics": dataset_metrics(done[name], dataset, num_samples)}

    close_vllm_engines()
    summary = {
        "model": model_path,
        # What generated this invocation's samples (none when every sample was already on disk).
        "engine": generator.kind if generator is not None else None,
        "benchmarks": results,
        "average": average_over_benchmarks([r["metrics"] for r in results.values()]),
        "versions": package_versions(),
    }
    write_json(output_dir / "summary.json", summary)
    write_evalscope_reports(summary, output_dir)
    return summary


def finish_benchmark(engine: Engine, dataset, settings: dict, done: dict, bench_dir: Path, batch_size: int,
                     progress=None) -> None:
    """Generate, grade and append the samples missing from `done` (which is updated as they come)."""
    total = len(dataset) * settings["num_samples"]
    task = progress.add_task(settings["benchmark"], total=total, completed=len(done)) if progress else None
    if len(done) == total:
        return
    with sample_writer(bench_dir / "samples.jsonl") as write:

        def on_samples(batch: list[tuple[int, int, Sample]]) -> None:
            grades = grade_batch([s.text for _, _, s in batch], [dataset[i] for i, _, _ in batch])
            records = [
                {"problem": i, "sample": j, **graded, "num_tokens": s.num_tokens, "truncated": s.truncated,
                 "text": s.text}
                for (i, j, s), graded in zip(batch, grades, strict=True)
            ]
            write(records)
            done.update({(r["problem"], r["sample"]): r for r in records})
            if progress:
                progress.advance(task, len(records))

        generate_missing(engine, dataset, settings, set(done), batch_size, on_samples)


# ------------------------------------------------------------------------------------------- exports


def model_id(model: str) -> str:
    """The model's name in reports: its folder or hub id's last part (`Qwen/Qwen3-4B` -> `Qwen3-4B`)."""
    return Path(model.rstrip("/")).name


def evalscope_report(name: str, entry: dict, model: str) -> dict:
    """One benchmark's results as an EvalScope report (the `Report` JSON that `evalscope` writes to
    `reports/<model>/<dataset>.json` and its `evalscope app` / `Report.from_json` read back; the v1 layout,
    which current EvalScope migrates on load).

    `mean_acc` (EvalScope's accuracy metric, the primary one) is Avg@n; maj@n and pass@k (k > 1) follow. Each
    metric has one category and one subset, with the number of problems.
    """
    metrics = entry["metrics"]
    n, count = metrics["num_samples"], metrics["num_problems"]
    passes = [key for key in metrics["scores"] if key.startswith("pass@") and key != "pass@1"]  # pass@1 is Avg@n
    voted = [(f"maj@{n}", "maj")] if "maj" in metrics["scores"] else []
    named = [("mean_acc", "avg"), *voted, *((key, key) for key in passes)]

    def metric(label: str, key: str) -> dict:
        score = metrics["scores"][key]["value"]
        subset = {"name": "default", "score": score, "num": count}
        return {"name": label, "num": count, "score": score, "macro_score": score,
                "categories": [{"name": ["default"], "num": count, "score": score, "macro_score": score,
                                "subsets": [subset]}]}

    return {
        "name": f"{model_id(model)}@{name}",
        "dataset_name": name,
        "dataset_pretty_name": name,
        "dataset_description": f"poise bench: Avg@{n} at temperature {entry['settings']['temperature']}, "
                               f"top-p {entry['settings']['top_p']} on {entry['settings']['data_source']}",
        "model_name": model_id(model),
        "score": metrics["scores"]["avg"]["value"],
        "metrics": [metric(label, key) for label, key in named],
        "analysis": "N/A",
    }


def write_evalscope_reports(summary: dict, output_dir: Path) -> list[Path]:
    """`output_dir/reports/<model>/<bench>.json` for every benchmark of `summary`."""
    paths = []
    for name, entry in summary["benchmarks"].items():
        path = Path(output_dir) / "reports" / model_id(summary["model"]) / f"{name}.json"
        write_json(path, evalscope_report(name, entry, summary["model"]))
        paths.append(path)
    return paths


def eval_results(summary: dict) -> list:
    """The summary as huggingface_hub `EvalResult`s (a model card's model-index): Avg@n, maj@n and pass@n
    of every benchmark. A hub dataset id is the dataset type; other sources go by the benchmark's name."""
    from huggingface_hub import EvalResult

    results = []
    for name, entry in summary["benchmarks"].items():
        settings, metrics = entry["settings"], entry["metrics"]
        n, source = metrics["num_samples"], str(settings["data_source"])
        source = DATASETS[source].hub_id or source if source in DATASETS else source
        hub_id = source if "/" in source and not Path(source).exists() else name
        task_name = source if is_task(source) else "math reasoning"
        for label, key in ((f"Avg@{n}", "avg"), (f"maj@{n}", "maj"), (f"pass@{n}", f"pass@{n}")):
            if key not in metrics["scores"]:
                continue
            results.append(EvalResult(
                task_type="text-generation", task_name=task_name, dataset_type=hub_id, dataset_name=name,
                dataset_split=settings.get("split"), metric_type="accuracy" if key == "avg" else key,
                metric_name=label, metric_value=round(metrics["scores"][key]["value"], 4),
                metric_args={"temperature": settings["temperature"], "top_p": settings["top_p"],
                             "max_new_tokens": settings["max_new_tokens"], "n": n},
            ))
    return results


# ------------------------------------------------------------------------------------------- compare


def load_summary(folder: str | Path) -> dict:
    path = Path(folder) / "summary.json"
    if not path.is_file():
        raise BenchError(f"{path} not found: give folders written by `poise bench`")
    return json.loads(path.read_text())


def compare_results(folder_a: str | Path, folder_b: str | Path) -> tuple[list[dict], list[str]]:
    """Side by side scores of two bench folders: rows {benchmark, score, a, b, diff (b - a), se_diff,
    significant} for every benchmark and score both have (and the average when both ran the same
    benchmarks), `significant` meaning |diff| > 2 sqrt(se_a^2 + se_b^2). Also returns notes naming the
    settings that differ between the two."""
    a, b = load_summary(folder_a), load_summary(folder_b)
    tables = [(name, a["benchmarks"][name]["metrics"], b["benchmarks"][name]["metrics"])
              for name in a["benchmarks"] if name in b["benchmarks"]]
    if not tables:
        raise BenchError(f"{folder_a} and {folder_b} have no benchmark in common")
    if set(a["benchmarks"]) == set(b["benchmarks"]) and len(tables) > 1:
        tables.append(("average", a["average"], b["average"]))
    rows = []
    for name, ma, mb in tables:
        for score in (s for s in ma["scores"] if s in mb["scores"]):
            sa, sb = ma["scores"][score], mb["scores"][score]
            se = math.sqrt(sa["stderr"] ** 2 + sb["stderr"] ** 2)
            diff = sb["value"] - sa["value"]
            rows.append({"benchmark": name, "score": score, "a": sa["value"], "b": sb["value"], "diff": diff,
                         "se_diff": se, "significant": abs(diff) > 2 * se})
    notes = []
    for name, _, _ in tables:
        if name == "average":
            continue
        sa, sb = a["benchmarks"][name]["settings"], b["benchmarks"][name]["settings"]
        differing = [k for k in RESULT_SETTINGS if sa.get(k) != sb.get(k)]
        if differing:
            notes.append(f"{name}: " + ", ".join(f"{k} {sa.get(k)!r} vs {sb.get(k)!r}" for k in differing))
    return rows, notes
