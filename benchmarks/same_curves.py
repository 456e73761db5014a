"""Whether two finished runs computed the same thing: their summary.json compared field by field, with
the clocks and the output paths left out. Used to show that a code change kept behaviour: run a recipe
on both versions of the code with the same seed, then

    python benchmarks/same_curves.py RUN_A RUN_B [RUN_A2 RUN_B2 ...] --output benchmarks/results/X.json

Exit status 0 when every pair is identical, 1 otherwise (the first differences are printed)."""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

# Time measurements and where the run was written: they differ between any two runs.
CLOCK_KEYS = {"wall_clock_seconds", "train_seconds", "step_time", "train_runtime", "train_samples_per_second",
              "train_steps_per_second", "seconds", "stage1_seconds"}
PATH_KEYS = {"output_dir", "logging_dir"}


def comparable(value, left_out: frozenset = frozenset()):
    """`value` without the clocks, the paths and the keys in `left_out`, at any depth."""
    if isinstance(value, dict):  # a logged clock may carry its trainer's prefix (a2po/stage1_seconds)
        return {k: comparable(v, left_out) for k, v in value.items()
                if k.rsplit("/", 1)[-1] not in CLOCK_KEYS and k not in PATH_KEYS | left_out}
    if isinstance(value, list):
        return [comparable(v, left_out) for v in value]
    return value


def has_key(value, key: str) -> bool:
    if isinstance(value, dict):
        return key in value or any(has_key(v, key) for v in value.values())
    return isinstance(value, list) and any(has_key(v, key) for v in value)


def differences(a, b, where: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        found = []
        for key in sorted(a.keys() | b.keys()):
            found += differences(a.get(key), b.get(key), f"{where}.{key}" if where else key)
        return found
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="pairs of run folders: A1 B1 A2 B2 ...")
    parser.add_argument("--output", help="JSON report to write")
    parser.add_argument("--note", default="", help="what A and B are (code versions, machine)")
    parser.add_argument("--added", action="append", default=[], metavar="KEY",
                        help="a summary field the later version added: left out of B at any depth where A lacks it "
                             "(a pair whose A has it compares it), and listed per pair")
    cli = parser.parse_args()
    if len(cli.runs) % 2:
        parser.error("give run folders in pairs")
    pairs = []
    for a, b in zip(cli.runs[::2], cli.runs[1::2], strict=True):
        sa, sb = (json.loads((Path(p) / "summary.json").read_text()) for p in (a, b))
        added = sorted(key for key in cli.added if not has_key(sa, key))
        found = differences(comparable(sa), comparable(sb, frozenset(added)))
        pairs.append({"a": Path(a).name, "b": Path(b).name, "algo": sa.get("algo"), "identical": not found,
                      "added_in_b": added,
                      "steps": sa.get("steps"), "heldout_accuracy": [p["accuracy"] for p in sa["heldout_history"]],
                      "train_log_entries": len(sa["train_log"]), "differences": found[:20]})
        print(f"{a} vs {b}: {'identical' if not found else f'{len(found)} differences, e.g. {found[:3]}'}")
    if cli.output:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).resolve().parents[1]).stdout.strip()
        report = {"command": "python benchmarks/same_curves.py " + " ".join(sys.argv[1:]), "note": cli.note,
                  "left_out": sorted(CLOCK_KEYS | PATH_KEYS), "added_in_b": cli.added, "head_when_compared": commit,
                  "machine": f"{platform.machine()}, {platform.python_version()}", "pairs": pairs}
        Path(cli.output).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if all(p["identical"] for p in pairs) else 1


if __name__ == "__main__":
    sys.exit(main())
