"""`poise bench`'s results in other tools' terms (EvalScope reports, lighteval's results file, a hub card's
model-index entries) and side by side (`poise bench --compare`)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from huggingface_hub import EvalResult

from poise_trl.core.provenance import write_json, write_text
from poise_trl.evaluation.bench_data import RESULT_SETTINGS, BenchError
from poise_trl.tasks import is_task
from poise_trl.tasks.prompts import DATASETS

# ------------------------------------------------------------------------------------------- exports


def model_id(model: str) -> str:
    """The model's name in reports: its folder or hub id's last part (`Qwen/Qwen3-4B` -> `Qwen3-4B`)."""
    return Path(model.rstrip("/")).name


def evalscope_report(name: str, entry: dict, model: str) -> dict:
    """One benchmark's results as an EvalScope v1 report: `mean_acc` (Avg@n), then maj@n and pass@k."""
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


LIGHTEVAL_RESULTS = "results_lighteval.json"


def write_bfcl_results(records: dict[tuple[int, int], dict], dataset, bench_dir: Path) -> list[Path]:
    """The bfcl-multi samples of a benchmark in BFCL's multi-turn result format, one file per category
    (`BFCL_v4_multi_turn_<category>_result.json`, JSON lines as BFCL writes them): each sample's line
    (`bfcl_multi.result_line`: per turn, per step, the decoded call strings BFCL's checker reads) with its
    `sample` number; the sample's reward is that line's check."""
    if "task" not in dataset.column_names or not any(task.startswith("bfcl-multi") for task in dataset["task"]):
        return []
    from poise_trl.tasks import assistant_texts  # noqa: PLC0415 - bfcl-multi's module needs the optional bfcl-eval
    from poise_trl.tasks.bfcl_multi import result_line  # noqa: PLC0415

    files: dict[str, list[str]] = {}
    tasks, verifiers = dataset["task"], dataset["verifier"]
    for (problem, sample), record in sorted(records.items()):
        if tasks[problem].startswith("bfcl-multi"):
            verifier = json.loads(verifiers[problem])
            line = result_line(assistant_texts(record.get("messages") or record["text"]), verifier)
            files.setdefault(verifier["category"], []).append(json.dumps(line | {"sample": sample}) + "\n")
    paths = [Path(bench_dir) / f"BFCL_v4_multi_turn_{category}_result.json" for category in files]
    for path, lines in zip(paths, files.values(), strict=True):
        write_text(path, "".join(lines))
    return paths


def lighteval_metric_name(score: str, num_samples: int) -> str:
    """lighteval's name for one of bench's scores: the metric, then its sample parameters (`avg@n:n=32`,
    `maj@n:n=32`, `pass@k:k=1&n=32`), as its parametrized metrics name themselves."""
    if score.startswith("pass@"):
        return f"pass@k:k={score.removeprefix('pass@')}&n={num_samples}"
    return f"{score}@n:n={num_samples}"


def lighteval_scores(scores: dict, num_samples: int) -> dict:
    """Scores as one task's entry of lighteval's `results`: every metric, then `<metric>_stderr`."""
    entry = {}
    for score, result in scores.items():
        name = lighteval_metric_name(score, num_samples)
        entry[name] = result["value"]
        entry[f"{name}_stderr"] = result["stderr"]
    return entry


def lighteval_results(summary: dict) -> dict:
    """The summary in the layout of lighteval's `results_<time>.json` (its EvaluationTracker's `results`).

    Benchmarks are zero-shot tasks `<bench>|0`, a mix's tasks `<bench>:<task>|0`; `all` is summary.json's
    `average`. Left out: `summary_tasks` and `summary_general` (hashes of lighteval's prompts and tokens).
    """
    benchmarks = summary["benchmarks"]
    first = next(iter(benchmarks.values()))["settings"]
    n = first["num_samples"]  # one invocation samples every benchmark n times
    results, config_tasks = {}, {}
    for name, entry in benchmarks.items():
        settings, metrics = entry["settings"], entry["metrics"]
        results[f"{name}|0"] = lighteval_scores(metrics["scores"], n)
        by_task = metrics.get("by_task", {})
        if len(by_task) > 1:
            results.update({f"{name}:{task}|0": lighteval_scores(m["scores"], n)
                            for task, m in by_task.items()})
        config_tasks[f"{name}|0"] = {
            "name": name, "hf_repo": str(settings["data_source"]),
            "evaluation_splits": [settings["split"]] if settings.get("split") else [],
            "metrics": [{"metric_name": lighteval_metric_name(score, n), "higher_is_better": True}
                        for score in metrics["scores"]],
            "generation_size": settings["max_new_tokens"], "num_samples": [n], "num_fewshots": 0,
            "effective_num_docs": metrics["num_problems"], "version": 0,
        }
    results["all"] = lighteval_scores(summary["average"]["scores"], n)
    generation = {key: first[key] for key in ("temperature", "top_p", "seed")}
    return {
        "config_general": {
            "model_name": summary["model"], "max_samples": first.get("limit"), "num_fewshot_seeds": 1,
            "model_config": {"model_name": summary["model"], "generation_parameters": generation},
        },
        "results": results,
        "versions": dict.fromkeys(config_tasks, 0),
        "config_tasks": config_tasks,
    }


def write_lighteval_results(summary: dict, output_dir: Path) -> Path:
    """`output_dir/results_lighteval.json`: one fixed name beside summary.json (lighteval's own file is
    `results/<model>/results_<time>.json`, one more per run), so a rerun replaces it."""
    return write_json(Path(output_dir) / LIGHTEVAL_RESULTS, lighteval_results(summary))


def eval_results(summary: dict) -> list:
    """The summary as huggingface_hub `EvalResult`s (a model card's model-index): Avg@n, maj@n and pass@n
    of every benchmark. A hub dataset id is the dataset type; other sources go by the benchmark's name."""
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
    """Side by side scores of two bench folders, `significant`: |diff| > 2 se_diff; notes on differences."""
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
