"""How POISE's costs grow: the probe refit, and a whole step against GRPO with the same 2 rollouts.

(a) Probe fit seconds vs buffer rows and hidden size, exact vs fast (`probe_fit`), on the CPU with
    one thread and with all threads, and on CUDA when present. Features are synthetic, hidden-state
    like (a few strong directions, noise, a common offset); the fast fit is timed as in training:
    warm-started from the fit before, after one batch of 512 rows entered the buffer. Where the
    exact fit runs, the fast fit's predictions are compared with it, and the checkpoint size of a
    full buffer is recorded.
(b) POISE vs GRPO (num_generations=2) step time and peak memory on randomly initialised
    Qwen3-shaped models built from a config (the toy character tokenizer, so the vocabulary is
    tiny), sweeping width, depth, completion length (forced with min_new_tokens) and batch size.
    POISE's extra cost is broken down into its feature pass (forward + hook pooling + entropies),
    probe predict and buffer append + refit. At the first POISE step of each point, live tensors
    are scanned: none of size batch x length x hidden may outlive the forward pass.
(c) Online variance reduction of a short `recipes/toy/poise.yaml` run trained with the fast fit
    (forced: at the toy width, 128, "fast" would use the exact solver), with an exact-fit shadow
    estimator fed the same batches: both predict each batch before their refit, so the two
    variance-reduction ratios are out of sample on identical rollouts.

    python benchmarks/poise_scale.py            # the committed run: 23 min on 2 shared CPU cores, most
                                                # of it the exact fits with 2 contended threads
    python benchmarks/poise_scale.py --quick    # smoke test, ~1 min
    python benchmarks/poise_scale.py --replot   # redraw the PNG from the JSON
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

from poise_trl.core.provenance import package_versions, write_json
from poise_trl.probe.estimator import LinearValueProbe, ProbeEstimator
from poise_trl.probe.features import RolloutFeatures

REFERENCE = (4096, 2560)  # the reference run's buffer rows, Qwen3-4B hidden size
# build_run evaluates held-out accuracy at the start and the end of every run, outside the timed
# steps but inside the peak-memory window: one prompt, one token.
MINIMAL_EVAL = {"eval_every": 0, "eval_limit": 1, "eval_num_samples": 1, "eval_max_new_tokens": 1,
                "eval_batch_size": 1}
BATCH_ROWS = 512  # 256 prompts x 2 rollouts enter the buffer per step


# ------------------------------------------------------------------------------------------ (a)


def hidden_like(n: int, d: int, seed: int) -> tuple[RolloutFeatures, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mix = torch.Generator().manual_seed(1)
    strong = torch.randn(8, d, generator=mix) * torch.linspace(3, 0.5, 8)[:, None]
    offset = 5 * torch.randn(d, generator=mix)
    scale = torch.rand(d, generator=mix) + 0.1  # uneven noise per coordinate: no flat spectrum

    def side(latent):
        return latent @ strong + torch.randn(n, d, generator=g) * scale + offset

    latent = torch.randn(n, 8, generator=g)
    target = (0.5 + 0.1 * latent[:, 0] - 0.1 * latent[:, 1] + 0.05 * torch.randn(n, generator=g)).clamp(0, 1)
    return RolloutFeatures(side(latent), side(latent.flip(1)), torch.rand(n, 3, generator=g)), target


def timed(fn, clock=time.perf_counter):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = clock()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, clock() - start


def fit_point(rows: int, d: int, device: str, threads: int, run_exact: bool) -> dict:
    torch.set_num_threads(threads)
    feats, y = hidden_like(rows + BATCH_ROWS, d, seed=rows + d)
    before, now = slice(0, rows), slice(BATCH_ROWS, rows + BATCH_ROWS)
    fast = LinearValueProbe(device=device)
    _, cold = timed(lambda: fast.fit(feats[before], y[before]))
    cpu_start = time.process_time()
    _, warm = timed(lambda: fast.fit(feats[now], y[now]))
    # CPU seconds (all threads together) beside the wall seconds: other jobs on a shared machine
    # stretch the wall clock, not the work.
    point = {"rows": rows, "hidden": d, "device": device, "threads": threads, "fast_cold_seconds": cold,
             "fast_seconds": warm, "fast_cpu_seconds": time.process_time() - cpu_start}
    if run_exact:
        cpu_start = time.process_time()
        exact, seconds = timed(lambda: LinearValueProbe(fit_method="exact", device=device).fit(feats[now], y[now]))
        point["exact_cpu_seconds"] = time.process_time() - cpu_start
        test = feats[:BATCH_ROWS]  # rows that left the buffer: out of sample for both fits
        gap = (fast.predict(test) - exact.predict(test)).abs()
        point.update(exact_seconds=seconds, speedup=seconds / warm,
                     fast_vs_exact_mean_abs=float(gap.mean()), fast_vs_exact_max_abs=float(gap.max()))
    print(f"  fit {rows:>6} x {d:<5} {device:<4} {threads:>2} thr: fast {warm:7.3f}s "
          f"(CPU {point['fast_cpu_seconds']:.3f}s, cold {cold:6.2f}s)"
          + (f"  exact {point['exact_seconds']:7.2f}s  |fast-exact| mean {point['fast_vs_exact_mean_abs']:.4f}"
             if run_exact else ""), flush=True)
    return point


def checkpoint_size(rows: int, d: int) -> dict:
    est = ProbeEstimator(bootstrap_steps=1, capacity_rows=rows)
    feats, y = hidden_like(rows, d, seed=0)
    est.update_from_targets(feats, y, group_size=2)
    with tempfile.TemporaryDirectory() as tmp:
        _, seconds = timed(lambda: est.save(tmp))
        size = sum(p.stat().st_size for p in Path(tmp).iterdir())
    return {"rows": rows, "hidden": d, "bytes": size, "save_seconds": seconds}


def fit_sweep(cli) -> dict:
    all_threads = os.cpu_count() or 1
    sizes = sorted({(r, REFERENCE[1]) for r in cli.rows} | {(REFERENCE[0], d) for d in cli.hidden})
    points = []
    for threads in sorted({1, all_threads}):
        for rows, d in sizes:
            run_exact = rows * d * d <= cli.exact_max_rows_d2
            points.append(fit_point(rows, d, "cpu", threads, run_exact))
    if torch.cuda.is_available():
        for rows, d in sizes + [(16384, 5120)]:
            points.append(fit_point(rows, d, "cuda", all_threads, True))
    torch.set_num_threads(all_threads)
    ref = next((p for p in points if (p["rows"], p["hidden"], p["threads"], p["device"]) == (*REFERENCE, 1, "cpu")),
               None)
    return {
        "points": points,
        "reference_one_thread": ref,
        "done_when_fast_at_most_1s": ref["fast_seconds"] <= 1.0 if ref else None,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "checkpoint": [checkpoint_size(*REFERENCE)],
    }


# ------------------------------------------------------------------------------------------ (b)


class PeakRSS:
    """Peak resident memory above the level at entry, sampled every 10 ms (CPU has no allocator stats)."""

    def __enter__(self):
        self.proc, self.base, self.peak, self._stop = psutil.Process(), psutil.Process().memory_info().rss, 0, False
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while not self._stop:
            self.peak = max(self.peak, self.proc.memory_info().rss - self.base)
            time.sleep(0.01)

    def __exit__(self, *exc):
        self._stop = True
        self.thread.join()


def large_live_tensors(batch: int, length: int, hidden: int) -> list[tuple[int, ...]]:
    """Shapes of live tensors holding at least batch x length x hidden elements with a hidden axis."""
    found = []
    for obj in gc.get_objects():
        try:
            if (torch.is_tensor(obj) and obj.dim() >= 3 and obj.shape[-1] == hidden
                    and obj.numel() >= batch * length * hidden):
                found.append(tuple(obj.shape))
        except Exception:  # noqa: BLE001 - gc hands back half-built objects of every kind
            continue
    return found


def build_model_dir(root: Path, hidden: int, layers: int) -> Path:
    """A random Qwen3 with Qwen3's proportions (head_dim 128 where it fits, 2 query heads per KV
    head, MLP 3x) and the toy tokenizer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from poise_trl.run.toy import build_tokenizer

    path = root / f"qwen3-h{hidden}-l{layers}"
    if (path / "config.json").exists():
        return path
    tokenizer = build_tokenizer()
    head_dim = 128 if hidden >= 512 else 32
    heads = hidden // head_dim
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=head_dim,
        max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    ))
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def step_point(algo: str, model_dir: Path, hidden: int, batch: int, length: int, steps: int, workdir: Path,
               num_iterations: int = 1) -> dict:
    from transformers import TrainerCallback

    from poise_trl.run.build import build_run

    recipe = {
        "algo": algo, "model": str(model_dir), "dataset": "toy-arith", "dataset_size": 512, "seed": 0,
        "num_generations": 2, "per_device_train_batch_size": batch, "max_completion_length": length,
        "generation_kwargs": {"min_new_tokens": length}, "learning_rate": 1e-5, "max_steps": steps,
        "logging_steps": steps, "save_strategy": "no", "beta": 0.0, "scale_rewards": "none",
        "num_iterations": num_iterations, "loss_type": "dapo", "epsilon": 0.2, "epsilon_high": 0.28,
        "rewards": ["math_accuracy"], **MINIMAL_EVAL,
    }
    if algo == "poise":
        recipe.update(probe_bootstrap_steps=1, probe_buffer_rows=4096)
    # Wall seconds, and CPU seconds of this process: on a machine shared with other jobs the CPU
    # time of a one-thread run is the steadier measure of the work done.
    times, cpu_times, leaks = [], [], []
    # feature_pass, probe_predict and probe_update happen inside all_advantage_work, which also
    # holds the baseline arithmetic, the online metrics and their logging.
    parts = {"feature_pass": [], "probe_predict": [], "probe_update": [], "all_advantage_work": []}

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.start, self.cpu_start = time.perf_counter(), time.process_time()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.start)
            cpu_times.append(time.process_time() - self.cpu_start)

    trainer = build_run(recipe, str(workdir / algo), overwrite=True).trainer
    trainer.add_callback(StepTimer())
    if algo == "poise":
        def timing(name, fn):
            def wrapped(*a, **k):
                out, seconds = timed(lambda: fn(*a, **k), clock=time.process_time)
                parts[name].append(seconds)
                return out
            return wrapped

        features_for = timing("feature_pass", trainer._features_for)

        def features_then_scan(output):
            features = features_for(output)
            if not leaks:  # first step only (not timed): tensors alive once the pass is over
                leaks.append(large_live_tensors(batch, length, hidden))
            return features

        trainer._features_for = features_then_scan
        trainer.compute_advantages = timing("all_advantage_work", trainer.compute_advantages)
        trainer.value_estimator.predict = timing("probe_predict", trainer.value_estimator.predict)
        trainer.value_estimator.update = timing("probe_update", trainer.value_estimator.update)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    with PeakRSS() as rss:
        trainer.train()
    result = {
        # The first step pays one-off costs. With num_iterations=2 a round is two steps (generate +
        # update, update): the mean over an even number of steps counts whole rounds.
        "step_wall_seconds": statistics.mean(times[1:]),
        "step_cpu_seconds": statistics.mean(cpu_times[1:]),
        "step_wall_seconds_all": times,
        "step_cpu_seconds_all": cpu_times,
        "peak_rss_increase_mb": rss.peak / 2**20,
    }
    if torch.cuda.is_available():
        result["peak_cuda_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
    if algo == "poise":
        # per step, like the step times (a round's costs spread over its num_iterations steps)
        result["extra_cpu_seconds"] = {name: sum(v[1:]) / (steps - 1) for name, v in parts.items()}
        result["large_live_tensors_after_feature_pass"] = leaks[0]
    del trainer
    gc.collect()
    return result


def step_sweep(cli, workdir: Path) -> list[dict]:
    base = {"hidden": cli.base[0], "layers": cli.base[1], "length": cli.base[2], "batch": cli.base[3]}
    grid = [base]
    sweeps = (("hidden", cli.widths), ("layers", cli.depths), ("length", cli.lengths), ("batch", cli.batches))
    for key, values in sweeps:
        grid += [{**base, key: v, "sweep": key} for v in values if v != base[key]]
    # num_iterations=2: TRL runs its own no-grad pass, as with vLLM importance-sampling correction
    # (the GPU recipes), and POISE's features ride on it instead of a pass of their own.
    grid += [{**base, "hidden": h, "sweep": "ride_along", "num_iterations": 2} for h in cli.ride_along_widths]
    rows = []
    for point in grid:
        model_dir = build_model_dir(workdir / "models", point["hidden"], point["layers"])
        runs = {algo: step_point(algo, model_dir, point["hidden"], point["batch"], point["length"], cli.steps,
                                 workdir / "runs", point.get("num_iterations", 1)) for algo in ("grpo", "poise")}
        grpo, poise = runs["grpo"], runs["poise"]
        row = {**point, "sweep": point.get("sweep", "base"), "num_iterations": point.get("num_iterations", 1),
               "grpo": grpo, "poise": poise,
               "ratio_poise_over_grpo": poise["step_cpu_seconds"] / grpo["step_cpu_seconds"],
               "ratio_wall_poise_over_grpo": poise["step_wall_seconds"] / grpo["step_wall_seconds"],
               "extra_fraction_of_grpo_step": {k: v / grpo["step_cpu_seconds"]
                                               for k, v in poise["extra_cpu_seconds"].items()},
               "feature_memory_ok": not poise["large_live_tensors_after_feature_pass"]}
        rows.append(row)
        print(f"  step h{point['hidden']} l{point['layers']} len{point['length']} b{point['batch']} "
              f"it{row['num_iterations']}: "
              f"CPU s/step GRPO {grpo['step_cpu_seconds']:.2f} POISE {poise['step_cpu_seconds']:.2f} ratio "
              f"{row['ratio_poise_over_grpo']:.3f} (wall {row['ratio_wall_poise_over_grpo']:.3f}); extra "
              + ", ".join(f"{k} {v:.3f}s" for k, v in poise["extra_cpu_seconds"].items())
              + f"; peak RSS +{grpo['peak_rss_increase_mb']:.0f} / +{poise['peak_rss_increase_mb']:.0f} MB; "
              f"big tensors alive: {poise['large_live_tensors_after_feature_pass'] or 'none'}", flush=True)
    return rows


# ------------------------------------------------------------------------------------------ (c)


def toy_variance_reduction(steps: int, workdir: Path) -> dict:
    import poise_trl.probe.estimator as probe_module
    from poise_trl.core import estimators
    from poise_trl.run.build import build_run
    from poise_trl.run.recipe import load_recipe

    recipe = {**load_recipe("recipes/toy/poise.yaml"), "max_steps": steps, "save_strategy": "no", **MINIMAL_EVAL}
    trainer = build_run(recipe, str(workdir / "toy_vr"), overwrite=True).trainer
    fast = trainer.value_estimator
    shadow = ProbeEstimator(**{**fast.config, "fit_method": "exact"})
    rows, predicted = [], {}
    fast_predict, fast_update = fast.predict, fast.update

    def predict(features, domains=None):
        predicted["fast"] = fast_predict(features, domains)
        return predicted["fast"]

    def update(features, rewards, group_size, domains=None):
        exact_pred, available = shadow.predict(features, domains)
        if available.all():
            row = {"step": shadow.steps_seen + 1}
            for name, pred in (("fast", predicted["fast"][0]), ("exact", exact_pred)):
                _, baselines = estimators.cross_rollout_advantages(rewards, pred, group_size)
                row[f"variance_reduction_{name}"] = estimators.variance_reduction_ratio(rewards, baselines)
            row["mean_abs_prediction_gap"] = float((predicted["fast"][0] - exact_pred).abs().mean())
            rows.append(row)
        shadow.update(features, rewards, group_size, domains)
        return fast_update(features, rewards, group_size, domains)

    fast.predict, fast.update = predict, update
    saved, probe_module.EXACT_PCA_MAX_DIM = probe_module.EXACT_PCA_MAX_DIM, 0
    try:
        trainer.train()
    finally:
        probe_module.EXACT_PCA_MAX_DIM = saved
    mean = {key: statistics.mean(r[key] for r in rows) for key in rows[0] if key != "step"}
    print(f"  toy POISE, {len(rows)} probe steps: variance reduction fast {mean['variance_reduction_fast']:.3f} "
          f"vs exact shadow {mean['variance_reduction_exact']:.3f}; mean |gap| {mean['mean_abs_prediction_gap']:.4f}",
          flush=True)
    return {"recipe": "recipes/toy/poise.yaml", "max_steps": steps, "mean_over_probe_steps": mean, "per_step": rows}


# ------------------------------------------------------------------------------------------ plot


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    points = payload["fit"]["points"]
    panels = ((axes[0], "rows", "hidden", REFERENCE[1]), (axes[1], "hidden", "rows", REFERENCE[0]))
    for ax, axis, fixed_key, fixed in panels:
        for device, threads in sorted({(p["device"], p["threads"]) for p in points}):
            sel = sorted((p for p in points
                          if p[fixed_key] == fixed and (p["device"], p["threads"]) == (device, threads)),
                         key=lambda p: p[axis])
            label = f"{device} {threads} thr"
            ax.plot([p[axis] for p in sel], [p["fast_seconds"] for p in sel], "o-", label=f"fast, {label}")
            exact = [p for p in sel if "exact_seconds" in p]
            ax.plot([p[axis] for p in exact], [p["exact_seconds"] for p in exact], "s--", label=f"exact, {label}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set(xscale="log", yscale="log", xlabel=f"buffer {axis}" if axis == "rows" else "hidden size",
               ylabel="probe fit seconds (wall)", title=f"probe fit, {fixed_key} {fixed}")
        ticks = sorted({p[axis] for p in points if p[fixed_key] == fixed})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.legend(fontsize=7)
    steps = payload["steps"]
    labels = [f"{r['sweep']}\nh{r['hidden']} l{r['layers']}\nlen{r['length']} b{r['batch']}\nit{r['num_iterations']}"
              for r in steps]
    x = range(len(steps))
    bottom = [1.0] * len(steps)
    for name in ("feature_pass", "probe_predict", "probe_update", "rest_of_advantage_work"):
        fractions = [r["extra_fraction_of_grpo_step"] for r in steps]
        heights = [f["all_advantage_work"] - f["feature_pass"] - f["probe_predict"] - f["probe_update"]
                   if name == "rest_of_advantage_work" else f[name] for f in fractions]
        axes[2].bar(x, heights, bottom=bottom, label=f"+ {name}")
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    axes[2].plot(x, [r["ratio_poise_over_grpo"] for r in steps], "k*", ms=10, label="measured POISE / GRPO (CPU s)")
    axes[2].axhline(1.05, color="grey", lw=0.8)
    axes[2].set_xticks(list(x), labels, fontsize=6)
    ratios = [r["ratio_poise_over_grpo"] for r in steps]
    axes[2].set(ylim=(min(ratios + [0.95]) - 0.03, max(bottom + ratios) + 0.03), ylabel="step CPU time / GRPO's",
                title="POISE vs GRPO step (bars: measured extra work)")
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1024, 4096, 16384], help="buffer rows at hidden 2560")
    parser.add_argument("--hidden", type=int, nargs="+", default=[256, 1024, 2560, 5120], help="hidden at 4096 rows")
    parser.add_argument("--exact-max-rows-d2", type=float, default=4096 * 2560**2,
                        help="run the exact fit only where rows x hidden^2 is at most this (default: the reference)")
    parser.add_argument("--base", type=int, nargs=4, default=[128, 4, 64, 16],
                        metavar=("HIDDEN", "LAYERS", "LEN", "BATCH"))
    parser.add_argument("--widths", type=int, nargs="*", default=[256, 512])
    parser.add_argument("--depths", type=int, nargs="*", default=[8])
    parser.add_argument("--lengths", type=int, nargs="*", default=[256])
    parser.add_argument("--batches", type=int, nargs="*", default=[32])
    parser.add_argument("--ride-along-widths", type=int, nargs="*", default=[128, 512],
                        help="base point with num_iterations=2 (TRL's own no-grad pass carries the features)")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps per run; the first is not timed "
                        "(keep steps - 1 even for the num_iterations=2 points)")
    parser.add_argument("--step-threads", type=int, default=1,
                        help="torch threads for (b): on a shared machine one thread gives steadier times")
    parser.add_argument("--toy-steps", type=int, default=16, help="(c): length of the toy POISE run")
    parser.add_argument("--skip-fit", action="store_true")
    parser.add_argument("--skip-steps", action="store_true")
    parser.add_argument("--skip-toy", action="store_true")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, to check the script runs")
    parser.add_argument("--replot", action="store_true", help="only redraw the PNG from an existing --output")
    parser.add_argument("--output", default="benchmarks/results/poise_scale.json")
    parser.add_argument("--workdir", default="runs/bench_poise_scale")
    cli = parser.parse_args()
    if cli.replot:
        plot(json.loads(Path(cli.output).read_text()), Path(cli.output).with_suffix(".png"))
        return
    if cli.quick:
        cli.rows, cli.hidden, cli.exact_max_rows_d2 = [1024], [640], 1024 * 640**2
        cli.base, cli.widths, cli.depths, cli.lengths, cli.batches, cli.steps = [64, 2, 32, 8], [], [], [], [], 3
        cli.ride_along_widths = [64]
        cli.toy_steps = 6
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    payload = {"settings": {k: v for k, v in vars(cli).items() if k not in ("output", "workdir")}}
    if not cli.skip_fit:
        print("(a) probe fit", flush=True)
        payload["fit"] = fit_sweep(cli)
    if not cli.skip_steps:
        print("(b) POISE vs GRPO step", flush=True)
        torch.set_num_threads(cli.step_threads)
        payload["steps"] = step_sweep(cli, Path(cli.workdir))
        payload["max_ratio_poise_over_grpo"] = max(r["ratio_poise_over_grpo"] for r in payload["steps"])
    if not cli.skip_toy:
        print("(c) toy POISE run: online variance reduction, fast fit vs exact shadow", flush=True)
        torch.set_num_threads(1)
        payload["toy_variance_reduction"] = toy_variance_reduction(cli.toy_steps, Path(cli.workdir))
    payload["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {os.cpu_count()} cores"
    payload["versions"] = package_versions()
    out = write_json(cli.output, payload)
    print(f"wrote {out}")
    if "fit" in payload and "steps" in payload:
        plot(payload, out.with_suffix(".png"))
        print(f"wrote {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
