"""Run assembly: a recipe becomes a run plan, a trainer, a run folder; the jobs that train."""
