"""The CLI's contract with users: bad input gives one clear line, not a traceback; help reads as
paragraphs."""

import ast
import itertools
import re
import shutil
from pathlib import Path

import pytest
from helpers import assert_one_line_error
from typer.main import get_command
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
    (tmp_path / "r.yaml").write_text(f"algo: grpo\nmodel: {model}\nnum_generations: 2\n"
                                     "per_device_train_batch_size: 4\n")
    result, output = run("train", str(tmp_path / "r.yaml"), "--output-dir", str(tmp_path / "out"))
    assert_one_line_error(result, output, "has no chat template")


@pytest.mark.parametrize("command", ["train", "toy"])
def test_help(command):
    result = runner.invoke(app, [command, "--help"])
    assert result.exit_code == 0


PACKAGE = Path(__file__).resolve().parents[1] / "poise_trl"
# Flags of other programs that the package writes out: pip's, accelerate's, torchrun's, the vLLM server's
# that `poise doctor` spells out (and every flag in sandbox.py, bubblewrap's and unshare's, and in
# vllm_server.py and seam/vllm.py, the vLLM server's).
OTHER_PROGRAMS_FLAGS = {"--no-deps", "--num_processes", "--nproc_per_node", "--host", "--port"}


def command_paths(command, path=()):
    yield path
    for name, sub in getattr(command, "commands", {}).items():
        yield from command_paths(sub, (*path, name))


def option_names(command) -> set[str]:
    names = {name for param in command.params for name in getattr(param, "opts", [])}
    return names.union(*(option_names(sub) for sub in getattr(command, "commands", {}).values()))


def help_text(path, width: int) -> str:
    result = runner.invoke(app, [*path, "--help"], env={"COLUMNS": str(width)}, terminal_width=width)
    assert result.exit_code == 0, result.output
    return result.output


def fragments(text: str) -> list[str]:
    """Lines under 30 characters that do not end their paragraph: the next line continues the same text at
    the same indent (a hard line break in a docstring, rendered as is). List items (`- `, `* `, option rows
    starting with `-`) and typer's own `[default: ...]` / `[required]` lines are not fragments."""
    found = []
    lines = [line.strip().strip("│").rstrip() for line in text.splitlines()]
    for line, following in itertools.pairwise(lines):
        words, next_words = line.strip(), following.strip()
        if not words or not next_words or words[0] in "-*•[╭╰─" or next_words[0] in "[╭╰─":
            continue
        same_indent = len(line) - len(line.lstrip()) == len(following) - len(following.lstrip())
        if len(words) < 30 and same_indent:
            found.append(f"{words!r} (then {next_words!r})")
    return found


@pytest.mark.parametrize("width", [100, 120])
def test_every_commands_help_reads_as_paragraphs_without_internal_references_or_machine_paths(width):
    for path in command_paths(get_command(app)):
        text = help_text(path, width)
        assert not fragments(text), (path, fragments(text))
        assert not re.search(r"seed 00\d|poise-spec|trl-notes", text), path
        assert str(PACKAGE.parent) not in text and str(Path.home()) not in text, path
        assert "<bool>" not in text, path


def test_every_flag_the_package_names_is_a_current_option():
    """Errors and help name options as they are spelled now (`--n-samples`, not the earlier `--n`)."""
    current = option_names(get_command(app)) | {"--help"}
    named = {}
    for module in PACKAGE.rglob("*.py"):
        if module.name in ("sandbox.py", "vllm_server.py") or module == PACKAGE / "seam" / "vllm.py":
            continue
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9_-]*", node.value):
                    named.setdefault(flag, module.name)
    stale = {flag: module for flag, module in named.items() if flag not in current | OTHER_PROGRAMS_FLAGS}
    assert not stale, stale
