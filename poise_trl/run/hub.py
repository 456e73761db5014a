"""Push a trained model to the Hugging Face Hub with a card recording its recipe and results."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from huggingface_hub import HfApi, metadata_update
from huggingface_hub.repocard_data import eval_results_to_model_index

from poise_trl.tasks import dataset_label


def _last_values(train_log: list[dict], prefix: str) -> dict[str, float]:
    last = {}
    for entry in train_log:
        last.update({k: v for k, v in entry.items() if k.startswith(prefix) and isinstance(v, (int, float))})
    return last


def build_model_card(recipe: dict, summary: dict, algorithm_line: str | None = None) -> str:
    """Our card for final/README.md and the pushed repo: algorithm (`algorithm_line`: the registered
    algorithm's card text, else its name), base model, recipe, held-out curve, probe / critic summaries
    and versions (replaces TRL's generated card)."""
    fmt = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
    algo = summary["algo"]
    base = summary["model"]
    data = dataset_label(summary["dataset"])
    curve = "\n".join(
        f"| {p['step']} | {p.get('generated_tokens', 0):,} | {p.get('train_seconds', 0):.1f} | {fmt(p['accuracy'])} "
        f"± {fmt(p.get('stderr'))} |" for p in summary.get("heldout_history", []))
    sections = []
    probe = summary.get("probe")
    if probe:
        online = probe["online_mean_after_bootstrap"]
        sections.append(
            "## Value probe (POISE)\n\n"
            f"{probe['rounds']} rounds, the probe active in {probe['probe_active_rounds']}. Out-of-sample, over the "
            f"active rounds: Pearson {fmt(online.get('pearson'))} with the realized reward, pairwise sign accuracy "
            f"{fmt(online.get('pairwise_sign_acc'))}, MAE {fmt(online.get('mae'))}, reward variance reduction "
            f"{fmt(online.get('variance_reduction'))}."
        )
    critics = _last_values(summary.get("train_log", []), "critic/")
    if critics:
        rows = "\n".join(f"| {k} | {v:.4g} |" for k, v in sorted(critics.items()))
        sections.append(f"## Critics (last logged values)\n\n| metric | value |\n|---|---|\n{rows}")
    extra = "\n\n".join(sections)
    hub_base = "" if Path(base).exists() or base.startswith(("data/", "./", "/")) else f"base_model: {base}\n"
    return f"""---
library_name: transformers
tags: [poise-trl, trl, {algo}, rlvr]
{hub_base}---
# {algo} on {data}

Trained with poise-trl (`poise train`, built on TRL {summary.get('versions', {}).get('trl', '?')}):
**{algorithm_line or algo}**.
Base model `{base}`, data `{data}`, {summary['steps']} optimizer steps,
{summary.get('generated_tokens', 0):,} generated completion tokens, {summary.get('train_seconds', 0):.0f} s in
optimizer steps ({summary['wall_clock_seconds']} s wall clock).

## Held-out accuracy

| held-out accuracy | value |
|---|---|
| at the start | {fmt(summary.get('start_heldout_accuracy'))} |
| at the end | {fmt(summary.get('final_heldout_accuracy'))} |

| step | generated tokens | training seconds | accuracy ± s.e. |
|---|---|---|---|
{curve}

{extra}

## Recipe
```yaml
{yaml.safe_dump(recipe, sort_keys=False).strip()}
```

## Versions
```json
{json.dumps(summary.get('versions', {}), indent=2)}
```
"""


class HubPushError(RuntimeError):
    """Training output is safe on disk; only the upload failed."""


def push_final_model(model_dir: str | Path, repo_id: str | None, recipe: dict, summary: dict, api=None,
                     algorithm_line: str | None = None) -> str:
    """Write README.md (the card) and summary.json into `model_dir`, then upload the folder."""
    if not repo_id:
        raise ValueError("pushing to the Hub needs a repository id: set hub_model_id: <user>/<name> in the recipe")
    model_dir = Path(model_dir)
    (model_dir / "README.md").write_text(build_model_card(recipe, summary, algorithm_line))
    (model_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    api = api or HfApi()
    try:
        api.create_repo(repo_id, exist_ok=True)
        api.upload_folder(folder_path=str(model_dir), repo_id=repo_id, commit_message="poise-trl: trained model")
    except Exception as exc:  # offline, auth, quota: whatever it is, say what is safe and how to retry
        raise HubPushError(
            f"the trained model, its card and summary.json are saved in {model_dir}, but pushing to {repo_id!r} "
            f"failed ({exc.__class__.__name__}: {exc}). Retry where the Hub is reachable and you are logged in: "
            f"`hf auth login`, then `hf upload {repo_id} {model_dir}`"
        ) from None
    return repo_id


def push_bench_results(repo_id: str, eval_results: list, model_name: str, update=None) -> None:
    """Add `poise bench` results (huggingface_hub `EvalResult`s, see `bench_reports.eval_results`) to the model-index
    of `repo_id`'s card, keeping the card's text and its other results; `update` defaults to
    huggingface_hub's `metadata_update`."""
    update = update or metadata_update
    metadata = {"model-index": eval_results_to_model_index(model_name, eval_results)}
    try:
        update(repo_id, metadata, overwrite=True, commit_message="poise-trl: bench results")
    except Exception as exc:  # offline, auth, a missing repository: the results stay in summary.json
        raise HubPushError(
            f"adding the bench results to {repo_id!r}'s model card failed ({exc.__class__.__name__}: {exc}); "
            "they are in the output folder's summary.json. Retry with --push-to-hub where the Hub is "
            "reachable and you are logged in (the samples are kept, nothing is regenerated)."
        ) from None
