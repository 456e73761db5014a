"""`poise compare`: recipes against each other at equal generation compute, over seeds.

Every (recipe, seed) run is `poise train RECIPE seed=S budget_tokens=N ...` in its own
process, so a crash, a vLLM engine or GPU memory never leaks from one run into the next. It
writes to O/runs/<name>/seed<S>/: a run with a summary.json made with the same settings is
complete and skipped; one with checkpoints resumes from the newest (the held-out curve, the
counters and the training clock come back with it, see `HeldOutEvalCallback`).

Aggregation reads only the runs' summary.json files: the held-out curve recorded at equal
fractions of the budget (each point carries generated tokens and training seconds) and TRL's
per-step log. Curves of different seeds are aligned by budget point; spread is the sample
standard deviation over seeds. Training seconds count optimizer steps only (generation,
scoring, the update), not held-out evaluation or checkpoint writing.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from poise_trl.callbacks import Budget
from poise_trl.provenance import package_versions, write_json
from poise_trl.recipe import RecipeError, load_recipe, read_yaml
from poise_trl.run_folder import differing_settings

SIGNAL_BINS = 10
# Trainer-log series shown over training: (log key, title). POISE's probe metrics only exist
# once the probe is active; DAPO's counts only under dynamic sampling.
SIGNALS = {
    "grad_norm": "gradient norm",
    "probe/variance_reduction": "POISE variance reduction",
    "probe/mae": "POISE probe MAE",
    "dapo/dropped_fraction": "DAPO dropped-group fraction",
    "zero_signal_fraction": "zero-signal rollouts (all rewards of the prompt equal)",
}

# POISE's prompt selection (recipes with `prompt_selection: true`): cumulative counters (their
# last logged value) and per-step shares (their mean over training).
SELECTION_COUNTERS = ("selection/candidates_scored", "selection/prompts_skipped", "selection/prefill_tokens")
SELECTION_MEANS = ("selection/zero_signal_probe", "selection/zero_signal_floor",
                   "selection/informativeness_pool", "selection/informativeness_rolled_out")

# Critic arms (AsyPPO, PPO, VAPO): per-step critic diagnostics, averaged over the second half of
# training, when the critics have had time to learn (issue 17's bar: explained variance >= 0.3).
CRITIC_MEANS = ("critic/explained_variance", "critic/explained_variance_first_token", "critic/mc_sign_agreement")


class CompareError(ValueError):
    """A comparison that cannot run or be aggregated as asked; the message says why and what to do."""


@dataclass(frozen=True)
class PlannedRun:
    name: str
    recipe_path: Path
    seed: int
    folder: Path


# ---------------------------------------------------------------------------------------
# Pure functions on curves (tested against hand-made curves)
# ---------------------------------------------------------------------------------------


def first_crossing(xs: list[float], ys: list[float], target: float) -> float | None:
    """The x at which a piecewise-linear curve first reaches `target` (None if it never does).

    Between two evaluations the curve is taken as linear: if y_{i-1} < target <= y_i, the
    crossing is x_{i-1} + (target - y_{i-1}) / (y_i - y_{i-1}) * (x_i - x_{i-1})."""
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
            "generated_tokens_mean": tokens, "generated_rollouts_mean": rollouts, "train_seconds_mean": seconds, "train_seconds_std": seconds_std,
            "seeds": len(column),
        })
    return aggregated


def log_series(train_log: list[dict], key: str, unit: str = "tokens") -> list[tuple[float, float]]:
    """(generated tokens or rollouts, value) for every training log entry that has `key`. POISE's
    variance reduction counts only where the probe gave the baselines (its MAE is logged only
    then; bootstrap rounds use RLOO). DAPO's dropped fraction comes from its group counts."""
    series, spent = [], f"generated_{unit}"
    for entry in train_log:
        if spent not in entry:
            continue
        if key == "dapo/dropped_fraction":
            if entry.get("dapo/generated_groups"):
                series.append((entry[spent], entry["dapo/dropped_groups"] / entry["dapo/generated_groups"]))
        elif key == "zero_signal_fraction":
            # Every generated group counts, DAPO's dropped ones included; TRL logs the share of the
            # step's groups whose rewards have zero std. A*-PO logs its own (rollouts whose target r - V* is 0).
            if entry.get("zero_signal_fraction") is not None:
                series.append((entry[spent], entry["zero_signal_fraction"]))
            elif entry.get("dapo/generated_groups"):
                uninformative = entry["dapo/generated_groups"] - entry["dapo/informative_groups"]
                series.append((entry[spent], uninformative / entry["dapo/generated_groups"]))
            elif entry.get("frac_reward_zero_std") is not None:
                series.append((entry[spent], entry["frac_reward_zero_std"]))
        elif entry.get(key) is not None and (key != "probe/variance_reduction" or entry.get("probe/mae") is not None):
            series.append((entry[spent], entry[key]))
    return series


