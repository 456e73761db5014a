"""Pushing to the Hub, up to the network: the card and the upload call."""

import json

import pytest

from poise_trl.run.hub import build_model_card, push_final_model

SUMMARY = {
    "algo": "poise", "model": "data/tiny-qwen3", "dataset": "toy-arith", "steps": 60,
    "wall_clock_seconds": 300.0, "start_heldout_accuracy": 0.6275, "final_heldout_accuracy": 0.7775,
    "versions": {"trl": "1.16.0"},
}
RECIPE = {"algo": "poise", "model": "data/tiny-qwen3", "num_generations": 2}


class FakeApi:
    def __init__(self):
        self.calls = []

    def create_repo(self, repo_id, exist_ok):
        self.calls.append(("create_repo", repo_id, exist_ok))

    def upload_folder(self, folder_path, repo_id, commit_message):
        self.calls.append(("upload_folder", folder_path, repo_id))


def test_card_records_recipe_and_results():
    card = build_model_card(RECIPE, SUMMARY)
    assert card.startswith("---\nlibrary_name: transformers")
    assert "num_generations: 2" in card
    assert "| at the start | 0.627 |" in card or "| at the start | 0.628 |" in card
    assert "| at the end | 0.777 |" in card or "| at the end | 0.778 |" in card
    assert '"trl": "1.16.0"' in card


def test_push_writes_card_and_summary_then_uploads(tmp_path):
    api = FakeApi()
    push_final_model(tmp_path, "me/tiny-poise", RECIPE, SUMMARY, api=api)
    assert (tmp_path / "README.md").read_text() == build_model_card(RECIPE, SUMMARY)
    assert json.loads((tmp_path / "summary.json").read_text())["algo"] == "poise"
    assert api.calls == [("create_repo", "me/tiny-poise", True), ("upload_folder", str(tmp_path), "me/tiny-poise")]


def test_push_without_repo_id_names_the_fix(tmp_path):
    with pytest.raises(ValueError, match="hub_model_id"):
        push_final_model(tmp_path, None, RECIPE, SUMMARY, api=FakeApi())


def test_failed_upload_says_what_is_safe_and_how_to_retry(tmp_path):
    from poise_trl.run.hub import HubPushError

    class OfflineApi(FakeApi):
        def create_repo(self, repo_id, exist_ok):
            raise ConnectionError("no network")

    with pytest.raises(HubPushError, match=r"saved in .*hf auth login.*hf upload me/x"):
        push_final_model(tmp_path, "me/x", RECIPE, SUMMARY, api=OfflineApi())
    assert (tmp_path / "README.md").exists() and (tmp_path / "summary.json").exists()
