"""`poise bench`'s files for other eval tools: `results_lighteval.json` (lighteval's results layout) and the
per-sample fields of `samples.jsonl`, on the bundled tiny model sampling three toy problems for real.

lighteval only writes its results file (it ships no reader for it), so the layout is checked against its
documentation and the code that writes it:
https://github.com/huggingface/lighteval/blob/main/docs/source/saving-and-reading-results.mdx (the file's
sections, `<task>|<few-shot>` keys, `<metric>_stderr` beside each metric, `all`),
https://github.com/huggingface/lighteval/blob/main/src/lighteval/metrics/utils/metric_utils.py
(`Metric.__call__`: a parametrized metric is named `<metric>:<param>=<value>&...`, e.g. `pass@k:k=1&n=16`) and
https://github.com/huggingface/lighteval/blob/main/src/lighteval/logging/info_loggers.py (`MetricsLogger`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_bench import PROBLEMS, read_records, run

from poise_trl.evaluation import bench_reports, bench_scores

N, BUDGET = 4, 32  # at this budget the bundled model ends some responses and runs out of tokens on others
SAMPLE_FIELDS = {"problem": int, "sample": int, "text": str, "answer": (str, type(None)), "gold": str,
                 "reward": float, "correct": bool, "finish_reason": str, "truncated": bool, "num_tokens": int}
LIGHTEVAL_SECTIONS = {"config_general", "results", "versions", "config_tasks"}


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory, bundled_model_dir) -> tuple[Path, Path]:
    """One finished bench run (its output folder) and the data file it ran on."""
    folder = tmp_path_factory.mktemp("bench-files")
    data = folder / "toy.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in PROBLEMS))
    run(folder / "out", bundled_model_dir, data, num_samples=N, max_new_tokens=BUDGET, batch_size=N,
        engine="transformers")
    return folder / "out", data


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def test_lighteval_results_hold_the_summarys_scores_in_its_layout(toy_run):
    out, _ = toy_run
    summary, results = read_json(out / "summary.json"), read_json(out / "results_lighteval.json")
    assert set(results) == LIGHTEVAL_SECTIONS
    assert set(results["results"]) == {"toy-arith|0", "all"}
    assert results["versions"] == {"toy-arith|0": 0} and set(results["config_tasks"]) == {"toy-arith|0"}

    names = {"avg": "avg@n:n=4", "maj": "maj@n:n=4", "pass@1": "pass@k:k=1&n=4", "pass@2": "pass@k:k=2&n=4",
             "pass@4": "pass@k:k=4&n=4"}
    for task, scores in (("toy-arith|0", summary["benchmarks"]["toy-arith"]["metrics"]["scores"]),
                         ("all", summary["average"]["scores"])):
        entry = results["results"][task]
        assert set(entry) == set(names.values()) | {f"{name}_stderr" for name in names.values()}
        for score, name in names.items():
            assert entry[name] == scores[score]["value"]
            assert entry[f"{name}_stderr"] == scores[score]["stderr"]
    for name in names.values():  # `<metric>:<param>=<value>&...`, every parameter given, n among them
        metric, params = name.split(":")
        assert metric in ("avg@n", "maj@n", "pass@k")
        assert dict(p.split("=") for p in params.split("&"))["n"] == "4"
    assert 0 < summary["benchmarks"]["toy-arith"]["metrics"]["scores"]["avg"]["value"] < 1  # not 0 == 0

    config = results["config_tasks"]["toy-arith|0"]
    assert config["name"] == "toy-arith" and config["generation_size"] == BUDGET
    assert config["num_samples"] == [N]
    assert config["effective_num_docs"] == len(PROBLEMS)
    assert [m["metric_name"] for m in config["metrics"]] == list(names.values())
    general = results["config_general"]
    assert general["model_name"] == summary["model"]
    assert general["model_config"]["generation_parameters"] == {"temperature": 1.0, "top_p": 1.0, "seed": 0}


def test_samples_file_has_every_field_and_adds_up_to_the_scores(toy_run):
    out, _ = toy_run
    records = read_records(out / "toy-arith" / "samples.jsonl")
    scores = read_json(out / "summary.json")["benchmarks"]["toy-arith"]["metrics"]["scores"]
    assert sorted((r["problem"], r["sample"]) for r in records) == [(i, j) for i in range(len(PROBLEMS))
                                                                     for j in range(N)]
    for record in records:
        assert set(record) == set(SAMPLE_FIELDS)
        for field, kind in SAMPLE_FIELDS.items():
            assert isinstance(record[field], kind), (field, record)
        assert record["gold"] == PROBLEMS[record["problem"]][1]
        assert record["correct"] == (record["reward"] == 1.0)
        assert record["truncated"] == (record["finish_reason"] == "length")
        if record["finish_reason"] == "length":
            assert record["num_tokens"] == BUDGET
        if record["correct"]:
            assert record["answer"] == record["gold"]
    assert {r["finish_reason"] for r in records} == {"stop", "length"}

    by_problem = [[r for r in records if r["problem"] == i] for i in range(len(PROBLEMS))]
    avg = sum(sum(r["reward"] for r in rs) / N for rs in by_problem) / len(PROBLEMS)
    assert avg == pytest.approx(scores["avg"]["value"])
    solved = sum(any(r["correct"] for r in rs) for rs in by_problem) / len(PROBLEMS)
    assert solved == pytest.approx(scores[f"pass@{N}"]["value"])


def test_a_mix_lists_its_tasks_as_lighteval_subtasks():
    def metrics(avg, maj=None, by_task=None):
        scores = {"avg": {"value": avg, "stderr": 0.1}, "pass@1": {"value": avg, "stderr": 0.1},
                  **({"maj": {"value": maj, "stderr": 0.2}} if maj is not None else {})}
        return {"num_problems": 10, "num_samples": 1, "scores": scores, "mean_tokens": 5.0,
                "truncated_fraction": 0.0, **({"by_task": by_task} if by_task else {})}

    settings = {"num_samples": 1, "data_source": "x", "split": "test", "max_new_tokens": 64,
                "temperature": 0.6, "top_p": 0.95, "seed": 0, "limit": None}
    mix = metrics(0.5, by_task={"humaneval": metrics(0.4), "ifeval": metrics(0.6)})
    benchmarks = {"mix": {"settings": settings, "metrics": mix},
                  "math": {"settings": settings, "metrics": metrics(0.3, maj=0.4)}}
    summary = {"model": "m", "benchmarks": benchmarks,
               "average": bench_scores.average_over_benchmarks([b["metrics"] for b in benchmarks.values()])}
    results = bench_reports.lighteval_results(summary)["results"]
    assert set(results) == {"mix|0", "mix:humaneval|0", "mix:ifeval|0", "math|0", "all"}
    assert results["mix:ifeval|0"]["avg@n:n=1"] == 0.6
    assert "maj@n:n=1" in results["math|0"] and "maj@n:n=1_stderr" in results["math|0"]
    assert set(results["all"]) == {"avg@n:n=1", "avg@n:n=1_stderr", "pass@k:k=1&n=1", "pass@k:k=1&n=1_stderr"}
    assert results["all"]["avg@n:n=1"] == pytest.approx(0.4)