def logged_values(train_log: list[dict], key: str) -> list[float]:
    """Every value of `key` in the training log, in step order (entries without it skipped)."""
    return [e[key] for e in train_log if e.get(key) is not None]


def selection_summary(train_log: list[dict]) -> dict[str, float]:
    """The last value of each selection counter and the mean of each per-step share ({} without selection)."""
    summary = {}
    for key in SELECTION_COUNTERS:
        values = logged_values(train_log, key)
        if values:
            summary[key] = values[-1]
    for key in SELECTION_MEANS:
        values = logged_values(train_log, key)
        if values:
            summary[key] = sum(values) / len(values)
    return summary


def critic_summary(train_log: list[dict]) -> dict[str, float]:
    """The mean of each critic diagnostic over the second half of its logged steps ({} without critics)."""
    summary = {}
    for key in CRITIC_MEANS:
        values = logged_values(train_log, key)
        if values:
            second_half = values[len(values) // 2:]
            summary[key] = sum(second_half) / len(second_half)
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


# ---------------------------------------------------------------------------------------
# Planning and running
# ---------------------------------------------------------------------------------------


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
    return [PlannedRun(name, path, seed, output_dir / "runs" / name / f"seed{seed}") for seed in seeds for name, path in named]


def check_recipes(recipe_paths: list[Path], overrides: list[str]) -> tuple[dict[str, dict], list[str]]:
    """Load and validate every recipe before anything runs (a typo must not surface an hour
    in); returns the recipes and warnings worth showing."""
    from poise_trl.build import parse_recipe

    recipes, warnings = {}, []
    for name, path in zip(run_names(recipe_paths), recipe_paths, strict=True):
        recipe = load_recipe(path, overrides)
        try:
            parse_recipe(recipe)
        except ValueError as exc:
            raise RecipeError(f"{path}: {exc}") from None
        if recipe.get("lr_scheduler_type", "linear") not in ("constant", "constant_with_warmup"):
            warnings.append(f"{path} uses lr_scheduler_type {recipe.get('lr_scheduler_type', 'linear')!r}, which decays "
                            "over max_steps; under a budget max_steps is only a cap (--max-steps): the schedule is stretched")
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


def budget_dict(budget: Budget) -> dict:
    return {"unit": budget.unit, "amount": budget.amount, "points": budget.points}


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


# ---------------------------------------------------------------------------------------
# Aggregation
# ---------------------------------------------------------------------------------------


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
        raise CompareError(f"--target {target!r} is neither an accuracy nor one of the runs ({', '.join(curves)})") from None
    return {"accuracy": value, "reference": None}


def summarize_recipe(summaries: list[dict], curves: list[list[dict]], curve: list[dict], budget: Budget,
                     target: float | None) -> dict:
    """One recipe's result from its seeds' summaries, their `budget_curve`s and the aggregate of those."""
    per_seed = []
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
        for key in SIGNALS:
            record[f"mean {key}"] = mean_and_std([v for _, v in log_series(summary["train_log"], key)])[0]
        counted = [e for e in summary["train_log"] if "zero_signal_rollouts" in e]
        if counted:  # A*-PO: its stage-1 rollouts (V* estimation) carry no policy-gradient signal either
            record["mean zero_signal_fraction"] = counted[-1]["zero_signal_rollouts"] / counted[-1]["generated_rollouts"]
        selection = selection_summary(summary["train_log"])
        if selection:
            record["selection"] = selection
        critics = critic_summary(summary["train_log"])
        if critics:
            record["critics_second_half"] = critics
        if target is not None:
            accuracies = [p["accuracy"] for p in seed_curve]
            record["tokens_to_target"] = first_crossing([p["generated_tokens"] for p in seed_curve], accuracies, target)
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
        "signals_mean": {key: across(f"mean {key}")[0] for key in SIGNALS},
        "curve": curve,
        "signals": {key: aggregate_bins([binned(log_series(s["train_log"], key, budget.unit), budget.amount)
                                         for s in summaries]) for key in SIGNALS},
        "runs": per_seed,
    }
    by_task = [s["heldout_history"][-1].get("by_task") for s in summaries]
    if all(by_task):  # a task mix: each task's held-out accuracy at the start and at the end, over seeds
        starts = [s["heldout_history"][0]["by_task"] for s in summaries]
        result["accuracy_by_task"] = {
            task: {"start": mean_and_std([start[task] for start in starts])[0],
                   "final": dict(zip(("mean", "std"), mean_and_std([end[task] for end in by_task]), strict=True))}
            for task in by_task[0]}
    if any("selection" in r for r in per_seed):
        result["selection"] = {key: mean_and_std([r["selection"].get(key) for r in per_seed if "selection" in r])[0]
                               for key in (*SELECTION_COUNTERS, *SELECTION_MEANS)}
    if any("critics_second_half" in r for r in per_seed):
        result["critics_second_half"] = {
            key: dict(zip(("mean", "std"), mean_and_std([r["critics_second_half"].get(key) for r in per_seed
                                                         if "critics_second_half" in r]), strict=True))
            for key in CRITIC_MEANS}
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
    results = {name: summarize_recipe(ss, seed_curves[name], curves[name], budget, goal) for name, ss in by_name.items()}
    reference = resolved.get("reference") if resolved else None
    if reference is not None:
        ref_seconds = results[reference]["to_target"]["seconds"]
        ref_tokens = results[reference]["to_target"]["tokens"]
        for result in results.values():
            reached = result["to_target"]
            reached["seconds_ratio_to_reference"] = _ratio(reached["seconds"], ref_seconds)
            reached["tokens_ratio_to_reference"] = _ratio(reached["tokens"], ref_tokens)
    return {
        "budget": budget_dict(budget),
        "seeds": sorted({run.seed for run in runs}),
        "target": resolved,
        "recipes": {name: {"path": str(next(r.recipe_path for r in runs if r.name == name)), "recipe": recipe}
                    for name, recipe in recipes.items()},
        "results": results,
        "versions": package_versions(),
    }


