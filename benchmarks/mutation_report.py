"""Mutation testing of the core math: how many small code changes (mutants) the fast unit tests catch.

mutmut 3 rewrites each function below in many small ways (an operator, a constant, an argument, a
return value) and runs the tests that reach that function against each mutant: a mutant the tests
still pass is "survived". The kill rate is the share of mutants some test fails on. Scope: every
function of `poise_trl/core/estimators.py` (advantages, baselines, leave-one-out, cross-rollout pairing,
GAE, AsyPPO's masks, KL), the POISE probe's fit / predict / buffer / online update, the POISE and
AsyPPO trainers' `compute_advantages`, and the final-answer extraction the math reward grades.

mutmut runs in a scratch copy of the working tree (`build/mutation/`, ignored by git), whose
pyproject.toml gets the `[tool.mutmut]` table: nothing in the repository's own pytest or packaging
setup changes, and mutmut's `mutants/` folder never lands in the checkout. Only the unit tests in
`TESTS` run, never the trainer or vLLM suites.

    python benchmarks/mutation_report.py [--max-children 2] [--output benchmarks/results/mutation_report.json]
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections import Counter
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
SCRATCH = REPO / "build" / "mutation"
MACHINE_NOTE = "2-core CPU, no GPU"

# mutmut names a mutant `<module>.x_<function>__mutmut_<n>`, or `<module>.xǁ<Class>ǁ<method>__mutmut_<n>`.
FUNCTIONS = {
    "poise_trl/core/estimators.py": ["poise_trl.core.estimators.x*"],
    "poise_trl/probe/estimator.py": [
        "poise_trl.probe.estimator.x__orient_and_trim__*",
        "poise_trl.probe.estimator.x__fit_pca__*",
        "poise_trl.probe.estimator.x__fit_pca_fast__*",
        "poise_trl.probe.estimator.xǁLinearValueProbeǁ_inputs__*",
        "poise_trl.probe.estimator.xǁLinearValueProbeǁfit__*",
        "poise_trl.probe.estimator.xǁLinearValueProbeǁpredict__*",
        "poise_trl.probe.estimator.xǁGroupBufferǁappend__*",
        "poise_trl.probe.estimator.xǁProbeEstimatorǁ_predict_with__*",
        "poise_trl.probe.estimator.xǁProbeEstimatorǁupdate__*",
        "poise_trl.probe.estimator.xǁProbeEstimatorǁupdate_from_targets__*",
    ],
    "poise_trl/algorithms/poise.py": ["poise_trl.algorithms.poise.xǁPOISEProbeǁcompute_advantages__*"],
    "poise_trl/algorithms/asyppo.py": ["poise_trl.algorithms.asyppo.xǁAsyPPOTrainerǁcompute_advantages__*"],
    "poise_trl/tasks/math_grader.py": [
        "poise_trl.tasks.math_grader.x__closing_brace__*",
        "poise_trl.tasks.math_grader.x__boxed_spans__*",
        "poise_trl.tasks.math_grader.x_all_boxed__*",
        "poise_trl.tasks.math_grader.x__final_boxes__*",
        "poise_trl.tasks.math_grader.x_last_boxed__*",
        "poise_trl.tasks.math_grader.x_extract_final_answer__*",
    ],
    "poise_trl/tasks/__init__.py": [
        "poise_trl.tasks.x_answer_part__*",
        "poise_trl.tasks.x_extract_tagged_answer__*",
    ],
}
TESTS = [
    "tests/test_estimators.py",
    "tests/test_probe.py",
    # the randomized PCA's own tests, without the two that build a model (tens of seconds each)
    "tests/test_probe_scale.py::test_fast_fit_tracks_exact_on_a_sliding_buffer",
    "tests/test_probe_scale.py::test_fast_pca_recovers_the_strong_directions",
    "tests/test_probe_scale.py::test_fast_pca_contract_on_degenerate_inputs",
    "tests/test_probe_scale.py::test_fast_fit_deterministic_for_inputs_and_state",
    "tests/test_probe_scale.py::test_prompt_only_probe_reusing_the_main_probes_prompt_pca_fits_identically",
    "tests/test_probe_scale.py::test_estimator_resume_round_trip_with_fast_fit",
    "tests/test_mutation_kills.py",
    "tests/test_rewards.py::test_extract_final_answer",
    "tests/test_rewards.py::test_last_boxed_is_balanced",
    "tests/test_rewards.py::test_all_boxed",
]

# Survivors that no test can kill: the mutant computes the same thing as the original on every input
# the function accepts. Checked by hand against `mutmut show NAME` (the diff is copied into the report).
# mutmut numbers mutants in source order, so an edit to a function renumbers its mutants: the report lists
# entries here that no longer survive, and every survivor not here with its diff, to re-check by hand.
_PROMOTES = "the integer/float32 operand is promoted to the other operand's dtype by the next operation: same values"
_NAN = 'float("NAN") is float("nan")'
EQUIVALENT: dict[str, str] = {
    "poise_trl.core.estimators.x_masked_mean__mutmut_12": _PROMOTES,
    "poise_trl.core.estimators.x_reinforce_pp_global_advantages__mutmut_5":
        "masked_whiten reads mask.bool(): a float mask of ones is the all-true mask",
    "poise_trl.core.estimators.x_reinforce_pp_global_advantages__mutmut_7":
        "as mutmut_5: ones_like without a dtype is a float mask of ones, read as mask.bool()",
    "poise_trl.core.estimators.x__disagreement_cut__mutmut_22":
        "with k = 0 the sort runs but order[:0] selects nothing",
    "poise_trl.core.estimators.x_high_disagreement_mask__mutmut_4":
        "lowest=None: `not None` is True, as `not False` is",
    "poise_trl.core.estimators.x_filtered_entropy_bonus__mutmut_14": _PROMOTES,
    "poise_trl.core.estimators.x_cross_fit_values__mutmut_58": 'float("INF") is float("inf")',
    "poise_trl.core.estimators.x_explained_variance__mutmut_5": "only differs with no valid position, where the "
        "variance of the empty selection is nan and the result is nan either way",
    "poise_trl.core.estimators.x_explained_variance__mutmut_9":
        "as mutmut_5: with no valid position 1 - nan / 1 is nan too",
    "poise_trl.core.estimators.x_explained_variance__mutmut_14": _NAN,
    "poise_trl.core.estimators.x_sign_agreement__mutmut_12": _NAN,
    "poise_trl.probe.estimator.x__orient_and_trim__mutmut_23": "dividing by a sign of +-1 is multiplying by it",
    "poise_trl.probe.estimator.x__orient_and_trim__mutmut_24":
        "the +-1.0 factors are exact in float32; the product is promoted to the components' float64",
    "poise_trl.probe.estimator.x__orient_and_trim__mutmut_36":
        "the pivot is the largest |loading| of a unit eigenvector, never 0, so < 0 and <= 0 agree",
    "poise_trl.probe.estimator.xǁLinearValueProbeǁ_inputs__mutmut_3": "RolloutFeatures are float32; subtracting the "
        "float64 mean (or torch.cat with float64 columns) promotes them exactly",
    "poise_trl.probe.estimator.xǁLinearValueProbeǁ_inputs__mutmut_16":
        "as _inputs mutmut_3: torch.cat promotes float32 entropies to float64 exactly",
    "poise_trl.probe.estimator.xǁLinearValueProbeǁfit__mutmut_51":
        "as _inputs mutmut_3: torch.cat promotes the float32 columns to float64 exactly",
    "poise_trl.probe.estimator.xǁLinearValueProbeǁfit__mutmut_90":
        "as _inputs mutmut_3: torch.cat promotes the float32 entropies to float64 exactly",
    "poise_trl.probe.estimator.xǁLinearValueProbeǁfit__mutmut_146":
        "standardized columns sum to 0, so X^T (y + mean y) = X^T (y - mean y) = X^T y (up to rounding)",
    "poise_trl.probe.estimator.xǁGroupBufferǁappend__mutmut_35":
        "with excess == 0 the first group boundary at or after 0 is row 0: nothing is cut",
    "poise_trl.probe.estimator.xǁGroupBufferǁappend__mutmut_39":
        "a float `starts` vector has the same nonzero positions as the bool one",
    "poise_trl.probe.estimator.xǁGroupBufferǁappend__mutmut_41": "as mutmut_39",
    "poise_trl.probe.estimator.xǁProbeEstimatorǁ_predict_with__mutmut_8": _NAN,
    "poise_trl.probe.estimator.x__fit_pca_fast__mutmut_16":
        "k above the row count: w[:, :k] is capped at width <= rows anyway",
    "poise_trl.probe.estimator.x__fit_pca_fast__mutmut_17":
        "k above the width: w[:, :k] is capped at width <= d anyway",
    "poise_trl.probe.estimator.x__fit_pca_fast__mutmut_46":
        "omega[:, :m] = warm.T casts the start vectors into omega's float64",
    "poise_trl.probe.estimator.x__fit_pca_fast__mutmut_48": "as mutmut_46",
    "poise_trl.probe.estimator.xǁProbeEstimatorǁupdate_from_targets__mutmut_74":
        "the prompt-only probe would compute the identical PCA itself (same rows, components, method and warm "
        "start): handing it over only saves the time",
    "poise_trl.probe.estimator.xǁProbeEstimatorǁupdate_from_targets__mutmut_77": "as mutmut_74",
    "poise_trl.algorithms.asyppo.xǁAsyPPOTrainerǁcompute_advantages__mutmut_58":
        "the per-token KL passed is all zeros (no KL in AsyPPO's reward), so any kl_coef adds -0.0",
    "poise_trl.tasks.math_grader.x__boxed_spans__mutmut_19": "searching on from the last content character instead "
        "of after the closing brace finds the same next box: no `\\boxed{` can start at a `}`",
}
# Survivors equivalent on a CPU-only machine: `device=None` (or a dropped device argument) is the CPU, where
# every tensor here lives. They are counted as survivors; a run of the tests on a CUDA device would kill them.
_DEVICE = "device argument: the CPU either way on a CPU-only machine"
CPU_ONLY = dict.fromkeys([
    "poise_trl.core.estimators.x__sibling_mean__mutmut_11",
    "poise_trl.core.estimators.x__sibling_mean__mutmut_13",
    "poise_trl.core.estimators.x_kl_penalized_token_rewards__mutmut_23",
    "poise_trl.core.estimators.x_kl_penalized_token_rewards__mutmut_25",
    "poise_trl.core.estimators.x_gae_advantages__mutmut_24",
    "poise_trl.core.estimators.x_gae_advantages__mutmut_26",
    "poise_trl.core.estimators.x__disagreement_cut__mutmut_18",
    "poise_trl.core.estimators.x__disagreement_cut__mutmut_21",
    "poise_trl.probe.estimator.xǁLinearValueProbeǁfit__mutmut_2",
    "poise_trl.probe.estimator.xǁLinearValueProbeǁfit__mutmut_4",
    "poise_trl.probe.estimator.xǁLinearValueProbeǁfit__mutmut_44",
    "poise_trl.probe.estimator.xǁGroupBufferǁappend__mutmut_25",
    "poise_trl.probe.estimator.xǁGroupBufferǁappend__mutmut_27",
    "poise_trl.probe.estimator.xǁProbeEstimatorǁupdate__mutmut_6",
    "poise_trl.probe.estimator.xǁProbeEstimatorǁupdate__mutmut_8",
    "poise_trl.probe.estimator.x__fit_pca_fast__mutmut_27",
    "poise_trl.probe.estimator.x__fit_pca_fast__mutmut_32",
    "poise_trl.probe.estimator.x__fit_pca_fast__mutmut_37",
    "poise_trl.probe.estimator.x__fit_pca_fast__mutmut_45",
    "poise_trl.probe.estimator.x__fit_pca_fast__mutmut_47",
    "poise_trl.algorithms.poise.xǁPOISEProbeǁcompute_advantages__mutmut_5",
    "poise_trl.algorithms.poise.xǁPOISEProbeǁcompute_advantages__mutmut_7",
    "poise_trl.algorithms.poise.xǁPOISEProbeǁcompute_advantages__mutmut_88",
    "poise_trl.algorithms.asyppo.xǁAsyPPOTrainerǁcompute_advantages__mutmut_89",
    "poise_trl.algorithms.asyppo.xǁAsyPPOTrainerǁcompute_advantages__mutmut_134",
], _DEVICE)

DETECTED = ("killed", "timeout", "segfault", "caught by type checker")


def mutmut(*args: str, cwd: Path) -> str:
    result = subprocess.run([sys.executable, "-m", "mutmut", *args], cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"mutmut {' '.join(args)} failed ({result.returncode}):\n{result.stdout[-3000:]}"
                           f"\n{result.stderr[-3000:]}")
    return result.stdout


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()


def mutmut_table() -> str:
    """`[tool.mutmut]` for the scratch copy's pyproject.toml."""
    def toml_list(items):
        return "[" + ", ".join(json.dumps(item) for item in items) + "]"

    return (
        "\n[tool.mutmut]\n"
        'source_paths = ["poise_trl/"]\n'
        f"only_mutate = {toml_list(FUNCTIONS)}\n"
        f"pytest_add_cli_args_test_selection = {toml_list(TESTS)}\n"
        'pytest_add_cli_args = ["-p", "no:cacheprovider"]\n'
        # The scratch copy sits inside the repository's work tree: git would describe that one.
        "use_git_change_detection = false\n"
    )


