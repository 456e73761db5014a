"""`poise compare`: recipes against each other at equal generation compute, over seeds (docs/comparisons.md).

Every (recipe, seed) run is `poise train RECIPE seed=S budget_tokens=N ...` in its own process under
O/runs/<name>/seed<S>/ (complete runs skipped, interrupted ones resumed); aggregation reads only their
summary.json files.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from poise_trl.algorithms import algorithms
from poise_trl.algorithms.base import CompareTable, Signal, logged
from poise_trl.core.provenance import package_versions, pyplot, write_json
from poise_trl.run.callbacks import Budget
from poise_trl.run.recipe import RecipeError, load_recipe, parse_recipe, read_yaml
from poise_trl.run.run_folder import differing_settings

SIGNAL_BINS = 10
BOOTSTRAP_SAMPLES = 2000


def zero_signal(entry: dict) -> float | None:
    """The share of rollouts without a learning signal: an algorithm's own count where it logs one, else
    TRL's share of the step's groups whose rewards have zero std."""
    value = entry.get("zero_signal_fraction")
    return value if value is not None else entry.get("frac_reward_zero_std")


# Trainer-log series every run has, shown over training beside the algorithms' own (`Algorithm.signals`).
FIRST_SIGNALS = {"grad_norm": Signal("gradient norm", "grad norm", logged("grad_norm"))}
LAST_SIGNALS = {"zero_signal_fraction": Signal("zero-signal rollouts (all rewards of the prompt equal)",
                                               "zero-signal", zero_signal)}


def declared_signals() -> dict[str, list[Signal]]:
    """Every series shown, in table order, with its readers: the algorithms' first (a log entry holds only
    its own algorithm's keys), the common one last (its title names the series)."""
    signals: dict[str, list[Signal]] = {key: [] for key in FIRST_SIGNALS}
    for algorithm in algorithms().values():
        for key, signal in algorithm.signals.items():
            readers = signals.setdefault(key, [])
            if signal not in readers:
                readers.append(signal)
    for key, signal in FIRST_SIGNALS.items():
        signals[key].append(signal)
    for key, signal in LAST_SIGNALS.items():
        signals[key] = [*signals.pop(key, []), signal]
    return signals


def signal_value(key: str, entry: dict) -> float | None:
    return next((v for signal in declared_signals()[key] if (v := signal.value(entry)) is not None), None)


def compare_tables() -> list[CompareTable]:
    """The algorithms' own tables (`Algorithm.compare_tables`), each once."""
    tables = {table.key: table for algorithm in algorithms().values() for table in algorithm.compare_tables}
    return list(tables.values())


class CompareError(ValueError):
    """A comparison that cannot run or be aggregated as asked; the message says why and what to do."""


@dataclass(frozen=True)
class PlannedRun:
    name: str
    recipe_path: Path
    seed: int
    folder: Path


# --- Pure functions on curves (tested against hand-made curves) ------------------------


def first_crossing(xs: list[float], ys: list[float], target: float) -> float | None:
    """The x at which a piecewise-linear curve first reaches `target` (None if it never does)."""
    for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
        if y >= target:
            if i == 0:
                return x
            x0, y0 = xs[i - 1], ys[i - 1]
            return x0 + (target - y0) / (y - y0) * (x - x0)
    return None