def _ratio(value: float | None, reference: float | None) -> float | None:
    return value / reference if value is not None and reference else None


# ---------------------------------------------------------------------------------------
# Outputs
# ---------------------------------------------------------------------------------------


def write_outputs(report: dict, output_dir: Path) -> list[Path]:
    write_json(output_dir / "compare.json", report)
    return [output_dir / "compare.json", *plot_report(report, output_dir)]


def plot_report(report: dict, output_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
                       label=f"target {target['accuracy']:.3f}" + (f" ({target['reference']} final)" if target["reference"] else ""))
        ax.set(xlabel=xlabel, ylabel="held-out accuracy (mean ± std over seeds)")
        ax.legend(fontsize=8)
    axes[0].set_title(f"held-out accuracy vs generated {unit}")
    axes[1].set_title("held-out accuracy vs wall-clock")
    fig.tight_layout()
    accuracy_path = output_dir / "accuracy.png"
    fig.savefig(accuracy_path, dpi=100)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(SIGNALS), figsize=(4.5 * len(SIGNALS), 4))
    for ax, (key, title) in zip(axes, SIGNALS.items(), strict=True):
        drawn = False
        for name, result in results.items():
            bins = result["signals"][key]
            width = report["budget"]["amount"] / SIGNAL_BINS
            points = [((i + 0.5) * width, b["mean"], b["std"]) for i, b in enumerate(bins) if b["mean"] is not None]
            if not points:
                continue
            xs, ys, ss = zip(*points, strict=True)
            (line,) = ax.plot(xs, ys, "o-", ms=3, label=name)
            ax.fill_between(xs, [y - s for y, s in zip(ys, ss, strict=True)], [y + s for y, s in zip(ys, ss, strict=True)],
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
        row += [num(means[key]) for key in SIGNALS]
        signals.append(row)
    second_header = ["run"]
    if target:
        second_header += ["tokens to target", "s to target", "seeds reached"]
        second_header += [f"s ratio vs {target['reference']}"] if target["reference"] else []
    second_header += ["grad norm", "POISE VR", "probe MAE", "DAPO dropped", "zero-signal"]
    goal = "" if not target else f"target accuracy {target['accuracy']:.3f}" + (
        f" ({target['reference']}'s final mean)" if target["reference"] else "") + "; "
    tables = [
        ("held-out accuracy and compute (mean ± std over seeds)",
         ["run", "algo", "seeds", "start acc", "final acc", "tokens", "train s"], results),
        (f"{goal}training signals (means over training)", second_header, signals),
    ]
    critics = [[name, *(pm(r["critics_second_half"][key]) for key in CRITIC_MEANS),
                f"{r['seeds_below_start']}/{len(r['seeds'])}"]
               for name, r in report["results"].items() if "critics_second_half" in r]
    if critics:
        tables.append(("critics, second half of training (mean ± std over seeds)",
                       ["run", "explained variance", "EV first token", "sign agreement with MC advantage",
                        "seeds ending below their start"], critics))
    selection = [[name, *(num(r["selection"][key], 0) for key in SELECTION_COUNTERS),
                  *(num(r["selection"][key]) for key in SELECTION_MEANS)]
                 for name, r in report["results"].items() if "selection" in r]
    if selection:
        tables.append(("prompt selection (means over seeds: counters at the end, shares over training)",
                       ["run", "candidates scored", "prompts skipped", "prefill tokens", "zero-signal (probe's picks)",
                        "zero-signal (random floor)", "p(1-p) pool", "p(1-p) rolled out"], selection))
    return tables