def prepare_scratch() -> None:
    """A fresh copy of what the tests need: mutmut skips source files already present in mutants/."""
    if SCRATCH.exists():
        shutil.rmtree(SCRATCH)
    SCRATCH.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ("poise_trl", "tests"):
        shutil.copytree(REPO / folder, SCRATCH / folder, ignore=ignore)
    pyproject = (REPO / "pyproject.toml").read_text()
    if "[tool.mutmut]" in pyproject:
        raise SystemExit("pyproject.toml has its own [tool.mutmut]: merge it into mutmut_table() here")
    (SCRATCH / "pyproject.toml").write_text(pyproject + mutmut_table())


def parse_results(text: str) -> dict[str, str]:
    """`mutmut results --all true` lines `    NAME: STATUS` -> {NAME: STATUS}."""
    statuses = {}
    for line in text.splitlines():
        name, sep, status = line.strip().rpartition(": ")
        if sep and "__mutmut_" in name:
            statuses[name] = status
    return statuses


def function_of(mutant: str) -> tuple[str, str]:
    """`poise_trl.probe.estimator.xǁGroupBufferǁappend__mutmut_3` -> ("poise_trl.probe.estimator",
    "GroupBuffer.append")."""
    qualified = mutant.rsplit("__mutmut_", 1)[0]
    module, _, mangled = qualified.rpartition(".")
    if mangled.startswith("xǁ"):
        return module, mangled[2:].replace("ǁ", ".")
    return module, mangled[2:]


