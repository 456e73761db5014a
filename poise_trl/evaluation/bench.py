"""`poise bench`: sample n completions per problem, grade them and report Avg@n, pass@k, maj@n and lengths.

Resumable: graded samples go to `<output_dir>/<bench>/samples.jsonl` batch by batch, sampled in seeded
blocks so a resumed run equals a fresh one; `settings.json` refuses a rerun with other settings. What a
benchmark is lives in `bench_data`, grading and scores in `bench_scores`. Details: docs/commands.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from transformers import AutoConfig

from poise_trl.core.loading import load_tokenizer, resolve_model_path
from poise_trl.core.progress import progress_bars
from poise_trl.core.provenance import package_versions, write_json
from poise_trl.engines.generation import ENGINES, Engine, Sample, close_vllm_engines, load_engine, render_prompts
from poise_trl.evaluation.agent import AgentEngine, RecipeTools, Toolbox, task_tools, tool_calls
from poise_trl.evaluation.bench_data import (
    BENCHMARKS,
    ID_COLUMNS,
    PRESETS,
    RESULT_SETTINGS,
    BenchError,
    DataRequest,
    benchmark_name,
    benchmark_source,
    data_fingerprint,
    load_benchmark,
    resolve_preset,
)
from poise_trl.evaluation.bench_reports import write_bfcl_results, write_evalscope_reports, write_lighteval_results
from poise_trl.evaluation.bench_scores import average_over_benchmarks, dataset_metrics, grade_batch
from poise_trl.tasks.math_grader import answer_to_str

logger = logging.getLogger(__name__)

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
            raise BenchError(f"{bench_dir} holds samples made with other settings ({changes}); "
                             "use a new --output-dir, or --overwrite to discard them")
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


def sample_record(problem: int, sample: int, generated: Sample, graded: dict, row: dict) -> dict:
    """One line of samples.jsonl: the response, its grade, the row's own id where it has one (`poise grade`
    matches lines to rows by it) and what eval tools read beside it."""
    row_id = next((row[column] for column in ID_COLUMNS if row.get(column) is not None), None)
    conversation = {} if generated.messages is None else {"messages": generated.messages,
                                                          "tool_calls": tool_calls(generated.messages)}
    return {"problem": problem, **({"id": row_id} if row_id is not None else {}), "sample": sample, **graded,
            "gold": answer_to_str(row["answer"]),
            "num_tokens": generated.num_tokens, "truncated": generated.truncated,
            "finish_reason": generated.finish_reason, "text": generated.text, **conversation}


# ------------------------------------------------------------------------------------------ sampling


def block_seed(seed: int, block_size: int, problem: int, block: int) -> int:
    """Seed of one block of samples: a function of what the block is, not of when it is generated."""
    digest = hashlib.sha256(f"{seed}:{block_size}:{problem}:{block}".encode()).digest()
    return int.from_bytes(digest[:4], "little") % 2**31


def generate_missing(engine: Engine, dataset, settings: dict, done: set, batch_size: int, on_samples) -> None:
    """Generate the samples not in `done` (seeded blocks regenerated whole) and pass them to `on_samples`."""
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


def capped_budget(model_path: str, dataset, bench_name: str, max_new_tokens: int,
                  template_kwargs: dict | None = None) -> int:
    """`max_new_tokens`, capped at what the model's context leaves after the benchmark's longest prompt (chat
    template and tool schemas included), saying so once; as it is where the model's config cannot be read here (a
    hub id offline: the engine then reports it). A tool-calling rollout's turns and tool results share it."""
    try:
        config = AutoConfig.from_pretrained(model_path).get_text_config()
        context = getattr(config, "max_position_embeddings", None)
        tokenizer = load_tokenizer(model_path) if context else None
    except (OSError, ValueError):
        return max_new_tokens
    if not context:
        return max_new_tokens
    texts = render_prompts(tokenizer, dataset["prompt"], template_kwargs)
    longest = max(len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"])
    room = max(context - longest, 1)
    if max_new_tokens > room:
        logger.warning("%s: max_new_tokens %d capped at %d: the model's context is %d tokens and the longest "
                       "prompt takes %d", bench_name, max_new_tokens, room, context, longest)
    return min(max_new_tokens, room)


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
    tools: RecipeTools | None = None,
) -> dict:
    """Run (or finish) each benchmark; write `output_dir/summary.json` (returned) and the EvalScope reports.

    `benchmarks`: names, files, folders or hub ids (`benchmark_source`); `data_files`: local copies by name;
    `preset` (PRESETS) supplies benchmarks and fixes sampling settings (else Avg@32, T=0.6, top-p 0.95);
    `max_new_tokens=None` takes each benchmark's budget; `tools` (a recipe's) make every rollout a tool-calling
    conversation, as a task with tools of its own (bfcl-multi) does (`agent`). Everything is checked before anything
    is generated.
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
        raise BenchError("--n-samples, --batch-size and --max-new-tokens must be at least 1")
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
    toolbox = Toolbox(load_tokenizer(model_path), tools) if tools is not None else None
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
            "max_new_tokens": capped_budget(model_path, dataset, bench_name, max_new_tokens or spec.max_new_tokens,
                                            toolbox.template_kwargs if toolbox else None),
            "seed": seed,
            "data_fingerprint": data_fingerprint(dataset),
            "data_source": spec.source,
            "split": request.split,
            "limit": request.limit,
            "columns": request.columns,
            "prompt_suffix": spec.prompt_suffix,
            "num_problems": len(dataset),
            "preset": preset,
            "tools": dataclasses.asdict(tools) if tools is not None else None,
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
                sampler = (AgentEngine(generator, toolbox or Toolbox(generator.tokenizer), dataset.to_list(),
                                       batch_size) if toolbox is not None or task_tools(dataset) else generator)
                finish_benchmark(sampler, dataset, settings, done[name], output_dir / name, batch_size, progress)
            write_bfcl_results(done[name], dataset, output_dir / name)
            results[name] = {"settings": settings, "metrics": dataset_metrics(done[name], dataset, num_samples)}

    if toolbox is not None:
        toolbox.close()
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
    write_lighteval_results(summary, output_dir)
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
            rows = [dataset[i] for i, _, _ in batch]
            grades = grade_batch([s.messages or s.text for _, _, s in batch], rows)
            records = [sample_record(i, j, s, graded, row)
                       for (i, j, s), graded, row in zip(batch, grades, rows, strict=True)]
            write(records)
            done.update({(r["problem"], r["sample"]): r for r in records})
            if progress:
                progress.advance(task, len(records))

        generate_missing(engine, dataset, settings, set(done), batch_size, on_samples)
