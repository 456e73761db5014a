"""`poise doctor` on two machines of this one: each machine a real process with its own environment,
meeting at the rendezvous address; each finds what is wrong between them, in one line with the fix."""

import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import yaml
from helpers import free_port

REPO = Path(__file__).resolve().parents[1]
TOY_RECIPE = REPO / "recipes" / "toy" / "grpo.yaml"


def doctor(*args, machines=2, outputs=None, machine_env=None, recipe=TOY_RECIPE, wait=30) -> list[tuple[int, str]]:
    """`poise doctor RECIPE --machines N` started on every machine at once; machine i gets `--output-dir
    outputs[i]` and the environment `machine_env[i]` over this one. Returns (exit code, output) each."""
    rendezvous = f"127.0.0.1:{free_port()}"
    procs = []
    for node in range(machines):
        env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", **(machine_env or {}).get(node, {})}
        cmd = [sys.executable, "-m", "poise_trl.cli.main", "doctor", str(recipe), "--machines", str(machines),
               "--node-rank", str(node), "--rendezvous", rendezvous, "--wait", str(wait), "-o", str(outputs[node]),
               *args]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return [(proc.wait(timeout=120), proc.stdout.read()) for proc in procs]


def problems(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("problem:")]


def test_two_machines_that_agree_pass(tmp_path):
    for code, output in doctor(outputs=[tmp_path, tmp_path]):
        assert code == 0 and problems(output) == [], output
        assert "checked against the other 1 machine(s)" in output and "memory plan:" in output
    assert list(tmp_path.iterdir()) == []  # nothing left behind: `poise train` can start in the folder


def test_a_version_mismatch_an_unshared_output_folder_and_an_unreachable_server_are_each_found(tmp_path):
    """Machine 1's environment puts an older TRL's metadata first on its path, and its output folder is
    on its own disk; the recipe's vLLM server does not run. Each machine names each problem in one line."""
    older = tmp_path / "older-trl"
    (older / "trl-1.0.0.dist-info").mkdir(parents=True)
    (older / "trl-1.0.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: trl\nVersion: 1.0.0\n")
    env = {1: {"PYTHONPATH": os.pathsep.join([str(older), str(REPO)])}}
    recipe = yaml.safe_load(TOY_RECIPE.read_text())
    recipe.update(use_vllm=True, vllm_mode="server", vllm_server_base_url=f"http://127.0.0.1:{free_port()}")
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    results = doctor(outputs=[tmp_path / "machine0-disk", tmp_path / "machine1-disk"], machine_env=env,
                     recipe=tmp_path / "recipe.yaml")
    for node, (code, output) in enumerate(results):
        other = 1 - node
        server, versions, folder = problems(output)
        assert code == 1
        assert "vLLM server http://127.0.0.1:" in server and "does not answer (Connection refused)" in server
        assert "python -m poise_trl.engines.vllm_server --model" in server
        installed = metadata.version("trl")
        mine, theirs = (installed, "1.0.0") if node == 0 else ("1.0.0", installed)
        assert versions.startswith(f"problem: trl differs: this machine ({node}) has {mine}"), versions
        assert f"machine {other} (" in versions and f"has {theirs}" in versions
        assert "install the same version on every machine" in versions
        assert f"is not shared with machine {other}" in folder and "a filesystem every machine mounts" in folder


def test_a_machine_alone_finds_the_rendezvous_unanswered(tmp_path):
    """Machine 1 started, machine 0 not: nothing listens at the rendezvous address."""
    rendezvous = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-m", "poise_trl.cli.main", "doctor", "--machines", "2", "--node-rank",
                             "1", "--rendezvous", rendezvous, "--wait", "3", "-o", str(tmp_path)],
                            env=env, capture_output=True, text=True, timeout=120)
    [line] = problems(result.stdout)
    assert result.returncode == 1 and f"rendezvous {rendezvous} does not answer" in line, result.stdout
