"""`poise bench`: a thin Typer command over poise_trl.evaluation.bench (registered by cli/main.py)."""

from __future__ import annotations

from pathlib import Path

import typer
import yaml
from rich.table import Table

from poise_trl.cli.errors import console, fail, user_errors
from poise_trl.core.loading import check_model_files


def bench(
    names: list[str] = typer.Argument(
        None, metavar="BENCH", help="Benchmarks: aime24 aime25 aime26 amc23 amc24 hmmt25 brumo25 math-500 toy-arith, "
        "a task (humaneval, bfcl, ifeval, reasoning-gym:NAME; scored by its own verifier), a registered dataset, a "
        "local file or folder (json/jsonl/parquet/csv/save_to_disk, any schema the loader reads), a hub id, or any "
        "name given with --data-file (with --compare: two result folders). All registered benchmarks but toy-arith "
        "download from the Hugging Face Hub: offline, give --data-file NAME=FILE."
    ),
    model: str = typer.Option(
        None, "--model", "-m", help="Local model folder or hub id (with a chat template); needed but with --compare."
    ),
    preset: str = typer.Option(
        None, "--preset", help="A published protocol: poise (the paper's seven math sets, Avg@32, T=0.6, top-p 0.95, "
        "8192 new tokens; amc24 needs --data-file amc24=FILE). Supplies the benchmarks when none are named."
    ),
    n: int = typer.Option(None, "--n-samples", "-n", help="Samples per problem, the n of Avg@n (default 32)."),
    temperature: float = typer.Option(None, help="Sampling temperature (0: greedy; default 0.6)."),
    top_p: float = typer.Option(None, "--top-p", help="Nucleus sampling threshold (default 0.95)."),
    max_new_tokens: int = typer.Option(
        None, "--max-new-tokens", help="Token budget per response (default: the benchmark's, 32768; toy-arith 96)."
    ),
    output_dir: Path = typer.Option(Path("runs/bench"), "--output-dir", "-o", help="Samples and summary.json."),
    data_file: list[str] = typer.Option(
        None, "--data-file", help="Local copy of a benchmark: NAME=FILE, or FILE for each benchmark in the order "
        "they are named. An unregistered NAME with --data-file is run under that name."
    ),
    name: str = typer.Option(None, "--name", help="Save the (single) benchmark's results under this name."),
    question_column: str = typer.Option(
        None, "--question-column", help="Column of the problems, when not detected (dotted for nested fields; "
        "body+question joins two)."
    ),
    answer_column: str = typer.Option(
        None, "--answer-column", help="Column of the gold answers, when not detected (dotted for nested fields, "
        "e.g. reward_model.ground_truth)."
    ),
    split: str = typer.Option(None, "--split", help="Split to evaluate (default: the benchmark's held-out split)."),
    limit: int = typer.Option(None, "--limit", help="Evaluate a seeded random subset of this many problems."),
    config: str = typer.Option(None, "--config", help="Hub dataset config (subset), for a hub id."),
    task_config: list[str] = typer.Option(
        None, "--task-config", help="KEY=VALUE of a task's own config (YAML value, repeatable), e.g. "
        "--task-config min_digits=2 for reasoning-gym:basic_arithmetic."),
    seed: int = typer.Option(0, help="Sampling seed (also the --limit subset's)."),
    batch_size: int = typer.Option(32, "--batch-size", help="Samples of a problem generated (and saved) together."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Discard earlier samples made with other settings."),
    push_to_hub: str = typer.Option(
        None, "--push-to-hub", help="Add the results to this hub model's card (model-index), e.g. me/my-model."
    ),
    compare: bool = typer.Option(False, "--compare", help="Compare two result folders: poise bench --compare O1 O2."),
    no_progress: bool = typer.Option(False, "--no-progress", help="No progress bar."),
    engine: str = typer.Option(
        "auto", "--engine", help="What generates: auto (vLLM when it imports and runs the model, GPU or CPU "
                                 "build; else transformers), vllm or transformers."
    ),
    tools_from: Path = typer.Option(
        None, "--tools-from", help="A recipe whose tools or environment the model calls, within its limits "
        "(max_tool_calling_iterations, tool_result_tokens, tool_timeout): every sample is a tool-calling "
        "conversation. bfcl-multi brings its own tools."),
):
    """Sample, grade and score benchmarks (Avg@n, pass@k, maj@n; tasks per task and per problem); resumes an
    interrupted run. Writes
    summary.json, EvalScope reports (OUTPUT_DIR/reports/MODEL/BENCH.json) and lighteval's results layout
    (OUTPUT_DIR/results_lighteval.json)."""
    from poise_trl.evaluation import bench as lib
    from poise_trl.evaluation.agent import RecipeTools
    from poise_trl.evaluation.bench_data import BenchError
    from poise_trl.evaluation.bench_reports import compare_results, eval_results, model_id
    from poise_trl.run.recipe import recipe_tools

    names = names or []
    try:
        if compare:
            if len(names) != 2:
                raise BenchError("--compare takes two result folders: poise bench --compare O1 O2")
            rows, notes = compare_results(*names)
            _print_comparison(rows, notes, *names)
            return
        if not model:
            raise BenchError("give the model to evaluate with --model (a local folder or a hub id)")
        check_model_files(model)  # a truncated weights or tokenizer file: one line naming it, before any engine starts
        summary = lib.run_benchmarks(
            names, model, num_samples=n, temperature=temperature, top_p=top_p,
            max_new_tokens=max_new_tokens, output_dir=output_dir, seed=seed,
            data_files=_data_files(data_file or [], names, preset), batch_size=batch_size, overwrite=overwrite,
            show_progress=not no_progress, preset=preset, name=name, engine=engine,
            tools=RecipeTools(**recipe_tools(tools_from)) if tools_from else None,
            request=data_request(split, limit, question_column, answer_column, config, task_config),
        )
        if push_to_hub:
            from poise_trl.run.hub import push_bench_results

            push_bench_results(push_to_hub, eval_results(summary), model_id(summary["model"]))
    except user_errors() as exc:  # BenchError, DatasetFormatError, DatasetUnavailableError, HubPushError, ...
        fail(str(exc))
        return
    except KeyboardInterrupt:
        console.print("interrupted: the graded samples are saved; run the same command again to finish")
        raise typer.Exit(code=130) from None
    _print_summary(summary, output_dir)
    if push_to_hub:
        console.print(f"model-index added to https://huggingface.co/{push_to_hub}", highlight=False)


def data_request(split: str | None, limit: int | None, question_column: str | None, answer_column: str | None,
                 config: str | None, task_config: list[str] | None):
    """The `DataRequest` of the data options `poise bench` and `poise grade` share; --task-config KEY=VALUE
    items -> {KEY: VALUE read as YAML}."""
    from poise_trl.evaluation.bench_data import BenchError, DataRequest

    pairs = {}
    for item in task_config or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise BenchError(f"--task-config {item!r}: give KEY=VALUE")
        pairs[key] = yaml.safe_load(value)
    columns = {k: v for k, v in (("question", question_column), ("answer", answer_column)) if v}
    return DataRequest(split=split, limit=limit, columns=columns or None, config=config, task_config=pairs or None)


def _data_files(items: list[str], names: list[str], preset: str | None) -> dict[str, str] | None:
    """--data-file values: all NAME=FILE (NAME a benchmark), or all bare FILEs, one per benchmark in order."""
    from poise_trl.evaluation.bench_data import PRESETS, BenchError

    if not items:
        return None
    known = set(names) or set(PRESETS[preset].benchmarks if preset in PRESETS else ())
    pairs = [item.split("=", 1) for item in items]
    named = [len(pair) == 2 and pair[0] in known for pair in pairs]
    if all(named):
        return {bench: path for bench, path in pairs}
    if any(named) or len(items) != len(names):
        raise BenchError(f"{len(items)} --data-file for {len(names)} benchmarks: give NAME=FILE for each, or one "
                         "FILE per benchmark in the order they are named")
    return dict(zip(names, items, strict=True))


def _print_summary(summary: dict, output_dir: Path) -> None:
    """One column per benchmark (and their average), one row per score: fits a terminal at any n."""
    columns = [(name, entry["metrics"]) for name, entry in summary["benchmarks"].items()]
    if len(columns) > 1:
        columns.append(("average", summary["average"]))
    n = columns[0][1]["num_samples"]
    table = Table(title="poise bench")
    table.add_column("score")
    for name, _ in columns:
        table.add_column(name, justify="right")
    scores = [m["scores"] for _, m in columns]
    table.add_row(f"Avg@{n}", *(f"{s['avg']['value']:.3f}" for s in scores))
    table.add_row("  ± se", *(f"{s['avg']['stderr']:.3f}" for s in scores))
    if all("maj" in s for s in scores):
        table.add_row(f"maj@{n}", *(f"{s['maj']['value']:.3f}" for s in scores))
    for key in (k for k in scores[0] if k.startswith("pass@")):
        table.add_row(key, *(f"{s[key]['value']:.3f}" for s in scores))
    table.add_row("tokens", *(f"{m['mean_tokens']:.0f}" for _, m in columns))
    if any("mean_tool_calls" in m for _, m in columns):
        table.add_row("tool calls", *(f"{m.get('mean_tool_calls', 0):.2f}" for _, m in columns))
    table.add_row("truncated", *(f"{m['truncated_fraction']:.1%}" for _, m in columns))
    console.print(table)
    for name, entry in summary["benchmarks"].items():
        if len(entry["metrics"].get("by_task", {})) > 1:
            _print_by_task(name, entry["metrics"]["by_task"])
    engine = summary.get("engine") or "none (every sample was already on disk)"
    console.print(f"model: {summary['model']}\ngenerated with: {engine}\nsummary: {output_dir / 'summary.json'}",
                  highlight=False)


def _print_by_task(name: str, by_task: dict) -> None:
    """A mix's scores per task: one row per task."""
    n = next(iter(by_task.values()))["num_samples"]
    passes = [k for k in next(iter(by_task.values()))["scores"] if k.startswith("pass@")]
    table = Table(title=f"{name} by task")
    for column in ("task", "problems", f"Avg@{n}", "± se", *passes):
        table.add_column(column, justify="left" if column == "task" else "right")
    for task, m in by_task.items():
        s = m["scores"]
        table.add_row(task, str(m["num_problems"]), f"{s['avg']['value']:.3f}", f"{s['avg']['stderr']:.3f}",
                      *(f"{s[k]['value']:.3f}" for k in passes))
    console.print(table)


def _print_comparison(rows: list[dict], notes: list[str], folder_a: str, folder_b: str) -> None:
    table = Table(title=f"poise bench --compare: A = {folder_a}, B = {folder_b}")
    for column in ("benchmark", "score", "A", "B", "B - A", "2 se", "beyond 2 se"):
        table.add_column(column, justify="left" if column in ("benchmark", "score") else "right")
    for row in rows:
        table.add_row(
            row["benchmark"], {"avg": "Avg@n", "maj": "maj@n"}.get(row["score"], row["score"]), f"{row['a']:.3f}",
            f"{row['b']:.3f}", f"{row['diff']:+.3f}", f"{2 * row['se_diff']:.3f}",
            "[bold]yes[/]" if row["significant"] else "no",
        )
    console.print(table)
    for note in notes:
        console.print(f"settings differ: {note}", highlight=False)