def mean_and_std(values: list[float]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (None for an empty list; std 0 for one value)."""
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return None, None
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def budget_curve(history: list[dict]) -> list[dict]:
    """The held-out points of one run at the start and at each budget point, in order."""
    points = [h for h in history if h["step"] == 0 or "budget_point" in h]
    return sorted(points, key=lambda h: h["generated_tokens"])


def aggregate_curves(curves: list[list[dict]]) -> list[dict]:
    """Seeds' budget curves -> one curve: mean and spread of accuracy, tokens and training
    seconds at each budget point that every seed reached."""
    length = min(len(c) for c in curves)
    aggregated = []
    for i in range(length):
        column = [c[i] for c in curves]
        accuracy, accuracy_std = mean_and_std([p["accuracy"] for p in column])
        tokens, _ = mean_and_std([p["generated_tokens"] for p in column])
        rollouts, _ = mean_and_std([p["generated_rollouts"] for p in column])
        seconds, seconds_std = mean_and_std([p["train_seconds"] for p in column])
        aggregated.append({
            "budget_point": column[0].get("budget_point", 0),
            "accuracy_mean": accuracy, "accuracy_std": accuracy_std,
            "accuracy_min": min(p["accuracy"] for p in column), "accuracy_max": max(p["accuracy"] for p in column),
            "generated_tokens_mean": tokens, "generated_rollouts_mean": rollouts,
            "train_seconds_mean": seconds, "train_seconds_std": seconds_std,
            "seeds": len(column),
        })
    return aggregated


def log_series(train_log: list[dict], key: str, unit: str = "tokens") -> list[tuple[float, float]]:
    """(generated tokens or rollouts, value) for every training log entry that has a value of series `key`
    (read by `declared_signals`)."""
    spent = f"generated_{unit}"
    return [(entry[spent], value) for entry in train_log
            if spent in entry and (value := signal_value(key, entry)) is not None]


def logged_values(train_log: list[dict], key: str) -> list[float]:
    """Every value of `key` in the training log, in step order (entries without it skipped)."""
    return [e[key] for e in train_log if e.get(key) is not None]


def run_mean(train_log: list[dict], key: str) -> float | None:
    """A run's mean of series `key`: an algorithm's own reckoning where it gives one (`Signal.run_mean`)."""
    for signal in declared_signals()[key]:
        if signal.run_mean is not None and (value := signal.run_mean(train_log)) is not None:
            return value
    return mean_and_std([v for _, v in log_series(train_log, key)])[0]


REDUCTIONS = {"last": lambda values: values[-1], "mean": lambda values: sum(values) / len(values),
              "second_half": lambda values: sum(values[len(values) // 2:]) / len(values[len(values) // 2:])}


def table_summary(train_log: list[dict], table: CompareTable) -> dict[str, float]:
    """Each column of an algorithm's table reduced over one run's log ({} where the run logs none of them)."""
    summary = {}
    for key, (_, reduction) in table.columns.items():
        values = logged_values(train_log, key)
        if values:
            summary[key] = REDUCTIONS[reduction](values)
    return summary


def binned(series: list[tuple[float, float]], budget: float, bins: int = SIGNAL_BINS) -> list[float | None]:
    """Mean value in each of `bins` equal slices of the budget (None where a slice is empty);
    a last step that overshoots the budget counts in the last slice."""
    sums, counts = [0.0] * bins, [0] * bins
    for spent, value in series:
        b = min(bins - 1, int(bins * max(spent - 1, 0) / budget))
        sums[b] += value
        counts[b] += 1
    return [s / n if n else None for s, n in zip(sums, counts, strict=True)]


def aggregate_bins(per_seed: list[list[float | None]]) -> list[dict]:
    out = []
    for column in zip(*per_seed, strict=True):
        mean, std = mean_and_std([v for v in column if v is not None])
        out.append({"mean": mean, "std": std})
    return out


# --- Planning and running --------------------------------------------------------------


def run_names(recipe_paths: list[Path]) -> list[str]:
    """File stems (grpo, poise); the parent folder is added where stems collide."""
    stems = [p.stem for p in recipe_paths]
    names = [f"{p.parent.name}-{p.stem}" if stems.count(p.stem) > 1 else p.stem for p in recipe_paths]
    if len(set(names)) < len(names):
        raise CompareError(f"recipes {', '.join(map(str, recipe_paths))} do not have distinct names: rename one")
    return names


def plan_runs(recipe_paths: list[Path], seeds: list[int], output_dir: Path) -> list[PlannedRun]:
    """Seed by seed, every recipe within a seed: an interrupted sweep leaves comparable runs."""
    named = list(zip(run_names(recipe_paths), recipe_paths, strict=True))
    return [PlannedRun(name, path, seed, output_dir / "runs" / name / f"seed{seed}")
            for seed in seeds for name, path in named]


def check_recipes(recipe_paths: list[Path], overrides: list[str]) -> tuple[dict[str, dict], list[str]]:
    """Load and validate every recipe before anything runs (a typo must not surface an hour
    in); returns the recipes and warnings worth showing."""
    recipes, warnings = {}, []
    for name, path in zip(run_names(recipe_paths), recipe_paths, strict=True):
        recipe = load_recipe(path, overrides)
        try:
            parse_recipe(recipe)
        except ValueError as exc:
            raise RecipeError(f"{path}: {exc}") from None
        schedule = recipe.get("lr_scheduler_type", "linear")
        if schedule not in ("constant", "constant_with_warmup"):
            warnings.append(f"{path} uses lr_scheduler_type {schedule!r}, which decays over max_steps; under a "
                            "budget max_steps is only a cap (--max-steps): the schedule is stretched")
        recipes[name] = recipe
    return recipes, warnings


def run_overrides(run: PlannedRun, budget: Budget, overrides: list[str], max_steps: int) -> list[str]:
    """The user's `--set` overrides, then the sweep's own (later ones win)."""
    return [*overrides, f"seed={run.seed}", f"budget_{budget.unit}={budget.amount}",
            f"budget_eval_points={budget.points}", "eval_every=0", "logging_steps=1", f"max_steps={max_steps}",
            "push_to_hub=false"]


def run_status(run: PlannedRun, expected_recipe: dict) -> str:
    """'complete', 'resume' (has checkpoints) or 'new'. A run made from other settings (the
    recipe file, `--set`, the budget) is an error: reusing it would compare unequal runs."""
    summary_path, recipe_path = run.folder / "summary.json", run.folder / "recipe.yaml"
    if summary_path.exists():
        made_from, status = json.loads(summary_path.read_text()).get("recipe", {}), "complete"
    elif any(run.folder.glob("checkpoint-*")) and recipe_path.exists():
        made_from, status = read_yaml(recipe_path.read_text()), "resume"
    else:
        return "new"
    differing = differing_settings(made_from, expected_recipe)
    if differing:
        raise CompareError(
            f"{run.folder} holds a run made with other settings (differing: {', '.join(differing)}): give another "
            "--output-dir, or delete that folder to rerun it"
        )
    return status


def train_command(run: PlannedRun, run_settings: list[str], resume: bool, show_progress: bool,
                  launcher: list[str] | None = None) -> list[str]:
    """`poise train` for one run with `run_overrides`; `launcher` replaces the Python interpreter,
    e.g. ["accelerate", "launch", "--num_processes", "4"] or ["torchrun", "--nproc_per_node", "4"]."""
    command = [*(launcher or [sys.executable]), "-m", "poise_trl.cli.main", "train", str(run.recipe_path),
               "--output-dir", str(run.folder)]
    command += [] if show_progress else ["--no-progress"]
    return command + run_settings + (["resume_from_checkpoint=true"] if resume else [])


def execute_runs(runs: list[PlannedRun], budget: Budget, overrides: list[str], max_steps: int,
                 show_progress: bool = True, launcher: list[str] | None = None, log=print) -> None:
    """Run what is not complete, in order; stop at the first failure (completed runs stay)."""
    for index, run in enumerate(runs, 1):
        settings = run_overrides(run, budget, overrides, max_steps)
        status = run_status(run, load_recipe(run.recipe_path, settings))
        label = f"[{index}/{len(runs)}] {run.name} seed {run.seed}"
        if status == "complete":
            log(f"{label}: complete, skipped")
            continue
        log(f"{label}: {'resuming from its newest checkpoint' if status == 'resume' else 'starting'} -> {run.folder}")
        run.folder.mkdir(parents=True, exist_ok=True)
        command = train_command(run, settings, status == "resume", show_progress, launcher)
        result = subprocess.run(command, check=False)
        if result.returncode != 0:
            raise CompareError(
                f"{run.name} seed {run.seed} failed (exit code {result.returncode}; its output is above). Completed "
                f"runs are kept in {run.folder.parent.parent}; rerun the same command to resume"
            )


# --- Aggregation -----------------------------------------------------------------------


def load_summaries(runs: list[PlannedRun]) -> dict[str, list[dict]]:
    by_name: dict[str, list[dict]] = {}
    for run in runs:
        path = run.folder / "summary.json"
        if not path.exists():
            raise CompareError(f"{path} is missing: run `poise compare` without --aggregate-only to finish the runs")
        by_name.setdefault(run.name, []).append({**json.loads(path.read_text()), "seed": run.seed})
    return by_name


def resolve_target(target: str | None, curves: dict[str, list[dict]]) -> dict | None:
    """`--target 0.75` (an accuracy) or `--target dapo` (that recipe's final mean accuracy)."""
    if target is None:
        return None
    if target in curves:
        return {"accuracy": curves[target][-1]["accuracy_mean"], "reference": target}
    try:
        value = float(target)
    except ValueError:
        names = ", ".join(curves)
        raise CompareError(f"--target {target!r} is neither an accuracy nor one of the runs ({names})") from None
    return {"accuracy": value, "reference": None}


def summarize_recipe(summaries: list[dict], curves: list[list[dict]], curve: list[dict], budget: Budget,
                     target: float | None) -> dict:
    """One recipe's result from its seeds' summaries, their `budget_curve`s and the aggregate of those."""
    signals, tables, per_seed = declared_signals(), compare_tables(), []
    for summary, seed_curve in zip(summaries, curves, strict=True):
        record = {
            "seed": summary["seed"],
            "start_accuracy": seed_curve[0]["accuracy"],
            "final_accuracy": seed_curve[-1]["accuracy"],
            "generated_tokens": summary["generated_tokens"],
            "generated_rollouts": summary["generated_rollouts"],
            "train_seconds": summary["train_seconds"],
            "steps": summary["steps"],
            "budget_reached": summary["budget_reached"],
        }
        for key in signals:
            record[f"mean {key}"] = run_mean(summary["train_log"], key)
        for table in tables:
            if found := table_summary(summary["train_log"], table):
                record[table.key] = found
        if target is not None:
            accuracies = [p["accuracy"] for p in seed_curve]
            tokens = [p["generated_tokens"] for p in seed_curve]
            record["tokens_to_target"] = first_crossing(tokens, accuracies, target)
            record["seconds_to_target"] = first_crossing([p["train_seconds"] for p in seed_curve], accuracies, target)
        per_seed.append(record)

    def across(key):
        return mean_and_std([r[key] for r in per_seed])

    result = {
        "algo": summaries[0]["algo"],
        "seeds": [s["seed"] for s in summaries],
        "final_accuracy": dict(zip(("mean", "std"), across("final_accuracy"), strict=True)),
        "start_accuracy": curve[0]["accuracy_mean"],
        "generated_tokens": across("generated_tokens")[0],
        "train_seconds": dict(zip(("mean", "std"), across("train_seconds"), strict=True)),
        "all_reached_budget": all(r["budget_reached"] for r in per_seed),
        # Each seed against its own step-0 evaluation (same policy, its own sampling seed).
        "seeds_below_start": sum(r["final_accuracy"] < r["start_accuracy"] for r in per_seed),
        "signals_mean": {key: across(f"mean {key}")[0] for key in signals},
        "curve": curve,
        "signals": {key: aggregate_bins([binned(log_series(s["train_log"], key, budget.unit), budget.amount)
                                         for s in summaries]) for key in signals},
        "runs": per_seed,
    }
    by_task = [s["heldout_history"][-1].get("by_task") for s in summaries]
    if all(by_task):  # a task mix: each task's held-out accuracy at the start and at the end, over seeds
        starts = [s["heldout_history"][0]["by_task"] for s in summaries]
        result["accuracy_by_task"] = {
            task: {"start": mean_and_std([start[task] for start in starts])[0],
                   "final": dict(zip(("mean", "std"), mean_and_std([end[task] for end in by_task]), strict=True))}
            for task in by_task[0]}
    for table in tables:
        if any(table.key in r for r in per_seed):
            stats = {key: mean_and_std([r[table.key].get(key) for r in per_seed if table.key in r])
                     for key in table.columns}
            result[table.key] = {key: dict(zip(("mean", "std"), stat, strict=True)) if table.spread
                                 else stat[0] for key, stat in stats.items()}
    if target is not None:
        # On the seed-mean curve (one evaluation's noise moves a single seed's crossing a lot),
        # and per seed with how many seeds got there.
        accuracies = [p["accuracy_mean"] for p in curve]
        reached = [r for r in per_seed if r["seconds_to_target"] is not None]
        result["to_target"] = {
            "tokens": first_crossing([p["generated_tokens_mean"] for p in curve], accuracies, target),
            "seconds": first_crossing([p["train_seconds_mean"] for p in curve], accuracies, target),
            "seeds_reached": len(reached),
            "seconds_per_seed_mean": mean_and_std([r["seconds_to_target"] for r in reached])[0],
            "tokens_per_seed_mean": mean_and_std([r["tokens_to_target"] for r in reached])[0],
        }
    return result


def aggregate(runs: list[PlannedRun], budget: Budget, target: str | None, recipes: dict[str, dict]) -> dict:
    by_name = load_summaries(runs)
    seed_curves = {name: [budget_curve(s["heldout_history"]) for s in ss] for name, ss in by_name.items()}
    curves = {name: aggregate_curves(c) for name, c in seed_curves.items()}
    resolved = resolve_target(target, curves)
    goal = resolved["accuracy"] if resolved else None
    results = {name: summarize_recipe(ss, seed_curves[name], curves[name], budget, goal)
               for name, ss in by_name.items()}
    reference = resolved.get("reference") if resolved else None
    if reference is not None:
        ref_seconds = results[reference]["to_target"]["seconds"]
        ref_tokens = results[reference]["to_target"]["tokens"]
        for result in results.values():
            reached = result["to_target"]
            reached["seconds_ratio_to_reference"] = _ratio(reached["seconds"], ref_seconds)
            reached["tokens_ratio_to_reference"] = _ratio(reached["tokens"], ref_tokens)
    seeds = {name: [s["seed"] for s in ss] for name, ss in by_name.items()}
    return {
        "budget": asdict(budget),
        "seeds": sorted({run.seed for run in runs}),
        "target": resolved,
        "differences": paired_differences(seed_curves, seeds),
        "recipes": {name: {"path": str(next(r.recipe_path for r in runs if r.name == name)), "recipe": recipe}
                    for name, recipe in recipes.items()},
        "results": results,
        "versions": package_versions(),
    }


# --- Paired differences between arms, with the noise of seeds and of the held-out sample ---


def curve_weights(points: int) -> np.ndarray:
    """Trapezoid weights over `points` equally spaced budget points, summing to 1: the area under a
    held-out curve per unit of budget (the start counts half, as does the end)."""
    if points == 1:
        return np.ones(1)
    weights = np.ones(points)
    weights[[0, -1]] = 0.5
    return weights / weights.sum()


def seed_evaluations(curves: list[list[dict]], length: int, task: str | None = None) -> list[np.ndarray | None]:
    """Each seed's first `length` budget points as a [points, prompts] array of per-prompt Avg@k (only the
    prompts of `task` when given), or None where a run recorded no per-prompt results."""
    out = []
    for curve in curves:
        rows = [p.get("per_prompt") for p in curve[:length]]
        same_prompts = all(r is not None and len(r) == len(rows[0]) for r in rows)
        values = np.array(rows, dtype=float) if same_prompts else None
        if values is not None and task is not None:
            values = values[:, np.array(curve[0]["per_prompt_task"]) == task]
        out.append(values)
    return out


def prompt_tasks(curves: list[list[dict]]) -> list[str]:
    """The tasks every run's held-out prompts name (a mix's runs record them), in first-seen order."""
    labels = [p.get("per_prompt_task") for curve in curves for p in curve]
    return list(dict.fromkeys(labels[0])) if labels and all(labels) else []


def paired_difference(first: list[list[dict]], second: list[list[dict]], samples: int = BOOTSTRAP_SAMPLES,
                      seed: int = 0, task: str | None = None) -> dict:
    """Arm `first` minus arm `second` (seed by seed) in final and area-under-curve held-out accuracy.

    95% percentile intervals of a bootstrap over seeds and, within a seed, the shared held-out prompts; runs
    without per-prompt results use a normal draw from each evaluation's standard error (`noise` says which).
    With `task`, on that task's prompts alone; and for a mix, each task's under `by_task`.
    """
    length = min(len(c) for c in [*first, *second])
    weights = curve_weights(length)
    evaluations = list(zip(seed_evaluations(first, length, task), seed_evaluations(second, length, task),
                           strict=True))
    by_prompt = all(a is not None and b is not None and a.shape == b.shape for a, b in evaluations)
    rng = np.random.default_rng(seed)
    seeds = len(evaluations)
    if by_prompt:
        per_seed = np.array([(a - b).mean(axis=1) for a, b in evaluations])  # [seeds, points]
        # draws[s, r, k]: seed s's point differences when it fills slot k of redraw r, its prompts redrawn
        draws = np.stack([rng.multinomial(len(a.T), np.full(len(a.T), 1 / len(a.T)), size=(samples, seeds))
                          @ (a - b).T / len(a.T) for a, b in evaluations])
        chosen = rng.integers(0, seeds, size=(samples, seeds))
        boot = draws[chosen, np.arange(samples)[:, None], np.arange(seeds)].mean(axis=1)  # [samples, points]
    else:
        pairs = [list(zip(ca[:length], cb[:length], strict=True))
                 for ca, cb in zip(first, second, strict=True)]
        per_seed = np.array([[pa["accuracy"] - pb["accuracy"] for pa, pb in pair] for pair in pairs])
        # One normal draw per seed for all its budget points, the arms' errors independent: both err wide.
        # None at the start, where both arms evaluate the same policy on the same draw.
        scale = np.array([[0.0 if pa["step"] == pb["step"] == 0 and pa["accuracy"] == pb["accuracy"]
                           else math.hypot(pa["stderr"], pb["stderr"]) for pa, pb in pair] for pair in pairs])
        chosen = rng.integers(0, seeds, size=(samples, seeds))
        boot = (per_seed[chosen] + rng.standard_normal((samples, seeds, 1)) * scale[chosen]).mean(axis=1)
    result = {"seeds": seeds, "noise": "seeds and held-out prompts" if by_prompt else
              "seeds and held-out sample (normal, from each evaluation's standard error)"}
    for key, column in (("final", np.eye(length)[-1]), ("area", weights)):
        diff = float(per_seed.mean(axis=0) @ column)
        interval = [float(v) for v in np.percentile(boot @ column, [2.5, 97.5])]
        result[key] = {"diff": diff, "ci95": interval, "resolved": interval[0] > 0 or interval[1] < 0}
    if task is None and by_prompt and (tasks := prompt_tasks([*first, *second])):
        result["by_task"] = {name: paired_difference(first, second, samples, seed, name) for name in tasks}
    return result


def paired_differences(seed_curves: dict[str, list[list[dict]]],
                       seeds: dict[str, list[int]]) -> dict[str, dict]:
    """{"a - b": difference} for every pair of arms (in the order given), on the seeds both ran, and
    {"a - start"} for each arm: its curve against its own start held flat (the same policy and draw)."""
    out = {f"{name} - start": paired_difference(curves, [[curve[0]] * len(curve) for curve in curves])
           for name, curves in seed_curves.items()}
    for first, second in itertools.combinations(seed_curves, 2):
        common = [s for s in seeds[first] if s in seeds[second]]
        if common:
            pick = {name: [seed_curves[name][seeds[name].index(s)] for s in common]
                    for name in (first, second)}
            out[f"{first} - {second}"] = paired_difference(pick[first], pick[second])
    return out


def _ratio(value: float | None, reference: float | None) -> float | None:
    return value / reference if value is not None and reference else None


# --- Outputs ---------------------------------------------------------------------------


def write_outputs(report: dict, output_dir: Path) -> list[Path]:
    write_json(output_dir / "compare.json", report)
    return [output_dir / "compare.json", *plot_report(report, output_dir)]


def plot_report(report: dict, output_dir: Path) -> list[Path]:
    plt = pyplot()
    results = report["results"]
    target = report["target"]
    unit = report["budget"]["unit"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, result in results.items():
        curve = result["curve"]
        mean = [p["accuracy_mean"] for p in curve]
        low = [p["accuracy_mean"] - p["accuracy_std"] for p in curve]
        high = [p["accuracy_mean"] + p["accuracy_std"] for p in curve]
        for ax, key in zip(axes, (f"generated_{unit}_mean", "train_seconds_mean"), strict=True):
            xs = [p[key] for p in curve]
            (line,) = ax.plot(xs, mean, "o-", label=f"{name} ({len(result['seeds'])} seeds)")
            ax.fill_between(xs, low, high, color=line.get_color(), alpha=0.15)
    for ax, xlabel in zip(axes, (f"generated {unit}", "training seconds (optimizer steps)"), strict=True):
        if target:
            ax.axhline(target["accuracy"], color="k", ls="--", lw=1,
                       label=f"target {target['accuracy']:.3f}"
                       + (f" ({target['reference']} final)" if target["reference"] else ""))
        ax.set(xlabel=xlabel, ylabel="held-out accuracy (mean ± std over seeds)")
        ax.legend(fontsize=8)
    axes[0].set_title(f"held-out accuracy vs generated {unit}")
    axes[1].set_title("held-out accuracy vs wall-clock")
    fig.tight_layout()
    accuracy_path = output_dir / "accuracy.png"
    fig.savefig(accuracy_path, dpi=100)
    plt.close(fig)

    titles = {key: readers[-1].title for key, readers in declared_signals().items()}
    fig, axes = plt.subplots(1, len(titles), figsize=(4.5 * len(titles), 4))
    for ax, (key, title) in zip(axes, titles.items(), strict=True):
        drawn = False
        for name, result in results.items():
            bins = result["signals"][key]
            width = report["budget"]["amount"] / SIGNAL_BINS
            points = [((i + 0.5) * width, b["mean"], b["std"]) for i, b in enumerate(bins) if b["mean"] is not None]
            if not points:
                continue
            xs, ys, ss = zip(*points, strict=True)
            (line,) = ax.plot(xs, ys, "o-", ms=3, label=name)
            ax.fill_between(xs, [y - s for y, s in zip(ys, ss, strict=True)],
                            [y + s for y, s in zip(ys, ss, strict=True)],
                            color=line.get_color(), alpha=0.15)
            drawn = True
        ax.set(title=title, xlabel=f"generated {unit} (mean per {SIGNAL_BINS}th of the budget)")
        if drawn:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "no run logs this", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    signals_path = output_dir / "training_signals.png"
    fig.savefig(signals_path, dpi=100)
    plt.close(fig)
    return [accuracy_path, signals_path]


def table_rows(report: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """The final tables as strings, one row per recipe: (title, header, rows) for the
    results, then for the target crossing and the training signals."""
    target = report["target"]

    def num(value, digits=3):
        return "-" if value is None else f"{value:.{digits}f}"

    def pm(stat, digits=3):
        return "-" if stat["mean"] is None else f"{stat['mean']:.{digits}f} ± {stat['std']:.{digits}f}"

    shown = declared_signals()
    results, signals = [], []
    for name, r in report["results"].items():
        name = name + ("" if r["all_reached_budget"] else " *")
        results.append([name, r["algo"], str(len(r["seeds"])), num(r["start_accuracy"]), pm(r["final_accuracy"]),
                        f"{r['generated_tokens']:,.0f}", pm(r["train_seconds"], 0)])
        row = [name]
        if target:
            t = r["to_target"]
            row += [num(t["tokens"], 0), num(t["seconds"], 0), f"{t['seeds_reached']}/{len(r['seeds'])}"]
            row += [num(t["seconds_ratio_to_reference"], 2)] if target["reference"] else []
        means = r["signals_mean"]
        row += [num(means[key]) for key in shown]
        signals.append(row)
    second_header = ["run"]
    if target:
        second_header += ["tokens to target", "s to target", "seeds reached"]
        second_header += [f"s ratio vs {target['reference']}"] if target["reference"] else []
    second_header += [readers[-1].header for readers in shown.values()]
    goal = "" if not target else f"target accuracy {target['accuracy']:.3f}" + (
        f" ({target['reference']}'s final mean)" if target["reference"] else "") + "; "
    tables = [
        ("held-out accuracy and compute (mean ± std over seeds)",
         ["run", "algo", "seeds", "start acc", "final acc", "tokens", "train s"], results),
        (f"{goal}training signals (means over training)", second_header, signals),
    ]
    differences = [[pair, str(d["seeds"]), *interval_cells(d["final"]), *interval_cells(d["area"]),
                    d["noise"]] for pair, d in report.get("differences", {}).items()]
    if differences:
        header = ["pair", "seeds", "final diff", "final", "area diff", "area", "interval redraws"]
        tables.append(("paired differences of held-out accuracy (95% bootstrap interval; area: mean over "
                       "the budget)", header, differences))
    per_task = [[pair, task, *interval_cells(t["final"]), *interval_cells(t["area"])]
                for pair, d in report.get("differences", {}).items() for task, t in d.get("by_task", {}).items()]
    if per_task:
        tables.append(("paired differences per task (the same bootstrap, on each task's held-out prompts)",
                       ["pair", "task", "final diff", "final", "area diff", "area"], per_task))
    for table in compare_tables():
        rows = [[name, *((pm if table.spread else num)(r[table.key][key], *(() if how != "last" else (0,)))
                        for key, (_, how) in table.columns.items()),
                 *([f"{r['seeds_below_start']}/{len(r['seeds'])}"] if table.seeds_below_start else [])]
                for name, r in report["results"].items() if table.key in r]
        if rows:
            header = ["run", *(column for column, _ in table.columns.values())]
            header += ["seeds ending below their start"] if table.seeds_below_start else []
            tables.append((table.title, header, rows))
    return tables


def interval_cells(difference: dict) -> list[str]:
    """'+0.012 [-0.020, +0.045]' and whether its interval excludes 0 ('resolved') or holds it."""
    low_high = difference["ci95"]
    return [f"{difference['diff']:+.3f} [{low_high[0]:+.3f}, {low_high[1]:+.3f}]",
            "resolved" if difference["resolved"] else "not resolved"]