def rates(statuses: list[str]) -> dict:
    counts = Counter(statuses)
    total = len(statuses)
    detected = sum(counts[s] for s in DETECTED)
    return {"mutants": total, "killed": detected, "survived": counts["survived"],
            "kill_rate": round(detected / total, 4) if total else None,
            "other": {s: n for s, n in counts.items() if s not in DETECTED and s != "survived"}}


def report(statuses: dict[str, str]) -> dict:
    by_module: dict[str, list[str]] = {}
    by_function: dict[str, dict[str, list[str]]] = {}
    for name, status in sorted(statuses.items()):
        module, function = function_of(name)
        by_module.setdefault(module, []).append(status)
        by_function.setdefault(module, {}).setdefault(function, []).append(status)
    equivalent = [n for n in EQUIVALENT if statuses.get(n) == "survived"]
    cpu_only = [n for n in CPU_ONLY if statuses.get(n) == "survived"]
    overall = rates(list(statuses.values()))
    considered = overall["mutants"] - len(equivalent)
    overall["kill_rate_without_equivalent"] = round(overall["killed"] / considered, 4) if considered else None
    return {
        "overall": overall,
        "modules": {
            module: {**rates(by_module[module]),
                     "functions": {f: rates(s) for f, s in sorted(by_function[module].items())}}
            for module in sorted(by_module)
        },
        "equivalent": {n: {"reason": EQUIVALENT[n], "diff": mutmut("show", n, cwd=SCRATCH).strip()}
                       for n in equivalent},
        "cpu_only_equivalent": {n: {"reason": CPU_ONLY[n], "diff": mutmut("show", n, cwd=SCRATCH).strip()}
                                for n in cpu_only},
        "survived_other": {n: mutmut("show", n, cwd=SCRATCH).strip() for n, s in statuses.items()
                           if s == "survived" and n not in EQUIVALENT and n not in CPU_ONLY},
        "listed_but_not_survived": sorted(n for n in (*EQUIVALENT, *CPU_ONLY) if statuses.get(n) != "survived"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-children", type=int, default=2, help="parallel mutant runs (2 cores here)")
    parser.add_argument("--output", type=Path, default=RESULTS / "mutation_report.json")
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite the report from the last run's results in build/mutation (after editing "
                             "EQUIVALENT), without running mutmut again")
    args = parser.parse_args()

    globs = [glob for patterns in FUNCTIONS.values() for glob in patterns]
    if not args.report_only:
        started = time.perf_counter()
        # The copy is taken now: the code version is the one of this moment, whatever happens to HEAD meanwhile.
        code_version = {"commit": git("rev-parse", "--short", "HEAD"),
                        "uncommitted_changes": git("status", "--porcelain", "--", *FUNCTIONS,
                                                   *sorted({test.split("::")[0] for test in TESTS})).splitlines()}
        prepare_scratch()
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        mutmut("run", "--max-children", str(args.max_children), *globs, cwd=SCRATCH)
        run = {"code_version": code_version, "runtime_seconds": round(time.perf_counter() - started, 1),
               "max_children": args.max_children}
        (SCRATCH / "run.json").write_text(json.dumps(run, indent=2) + "\n")
    run_file = SCRATCH / "run.json"
    if not run_file.is_file():
        raise SystemExit(f"no finished run in {SCRATCH.relative_to(REPO)}: run without --report-only first")
    run = json.loads(run_file.read_text())
    # mutmut lists every mutant of the mutated files; the report counts those of the functions in scope.
    statuses = {name: status for name, status in parse_results(mutmut("results", "--all", "true", cwd=SCRATCH)).items()
                if any(fnmatch.fnmatchcase(name, glob) for glob in globs)}
    payload = {
        "command": "python benchmarks/mutation_report.py"
                   + (f" --max-children {run['max_children']}" if run["max_children"] != 2 else ""),
        "what": "mutmut kill rates of the core math: the share of mutants some selected unit test fails on "
                "(killed includes timeouts). `equivalent`: survivors no test can kill, with the reason; "
                "`cpu_only_equivalent`: survivors that only change a device argument (counted as survived); "
                "`survived_other`: the remaining survivors, with their diffs",
        "tests": TESTS,
        "functions": FUNCTIONS,
        **report(statuses),
        "code_version": run["code_version"],
        "mutmut_version": metadata.version("mutmut"),
        "runtime_seconds": run["runtime_seconds"],
        "max_children": run["max_children"],
        "machine": {"note": MACHINE_NOTE, "cpu_count": os.cpu_count(), "platform": platform.platform()},
        "versions": {name: metadata.version(name) for name in ("torch", "transformers", "trl")}
                    | {"python": platform.python_version()},
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n")
    print(json.dumps(payload["overall"]), f"-> {args.output}")


if __name__ == "__main__":
    main()
