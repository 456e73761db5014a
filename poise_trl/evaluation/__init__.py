"""Evaluation: bench, grade, probe-eval; never imports training."""
