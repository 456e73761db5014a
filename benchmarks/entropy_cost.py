"""What one decode step's token entropies cost POISE on a CPU: `features.token_entropy` as it runs (one exp pass,
one chunk for a decode step) against the textbook log_softmax form (two exp passes) and against itself one
row at a time (chunks that fit a core's cache), on 16 rows of next-token logits, at the toy's and at Qwen3's
vocabulary.

    python benchmarks/entropy_cost.py [--rows 16] [--repeats 200] [--trials 5]
        [--output benchmarks/results/entropy_cost.json]

The three are timed in turns (a round runs each once, in a rotated order), one torch thread, on the same
logits; each trial's median over its rounds is reported (this CPU's load moves them from trial to trial),
with the largest difference from a float64 reference.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from step_cost import new_artefact, write_artefact

from poise_trl.probe import features

VOCABULARIES = {"toy": 104, "qwen3": 151936}


def log_softmax_entropy(logits: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits, dim=-1)
    return (logp.exp() * logp).sum(-1).neg()


def row_by_row_entropy(logits: torch.Tensor) -> torch.Tensor:
    return torch.cat([features.token_entropy(row) for row in logits.split(1)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=200, help="rounds in a trial")
    parser.add_argument("--trials", type=int, default=5, help="trials, each with its own median")
    parser.add_argument("--output", default="benchmarks/results/entropy_cost.json")
    cli = parser.parse_args()
    torch.set_num_threads(1)
    _, payload = new_artefact("entropy_cost.py", ["cpu"], ["cpu"])
    payload["vocabularies"] = {}
    ways = {"token_entropy": features.token_entropy, "row_by_row": row_by_row_entropy,
            "log_softmax": log_softmax_entropy}
    for name, vocabulary in VOCABULARIES.items():
        logits = torch.randn(cli.rows, vocabulary, generator=torch.Generator().manual_seed(0)) * 3
        reference = log_softmax_entropy(logits.double())
        trials = []
        for _ in range(cli.trials):
            seconds = {way: [] for way in ways}
            for round_index in range(cli.repeats):
                order = list(ways)[round_index % 3:] + list(ways)[:round_index % 3]
                for way in order:
                    started = time.perf_counter()
                    ways[way](logits)
                    seconds[way].append(time.perf_counter() - started)
            trials.append({way: round(statistics.median(times) * 1e3, 4) for way, times in seconds.items()})
        payload["vocabularies"][name] = {
            "vocabulary": vocabulary, "rows": cli.rows, "median_ms_per_trial": trials,
            "log_softmax_over_token_entropy": [round(t["log_softmax"] / t["token_entropy"], 2) for t in trials],
            "row_by_row_over_token_entropy": [round(t["row_by_row"] / t["token_entropy"], 2) for t in trials],
            "max_abs_error_nats": {way: float((ways[way](logits).double() - reference).abs().max())
                                   for way in ways},
        }
        print(f"{name}: {payload['vocabularies'][name]}", flush=True)
    write_artefact(payload, cli.output)


if __name__ == "__main__":
    main()
