"""`math:<dataset>`: a registered math dataset (`math:toy-arith`, `math:math-500`, ...) as a task.

Its rows are the dataset's own, graded by math-verify as the `math_accuracy` reward grades them. Train is
the dataset's default split, test its held-out split (`size` rows chosen by the seed).
"""

from __future__ import annotations

from poise_trl.tasks.family import TaskError, TaskFamily
from poise_trl.tasks.math_grader import grade_batch, is_correct
from poise_trl.tasks.prompts import DATASETS, held_out_split, load_math_dataset


def registered() -> list[str]:
    return sorted(DATASETS)


def build_rows(variant: str | None, config: dict, split: str, size: int | None, seed: int) -> list[dict]:
    if variant not in DATASETS:
        raise TaskError(f"unknown math dataset {variant!r} in task 'math:{variant}': give math:<name> with a "
                        f"registered dataset ({', '.join(registered())})")
    if split not in ("train", "test"):
        raise TaskError(f"unknown split {split!r} for math:{variant}; use 'train' or 'test'")
    dataset_split = None
    if split == "test":
        dataset_split = held_out_split(variant)
        if dataset_split is None:
            raise TaskError(f"math:{variant} has no held-out split: evaluate it on another dataset (eval_dataset)")
    rows = load_math_dataset(variant, split=dataset_split, limit=size, seed=seed)
    own_id = next((c for c in ("id", "unique_id") if c in rows.column_names), None)  # AIME's, MATH-500's
    return [{"id": str(row[own_id]) if own_id else f"{variant}/{split}/{i}", "prompt": row["prompt"],
             "answer": row["answer"], "verifier": {"answer": row["answer"]}} for i, row in enumerate(rows)]


def score(completion: str, verifier: dict) -> float:
    return float(is_correct(completion, verifier["answer"]))


def score_batch(completions: list[str], verifiers: list[dict]) -> list[float]:
    """All of a batch in one round trip to the grading worker (`math_grader.grade_batch`)."""
    pairs = [(text, verifier["answer"]) for text, verifier in zip(completions, verifiers, strict=True)]
    return [float(correct) for correct in grade_batch(pairs)]


TASK = TaskFamily(
    name="math",
    description="a registered math dataset (math:<name>), graded by math-verify like the math_accuracy reward",
    answer_format="\\boxed{...}",
    build_rows=build_rows,
    score=score,
    score_batch=score_batch,
    variants=registered,
)
