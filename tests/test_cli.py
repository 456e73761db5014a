"""The CLI's contract with users: bad input gives one clear line, not a traceback."""

import shutil

import pytest
from helpers import assert_one_line_error
from typer.testing import CliRunner

from poise_trl.cli.main import app

runner = CliRunner()


def run(*args):
    result = runner.invoke(app, list(args))
    return result, result.output




def test_missing_recipe_file(tmp_path):
    result, output = run("train", str(tmp_path / "missing.yaml"))
    assert_one_line_error(result, output, "not found")


def test_unknown_key(tmp_path):
    (tmp_path / "r.yaml").write_text("algo: grpo\nnum_generation: 4\n")
    result, output = run("train", str(tmp_path / "r.yaml"))
    assert_one_line_error(result, output, "did you mean 'num_generations'")


def test_batch_not_divisible(tmp_path):
    (tmp_path / "r.yaml").write_text("algo: grpo\nnum_generations: 4\nper_device_train_batch_size: 6\n")
    result, output = run("train", str(tmp_path / "r.yaml"), "--output-dir", str(tmp_path / "out"))
    assert_one_line_error(result, output, "not divisible by num_generations=4")


def test_model_without_chat_template(tmp_path, tiny_random_model_dir):
    model = tmp_path / "no-template"
    shutil.copytree(tiny_random_model_dir, model)
    config = model / "tokenizer_config.json"
    text = config.read_text()
    import json

    data = json.loads(text)
    data.pop("chat_template", None)
    config.write_text(json.dumps(data))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    (tmp_path / "r.yaml").write_text(f"algo: grpo\nmodel: {model}\nnum_generations: 2\nper_device_train_batch_size: 4\n")
    result, output = run("train", str(tmp_path / "r.yaml"), "--output-dir", str(tmp_path / "out"))
    assert_one_line_error(result, output, "has no chat template")


@pytest.mark.parametrize("command", ["train", "toy"])
def test_help(command):
    result = runner.invoke(app, [command, "--help"])
    assert result.exit_code == 0
