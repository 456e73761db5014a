"""`poise bench`: the estimators, majority voting, grading, the resumable samples file, the refusal to mix
settings, and --compare. Pipeline tests run the untrained tiny model with a few short samples."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import typer
from helpers import assert_one_line_error
from typer.testing import CliRunner

from poise_trl.cli.bench import bench as bench_command
from poise_trl.core import metrics
from poise_trl.engines import generation
from poise_trl.engines.generation import Sample, TransformersEngine
from poise_trl.evaluation import bench, bench_data, bench_reports, bench_scores


@pytest.fixture(autouse=True)
def transformers_engine(monkeypatch):
    """Generate with transformers even where vLLM is installed: its CPU build has no attention kernel for
    the tiny test model's 8-wide heads, and the fake samplers below stand in for transformers'."""
    monkeypatch.setattr(generation, "vllm_import_error", lambda: "vLLM is switched off in these tests")


PROBLEMS = [("What is 3 plus 4?", "7"), ("Add 12 and 30.", "42"), ("What is 5 plus 9?", "14")]


@pytest.fixture
def toy_file(tmp_path) -> Path:
    path = tmp_path / "toy.jsonl"
    path.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in PROBLEMS))
    return path


def run(output_dir, model, data_file, **kwargs):
    settings = dict(num_samples=4, temperature=1.0, top_p=1.0, max_new_tokens=4, batch_size=2, show_progress=False)
    settings.update(kwargs)
    return bench.run_benchmarks(["toy-arith"], str(model), output_dir=output_dir, data_files={"toy-arith": data_file},
                                **settings)


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ------------------------------------------------------------------------------------------ estimators


@pytest.mark.parametrize("n", range(1, 7))
def test_pass_at_k_matches_enumerating_all_k_subsets(n):
    for c in range(n + 1):
        outcomes = [1] * c + [0] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(outcomes, k))
            brute = sum(any(s) for s in subsets) / len(subsets)
            assert math.isclose(metrics.pass_at_k(n, c, k), brute), (n, c, k)


def test_pass_ks_are_powers_of_two_and_n():
    assert metrics.pass_ks(32) == [1, 2, 4, 8, 16, 32]
    assert metrics.pass_ks(6) == [1, 2, 4, 6]
    assert metrics.pass_ks(1) == [1]


def test_metrics_avg_stderr_and_pass_k():
    # two problems, 4 samples: 3/4 and 1/4 correct
    records = {
        (p, s): {"problem": p, "sample": s, "correct": s < (3 if p == 0 else 1), "answer": None,
                 "num_tokens": 10, "truncated": s == 0}
        for p in range(2) for s in range(4)
    }
    metrics = bench_scores.compute_metrics(records, num_problems=2, num_samples=4)
    assert metrics["scores"]["avg"]["value"] == pytest.approx(0.5)
    assert metrics["scores"]["avg"]["stderr"] == pytest.approx(math.sqrt(((0.25**2) * 2 / 1) / 2))
    assert metrics["scores"]["pass@4"]["value"] == 1.0
    assert metrics["scores"]["pass@1"]["value"] == pytest.approx(0.5)
    assert metrics["truncated_fraction"] == 0.25 and metrics["mean_tokens"] == 10


# ------------------------------------------------------------------------------------- voting, grading


def test_vote_key_normalizes_numbers_and_latex():
    assert bench_scores.vote_key("070") == bench_scores.vote_key("70.0") == bench_scores.vote_key("70") == "70"
    assert bench_scores.vote_key("1,000") == bench_scores.vote_key("1000")
    assert bench_scores.vote_key("\\dfrac{1}{2}") == bench_scores.vote_key("\\frac {1}{2}")
    assert bench_scores.vote_key("\\text{(B)}") == "(B)"
    assert bench_scores.vote_key("90^\\circ") == "90"
    assert bench_scores.vote_key(None) is None and bench_scores.vote_key("  ") is None


def _votes(*answers, correct=()):
    return [{"sample": i, "answer": a, "correct": i in correct} for i, a in enumerate(answers)]


def test_majority_vote():
    # "070" and "70.0" are one answer: 2 votes beat 1
    assert bench_scores.majority_correct(_votes("12", "070", "70.0", correct={1, 2}))
    assert not bench_scores.majority_correct(_votes("12", "12", "70", correct={2}))
    # a tie goes to the answer voted first, whatever the order of the records
    assert bench_scores.majority_correct(list(reversed(_votes("70", "12", "12", "70", correct={0, 3}))))
    assert not bench_scores.majority_correct(_votes("12", "70", "70", "12", correct={1, 2}))
    # unboxed responses do not vote; nobody voting is wrong
    assert bench_scores.majority_correct(_votes(None, None, "70", correct={0, 1, 2}))
    assert not bench_scores.majority_correct(_votes(None, None, correct={0, 1}))


@pytest.mark.parametrize("text", ["70", "70.0", "\\boxed{070}", "<think>\n35+35\n</think>\n\\boxed{70}"])
def test_grade_accepts_equivalent_answers(text):
    assert bench_scores.grade_batch([text], [{"answer": "70"}])[0]["correct"]
    assert bench_scores.grade_batch([text], [{"answer": 70.0}])[0]["correct"]


def test_grading_path_of_a_run(tmp_path, tiny_random_model_dir, monkeypatch):
    """Responses `70`, `70.0`, `\\boxed{070}` against gold 70, through generation, grading and scoring."""
    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps({"question": "Find 35+35.", "answer": "70"}) + "\n")
    texts = ["70", "70.0", "\\boxed{070}", "\\boxed{71}"]

    def fake_sampler(engine, prompts, num_samples, on_batch, prompt_indices, **kwargs):
        batch = [Sample(prompt_indices[0], t, 3, False) for t in texts[:num_samples]]
        on_batch(batch)
        return batch

    monkeypatch.setattr(TransformersEngine, "sample", fake_sampler)
    summary = run(tmp_path / "out", tiny_random_model_dir, data, batch_size=4)
    records = read_records(tmp_path / "out" / "toy-arith" / "samples.jsonl")
    assert [r["correct"] for r in records] == [True, True, True, False]
    scores = summary["benchmarks"]["toy-arith"]["metrics"]["scores"]
    assert scores["avg"]["value"] == 0.75
    assert scores["maj"]["value"] == 1.0  # "070" vs "71": one vote each, the earlier one wins


# --------------------------------------------------------------------------------- the samples file


def test_torn_last_line_is_cut_and_corrupt_middle_line_refused(tmp_path):
    path = tmp_path / "samples.jsonl"
    good = [json.dumps({"problem": 0, "sample": s, "correct": True}) for s in range(2)]
    path.write_text("\n".join(good) + '\n{"problem": 0, "sam')
    assert set(bench.read_samples(path)) == {(0, 0), (0, 1)}
    assert path.read_text() == "\n".join(good) + "\n"

    path.write_text("\n".join(good) + "\n\x00\x00\n")  # a terminated but garbled last write
    assert len(bench.read_samples(path)) == 2 and path.read_text().endswith("}\n")

    path.write_text(good[0] + "\nnot json\n" + good[1] + "\n")
    with pytest.raises(bench_data.BenchError, match="line 2 is corrupt"):
        bench.read_samples(path)


def test_resume_after_crash_loses_nothing_and_duplicates_nothing(tmp_path, toy_file, tiny_random_model_dir,
                                                                   monkeypatch):
    fresh = run(tmp_path / "fresh", tiny_random_model_dir, toy_file)
    real_sampler = TransformersEngine.sample
    batches = {"count": 0}

    def crashing_sampler(engine, *args, on_batch, **kwargs):
        def on_batch_then_crash(batch):
            batches["count"] += 1
            if batches["count"] > 3:
                raise RuntimeError("simulated crash")
            on_batch(batch)

        return real_sampler(engine, *args, on_batch=on_batch_then_crash, **kwargs)

    monkeypatch.setattr(TransformersEngine, "sample", crashing_sampler)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(out, tiny_random_model_dir, toy_file)
    monkeypatch.setattr(TransformersEngine, "sample", real_sampler)

    samples = out / "toy-arith" / "samples.jsonl"
    lines = samples.read_text().splitlines()
    assert len(lines) == 6  # three blocks of 2 samples made it to disk
    samples.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:25])  # kill -9 in the middle of a write

    resumed = run(out, tiny_random_model_dir, toy_file)
    records = read_records(samples)
    keys = [(r["problem"], r["sample"]) for r in records]
    assert len(keys) == len(set(keys)) == len(PROBLEMS) * 4
    assert [json.dumps(r) for r in records[:5]] == [json.dumps(json.loads(line)) for line in lines[:5]]
    # seeds depend on the block, not on the history: the resumed run has the fresh run's samples
    fresh_records = read_records(tmp_path / "fresh" / "toy-arith" / "samples.jsonl")
    by_key = {(r["problem"], r["sample"]): r["text"] for r in fresh_records}
    assert {(r["problem"], r["sample"]): r["text"] for r in records} == by_key
    assert resumed["benchmarks"]["toy-arith"]["metrics"] == fresh["benchmarks"]["toy-arith"]["metrics"]


def test_refuses_to_mix_settings(tmp_path, toy_file, tiny_random_model_dir):
    out = tmp_path / "out"
    run(out, tiny_random_model_dir, toy_file, num_samples=2)
    with pytest.raises(bench_data.BenchError, match=r"num_samples 2 -> 3.*temperature 1.0 -> 0.6.*--overwrite"):
        run(out, tiny_random_model_dir, toy_file, num_samples=3, temperature=0.6)
    changed = tmp_path / "changed.jsonl"
    changed.write_text(toy_file.read_text().replace("42", "43"))
    with pytest.raises(bench_data.BenchError, match="data_fingerprint"):
        run(out, tiny_random_model_dir, changed, num_samples=2)
    # batch size only regroups the work: resuming with another one is allowed
    run(out, tiny_random_model_dir, toy_file, num_samples=2, batch_size=1)
    summary = run(out, tiny_random_model_dir, toy_file, num_samples=3, overwrite=True)
    assert summary["benchmarks"]["toy-arith"]["metrics"]["num_samples"] == 3
    assert len(read_records(out / "toy-arith" / "samples.jsonl")) == len(PROBLEMS) * 3


# ---------------------------------------------------------------------------------------------- CLI


def cli(*args):
    app = typer.Typer()
    app.command()(bench_command)
    result = CliRunner().invoke(app, [str(a) for a in args])
    return result, result.output




def test_cli_runs_and_prints_the_table(tmp_path, toy_file, tiny_random_model_dir):
    out = tmp_path / "out"
    result, output = cli("toy-arith", "aime25", "--model", tiny_random_model_dir, "--data-file", toy_file,
                         "--data-file", toy_file, "--n-samples", 2, "--max-new-tokens", 4, "-o", out,
                         "--no-progress")
    assert result.exit_code == 0, output
    assert "Avg@2" in output and "pass@2" in output and "average" in output
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["benchmarks"]) == {"toy-arith", "aime25"} and summary["average"]["num_benchmarks"] == 2
    assert summary["benchmarks"]["aime25"]["settings"]["prompt_suffix"] == bench_data.REFERENCE_SUFFIX
    assert summary["versions"]["torch"] and summary["model"] == str(Path(tiny_random_model_dir).resolve())
    assert_one_line_error(*cli("toy-arith", "aime25", "--model", tiny_random_model_dir, "--data-file", toy_file),
                          "1 --data-file for 2 benchmarks")


def test_cli_errors_are_one_line(tmp_path, toy_file, tiny_random_model_dir):
    assert_one_line_error(*cli("toy-arith"), "--model")
    assert_one_line_error(*cli("aime99", "--model", tiny_random_model_dir), "unknown benchmark 'aime99'")
    # offline (the tests run with HF_HUB_OFFLINE=1), a hub dataset cannot load: say how to go on
    assert_one_line_error(*cli("hmmt25", "--model", tiny_random_model_dir, "-o", tmp_path), "--data-file")
    assert_one_line_error(*cli("amc24", "--model", tiny_random_model_dir, "-o", tmp_path), "--data-file")
    out = tmp_path / "out"
    common = ("toy-arith", "--model", tiny_random_model_dir, "--data-file", toy_file, "--max-new-tokens", 4,
              "-o", out, "--no-progress")
    assert cli(*common, "--n-samples", 1)[0].exit_code == 0
    assert_one_line_error(*cli(*common, "--n-samples", 2), "num_samples 1 -> 2")


def _hand_made(folder: Path, avg: float, avg_se: float, maj: float, temperature: float = 0.6) -> Path:
    def metrics(shift):
        return {"num_problems": 30, "num_samples": 8, "mean_tokens": 100.0, "truncated_fraction": 0.0,
                "scores": {"avg": {"value": avg + shift, "stderr": avg_se}, "maj": {"value": maj, "stderr": 0.05}}}

    benchmarks = {
        name: {"settings": {"model": "m", "num_samples": 8, "temperature": temperature}, "metrics": metrics(shift)}
        for name, shift in (("aime24", 0.0), ("aime25", -0.1))
    }
    average = bench_scores.average_over_benchmarks([b["metrics"] for b in benchmarks.values()])
    folder.mkdir()
    (folder / "summary.json").write_text(json.dumps({"model": "m", "benchmarks": benchmarks, "average": average}))
    return folder


def test_compare_two_folders(tmp_path):
    a = _hand_made(tmp_path / "a", avg=0.30, avg_se=0.02, maj=0.40)
    b = _hand_made(tmp_path / "b", avg=0.40, avg_se=0.02, maj=0.42, temperature=1.0)
    rows, notes = bench_reports.compare_results(a, b)
    row = {(r["benchmark"], r["score"]): r for r in rows}
    assert row["aime24", "avg"]["diff"] == pytest.approx(0.10)
    assert row["aime24", "avg"]["se_diff"] == pytest.approx(math.sqrt(2) * 0.02)
    assert row["aime24", "avg"]["significant"]
    assert not row["aime24", "maj"]["significant"]  # 0.02 apart, 2 se = 0.14
    assert row["average", "avg"]["se_diff"] == pytest.approx(math.sqrt(2 * (math.sqrt(2) * 0.02 / 2) ** 2))
    assert notes == ["aime24: temperature 0.6 vs 1.0", "aime25: temperature 0.6 vs 1.0"]

    result, output = cli("--compare", a, b)
    assert result.exit_code == 0, output
    assert "+0.100" in output and "yes" in output and "temperature 0.6 vs 1.0" in output
    assert_one_line_error(*cli("--compare", a), "two result folders")
    assert_one_line_error(*cli("--compare", a, tmp_path), "summary.json not found")


# ------------------------------------------------------------------------------------------ any dataset


GSM8K_ROWS = [  # openai/grade-school-math's test.jsonl layout: the gold is the number after ####
    {"question": "Natalia sold 48 clips in April and half as many in May. How many in all?",
     "answer": "48/2 = <<48/2=24>>24\n48+24 = <<48+24=72>>72\n#### 72"},
    {"question": "Weng earns $12 an hour. How much for 50 minutes of babysitting?",
     "answer": "12/60 = $<<12/60=0.2>>0.2\n0.2 x 50 = $<<0.2*50=10>>10\n#### 10"},
]


def test_unregistered_name_with_data_file(tmp_path, tiny_random_model_dir, monkeypatch):
    """`poise bench gsm8k-local --data-file F --answer-column answer` on a GSM8K-format file."""
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in GSM8K_ROWS))
    texts = iter(["so \\boxed{72}", "\\boxed{70}", "\\boxed{10}", "10 dollars, \\boxed{10}"])

    def fake_sampler(engine, prompts, num_samples, on_batch, prompt_indices, **kwargs):
        batch = [Sample(prompt_indices[0], next(texts), 3, False) for _ in range(num_samples)]
        on_batch(batch)
        return batch

    monkeypatch.setattr(TransformersEngine, "sample", fake_sampler)
    out = tmp_path / "out"
    result, output = cli("gsm8k-local", "--data-file", path, "--answer-column", "answer", "--model",
                         tiny_random_model_dir, "--n-samples", 2, "-o", out, "--no-progress")
    assert result.exit_code == 0, output
    summary = json.loads((out / "summary.json").read_text())
    entry = summary["benchmarks"]["gsm8k-local"]
    assert entry["settings"]["columns"] == {"answer": "answer"} and entry["settings"]["data_source"] == str(path)
    assert entry["metrics"]["scores"]["avg"]["value"] == 0.75
    assert [r["correct"] for r in read_records(out / "gsm8k-local" / "samples.jsonl")] == [True, False, True, True]


def test_paths_names_split_and_limit(tmp_path, tiny_random_model_dir):
    folder = tmp_path / "mybench"
    folder.mkdir()
    rows = [{"Problem": f"What is {i} plus 1?", "Answer": str(i + 1)} for i in range(5)]
    (folder / "test.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "train.jsonl").write_text(json.dumps(rows[0]) + "\n")
    out = tmp_path / "out"
    common = ("--model", tiny_random_model_dir, "--n-samples", 1, "--max-new-tokens", 2, "-o", out,
              "--no-progress")
    result, output = cli(folder, "--split", "test", "--limit", 3, *common)
    assert result.exit_code == 0, output
    settings = json.loads((out / "mybench" / "settings.json").read_text())  # a folder is named after itself
    assert settings["num_problems"] == 3 and settings["split"] == "test" and settings["limit"] == 3
    result, output = cli(folder / "test.jsonl", "--name", "renamed", *common)
    assert result.exit_code == 0, output
    assert json.loads((out / "renamed" / "settings.json").read_text())["num_problems"] == 5
    assert_one_line_error(*cli(folder, *common), "pass the split")
    assert_one_line_error(*cli(folder / "test.jsonl", "toy-arith", "--name", "x", *common), "--name names one")
    assert_one_line_error(*cli(tmp_path / "nope.jsonl", *common), "no such file")
    assert_one_line_error(*cli("poise-trl-tests/not-cached", *common),  # offline: hub ids cannot load
                          "pass its file or folder instead of poise-trl-tests/not-cached")
    assert_one_line_error(*cli(folder / "test.jsonl", "--answer-column", "gold", *common),
                          "bad column mapping 'answer': 'gold'")


def test_data_file_forms(tmp_path, toy_file):
    from poise_trl.cli.bench import _data_files

    assert _data_files([f"toy-arith={toy_file}"], ["aime25", "toy-arith"], None) == {"toy-arith": str(toy_file)}
    assert _data_files([str(toy_file)], ["toy-arith"], None) == {"toy-arith": str(toy_file)}
    assert _data_files([f"amc24={toy_file}"], [], "poise") == {"amc24": str(toy_file)}
    with pytest.raises(bench_data.BenchError, match="NAME=FILE"):
        _data_files([f"amc24={toy_file}", str(toy_file)], ["amc24", "aime25"], None)


# --------------------------------------------------------------------------------------------- preset


def test_preset_poise_is_the_paper_protocol(tmp_path, tiny_random_model_dir, monkeypatch, toy_file):
    fixed = bench_data.PRESETS["poise"]
    assert fixed.benchmarks == ("amc23", "amc24", "aime24", "aime25", "aime26", "hmmt25", "brumo25")
    assert (fixed.num_samples, fixed.temperature, fixed.top_p) == (32, 0.6, 0.95)
    names, sampling = bench_data.resolve_preset("poise", [], num_samples=None, temperature=0.6, top_p=None,
                                           max_new_tokens=None)
    assert names == list(fixed.benchmarks) and sampling["num_samples"] == 32 and sampling["max_new_tokens"] == 8192
    with pytest.raises(bench_data.BenchError, match="--preset poise fixes --temperature 0.6; drop --temperature 1.0"):
        bench_data.resolve_preset("poise", [], num_samples=None, temperature=1.0, top_p=None, max_new_tokens=None)

    calls = []

    def fake_sampler(engine, prompts, num_samples, on_batch, prompt_indices, **kwargs):
        calls.append(kwargs)
        batch = [Sample(prompt_indices[0], "\\boxed{7}", 3, False) for _ in range(num_samples)]
        on_batch(batch)
        return batch

    monkeypatch.setattr(TransformersEngine, "sample", fake_sampler)
    out = tmp_path / "out"
    files = [a for name in fixed.benchmarks for a in ("--data-file", f"{name}={toy_file}")]
    result, output = cli("--preset", "poise", "--model", tiny_random_model_dir, *files, "-o", out, "--no-progress")
    assert result.exit_code == 0, output
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["benchmarks"]) == list(fixed.benchmarks)
    budgets = {entry["settings"]["max_new_tokens"] for entry in summary["benchmarks"].values()}
    assert {(c["temperature"], c["top_p"]) for c in calls} == {(0.6, 0.95)}
    assert {c["max_new_tokens"] for c in calls} == budgets and max(budgets) < 8192  # capped at the tiny context
    assert all(e["metrics"]["num_samples"] == 32 for e in summary["benchmarks"].values())
    assert_one_line_error(*cli("--preset", "poise", "--model", tiny_random_model_dir, "-o", out),
                          "amc24 has no verified hub copy registered: give a local copy with --data-file amc24=FILE")


# -------------------------------------------------------------------------------------------- exports


def _finished_summary(tmp_path, tiny_random_model_dir, toy_file, monkeypatch) -> dict:
    def fake_sampler(engine, prompts, num_samples, on_batch, prompt_indices, **kwargs):
        batch = [Sample(prompt_indices[0], f"\\boxed{{{7 if j == 0 else 0}}}", 3, False) for j in range(num_samples)]
        on_batch(batch)
        return batch

    monkeypatch.setattr(TransformersEngine, "sample", fake_sampler)
    return run(tmp_path / "out", tiny_random_model_dir, toy_file, num_samples=2, batch_size=2)


def test_evalscope_report_follows_its_schema(tmp_path, tiny_random_model_dir, toy_file, monkeypatch):
    """The documented EvalScope report layout (evalscope/report/report.py: Report -> Metric -> Category ->
    Subset, written to reports/<model>/<dataset>.json): checked field by field here; the next test reads it
    with EvalScope itself where it is installed."""
    summary = _finished_summary(tmp_path, tiny_random_model_dir, toy_file, monkeypatch)
    path = tmp_path / "out" / "reports" / bench_reports.model_id(summary["model"]) / "toy-arith.json"
    report = json.loads(path.read_text())
    assert {"name", "dataset_name", "model_name", "score", "metrics", "analysis"} <= set(report)
    assert report["dataset_name"] == "toy-arith" and report["model_name"] == Path(tiny_random_model_dir).name
    avg = summary["benchmarks"]["toy-arith"]["metrics"]["scores"]["avg"]["value"]
    assert avg == pytest.approx(1 / 6) and report["score"] == avg  # "7" is right for 1 of 3 problems, 1 of 2 samples
    assert [m["name"] for m in report["metrics"]] == ["mean_acc", "maj@2", "pass@2"]
    for metric in report["metrics"]:
        assert set(metric) == {"name", "num", "score", "macro_score", "categories"} and metric["num"] == 3
        (category,) = metric["categories"]
        assert isinstance(category["name"], list) and category["num"] == 3
        (subset,) = category["subsets"]
        assert set(subset) == {"name", "score", "num"} and subset["score"] == metric["score"]


def test_evalscope_reads_the_report(tmp_path, tiny_random_model_dir, toy_file, monkeypatch):
    report_module = pytest.importorskip("evalscope.report.report", reason="EvalScope is not installed")
    combinator = pytest.importorskip("evalscope.report.combinator")
    summary = _finished_summary(tmp_path, tiny_random_model_dir, toy_file, monkeypatch)
    folder = tmp_path / "out" / "reports" / bench_reports.model_id(summary["model"])
    report = report_module.Report.from_json(str(folder / "toy-arith.json"))
    assert report.dataset_name == "toy-arith"
    assert report.metrics[0].score == pytest.approx(round(1 / 6, 4))
    (listed,) = combinator.get_report_list([str(folder)])  # what `evalscope app` runs on a reports folder
    assert listed.model_name == Path(tiny_random_model_dir).name


def test_model_index_round_trips_through_huggingface_hub(tmp_path, tiny_random_model_dir, toy_file, monkeypatch):
    from huggingface_hub import ModelCard, ModelCardData

    from poise_trl.run.hub import HubPushError, push_bench_results

    summary = _finished_summary(tmp_path, tiny_random_model_dir, toy_file, monkeypatch)
    results = bench_reports.eval_results(summary)
    card = ModelCard(f"---\n{ModelCardData(model_name='tiny', eval_results=results).to_yaml()}\n---\n# tiny\n")
    parsed = ModelCard(str(card)).data.eval_results  # the hub's own model-index parser
    assert [(r.dataset_name, r.metric_name, r.metric_value) for r in parsed] == [
        ("toy-arith", "Avg@2", round(1 / 6, 4)), ("toy-arith", "maj@2", round(1 / 3, 4)),
        ("toy-arith", "pass@2", round(1 / 3, 4)),
    ]
    assert parsed[0].metric_args["temperature"] == 1.0

    updates = []
    push_bench_results("me/tiny", results, "tiny", update=lambda *a, **k: updates.append((a, k)))
    ((repo, metadata), kwargs), = updates
    assert repo == "me/tiny" and kwargs["overwrite"] and metadata["model-index"][0]["name"] == "tiny"

    def offline(*args, **kwargs):
        raise ConnectionError("no network")

    with pytest.raises(HubPushError, match="summary.json"):
        push_bench_results("me/tiny", results, "tiny", update=offline)
