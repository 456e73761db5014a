"""Several machines on this one: `poise train` launched as 2 machines x 1 process on localhost
(`torchrun --nnodes 2 --node_rank R --master_addr 127.0.0.1`, CPU, gloo), each machine a real
torchrun agent in its own session with its own environment.

- POISE on the bundled tiny model ends identical to the same recipe launched as 1 machine x 2
  processes (same seed): checkpoints (the probe's buffer holding both ranks' rows) and final weights.
- A machine killed after the step-2 checkpoint ends the other one with one `error:` line naming its
  rank; rerunning the same launch resumes from checkpoint-2 and ends identical to the uninterrupted run.
- A rank stopped with SIGSTOP (a hang, not a death) ends the other machine within the recipe's
  collective timeout (`ddp_timeout`), again naming the rank.
- With the vLLM server (CPU build) as a third machine reached by URL (`vllm_mode: server`): `poise doctor`
  on both training machines finds it serving the recipe's model, then the two machines train through it.
- recipes/slurm/train.sbatch under stand-ins for `srun` and `scontrol` (tests/fixtures/slurm) that start
  one real process per machine with SLURM's variables: `poise doctor` on each, then the training."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml
from helpers import free_port
from safetensors.torch import load_file
from test_doctor import doctor, problems
from test_fsdp import state_files

from poise_trl.core.loading import resolve_model_path
from poise_trl.engines.generation import vllm_import_error
from poise_trl.run.recipe import load_recipe

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def recipe_file(folder: Path, **changes) -> Path:
    """recipes/toy/poise.yaml shortened to 4 steps of 2 prompts x 2 rollouts per process, a checkpoint
    every 2 steps, with the fault-injecting reward beside math_accuracy (it scores 0.0: no effect)."""
    recipe = load_recipe(REPO / "recipes" / "toy" / "poise.yaml")
    recipe.update(num_generations=2, per_device_train_batch_size=4, max_completion_length=16, dataset_size=32,
                  eval_limit=4, eval_every=2, eval_num_samples=1, eval_max_new_tokens=16, max_steps=4,
                  logging_steps=1, save_steps=2, probe_bootstrap_steps=1, probe_prompt_components=2,
                  probe_response_components=2, rewards=["math_accuracy", "helpers:machine_failure"])
    recipe.update(changes)
    path = folder / "recipe.yaml"
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(recipe))
    return path


def launch(recipe: Path, out: Path, machines: int, per_machine: int, machine_env=None) -> list[subprocess.Popen]:
    """`poise train RECIPE -o OUT` on `machines` torchrun agents of `per_machine` processes each; machine
    i's environment is its own (own TMPDIR, plus `machine_env[i]`)."""
    port = free_port()
    procs = []
    for node in range(machines):
        tmp = out.parent / f"{out.name}-machine{node}-tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]), "TMPDIR": str(tmp),
               "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "ACCELERATE_USE_CPU": "true",
               # accelerate 1.15 gives each MULTI_CPU process the device cpu:RANK, which the Trainer's resume
               # passes to torch.load as map_location, and torch cannot restore onto: plain cpu, as on one process.
               "ACCELERATE_TORCH_DEVICE": "cpu",
               **(machine_env or {}).get(node, {})}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(machines), "--node_rank", str(node),
               "--nproc_per_node", str(per_machine), "--master_addr", "127.0.0.1", "--master_port", str(port),
               "-m", "poise_trl.cli.main", "train", str(recipe), "-o", str(out), "--no-progress"]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))
    return procs


def finish(procs, timeout=600) -> list[tuple[int, str]]:
    results = []
    for proc in procs:
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_machine(proc)
            output, _ = proc.communicate()
        results.append((proc.returncode, output))
    return results


def kill_machine(proc: subprocess.Popen) -> None:
    """SIGKILL a machine: its torchrun agent and the workers it started (in their own sessions)."""
    try:
        agent = psutil.Process(proc.pid)
        for process in [*agent.children(recursive=True), agent]:
            process.send_signal(signal.SIGKILL)
    except psutil.NoSuchProcess:
        pass


def run_ok(recipe, out, machines, per_machine):
    for code, output in finish(launch(recipe, out, machines, per_machine)):
        assert code == 0, output[-4000:]


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error:")]


@pytest.fixture(scope="module")
def two_machines_run(tmp_path_factory):
    """The recipe's uninterrupted 4-step run as 2 machines x 1 process."""
    folder = tmp_path_factory.mktemp("two-machines")
    recipe = recipe_file(folder)
    run_ok(recipe, folder / "run", machines=2, per_machine=1)
    return recipe, folder / "run"


def assert_same_run(expected: Path, got: Path) -> None:
    a, b = state_files(expected / "checkpoint-4"), state_files(got / "checkpoint-4")
    assert a.keys() == b.keys() and any("probe" in name for name in a), sorted(a)
    for name in a:
        assert a[name] == b[name], name
    weights, again = (load_file(run / "final" / "model.safetensors") for run in (expected, got))
    assert weights.keys() == again.keys() and all(weights[k].equal(again[k]) for k in weights)


def test_two_machines_match_one_machine_with_two_processes(two_machines_run, tmp_path):
    recipe, across = two_machines_run
    run_ok(recipe, tmp_path / "one-machine", machines=1, per_machine=2)
    assert_same_run(tmp_path / "one-machine", across)
    # The probe's buffer holds both ranks' rows: 4 rows per rank per step, from step 1 on.
    probe = load_file(next((across / "checkpoint-4").rglob("poise_probe.safetensors")))
    targets = [key for key in probe if key.endswith("buffer.targets")]
    assert targets and probe[targets[0]].numel() == 4 * 2 * 4, {k: probe[k].shape for k in targets}


def test_a_killed_machine_ends_the_other_naming_its_rank_and_the_rerun_resumes(two_machines_run, tmp_path):
    recipe, whole = two_machines_run
    out = tmp_path / "run"
    dies = {1: {"POISE_TEST_FAILURE": "kill", "POISE_TEST_FAILURE_STEP": "2"}}
    (code, output), (killed, _) = finish(launch(recipe, out, 2, 1, machine_env=dies), timeout=300)
    assert killed == -signal.SIGKILL
    [line] = error_lines(output)  # the rank's one line, then torchrun's own report of its exit code 2
    assert code != 0 and "exitcode  : 2" in output, output[-4000:]
    assert "rank 1 (machine 1) of 2 stopped answering (its connection closed)" in line, line
    assert (out / "checkpoint-2" / "trainer_state.json").is_file() and not (out / "summary.json").exists()
    results = finish(launch(recipe, out, 2, 1))
    assert all(code == 0 for code, _ in results), results[0][1][-4000:]
    assert "resuming from checkpoint-2" in results[0][1]
    assert_same_run(whole, out)


def test_a_stopped_rank_ends_the_other_within_the_collective_timeout(tmp_path):
    timeout = 15
    recipe = recipe_file(tmp_path, ddp_timeout=timeout)
    hangs = {1: {"POISE_TEST_FAILURE": "stop", "POISE_TEST_FAILURE_STEP": "1"}}
    machines = launch(recipe, tmp_path / "run", 2, 1, machine_env=hangs)
    try:
        while not any(p.status() == psutil.STATUS_STOPPED for p in psutil.Process(machines[1].pid).children()):
            assert machines[1].poll() is None and machines[0].poll() is None, "no rank stopped"
            time.sleep(0.2)
        stopped_at = time.monotonic()
        [(code, output)] = finish(machines[:1], timeout=timeout * 4)
        waited = time.monotonic() - stopped_at
    finally:
        kill_machine(machines[1])
        machines[1].communicate()
    [line] = error_lines(output)
    assert code != 0 and "exitcode  : 2" in output, output[-4000:]
    assert "rank 1 (machine 1) of 2 stopped answering (no answer within the collective timeout" in line, line
    assert timeout <= waited < timeout * 3, waited  # the collective's timeout, then the check-in's (at most as long)


def test_the_slurm_script_checks_every_machine_then_trains(tmp_path):
    recipe = recipe_file(tmp_path, max_steps=2, save_steps=100, eval_every=0)
    stand_ins = REPO / "tests" / "fixtures" / "slurm"
    env = {**os.environ, "PATH": os.pathsep.join([str(stand_ins), os.environ["PATH"]]), "SLURM_NNODES": "2",
           "SLURM_JOB_NODELIST": "node[0-1]", "SLURM_JOB_ID": "1", "MASTER_PORT": str(free_port()),
           "PYTHON": sys.executable, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "ACCELERATE_USE_CPU": "true",
           "ACCELERATE_TORCH_DEVICE": "cpu"}
    env.pop("MASTER_ADDR", None)
    result = subprocess.run(["bash", str(REPO / "recipes" / "slurm" / "train.sbatch"), str(recipe), "-o",
                             str(tmp_path / "run")], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("checked against the other 1 machine(s)") == 2, result.stdout
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 2


@pytest.mark.vllm
@pytest.mark.skipif(vllm_import_error() is not None, reason=f"{vllm_import_error()} (docs/install.md)")
def test_two_machines_train_through_a_vllm_server_reached_by_url(tmp_path):
    from poise_trl.engines.vllm_server import LocalServer

    model = resolve_model_path("data/tiny-qwen3")
    server = LocalServer(Path(model), tmp_path / "server.log")
    try:
        server.start()
        recipe = recipe_file(tmp_path, model=model, use_vllm=True, vllm_mode="server", vllm_server_base_url=server.url,
                             max_steps=2, save_steps=100, eval_every=0)
        for code, output in doctor(outputs=[tmp_path / "run"] * 2, recipe=recipe):
            assert code == 0 and problems(output) == [], output
        other = tmp_path / "other-model"  # the same server, asked for another model (a config is all doctor reads)
        other.mkdir()
        shutil.copy(Path(model) / "config.json", other / "config.json")
        elsewhere = tmp_path / "other.yaml"
        elsewhere.write_text(yaml.safe_dump({**yaml.safe_load(recipe.read_text()), "model": str(other)}))
        [(code, output)] = doctor(outputs=[tmp_path / "run"], recipe=elsewhere, machines=1)
        assert code == 1 and f"serves {model}, not the recipe's model {other}" in output, output
        run_ok(recipe, tmp_path / "run", machines=2, per_machine=1)
    finally:
        server.stop()
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 2
    log = (tmp_path / "server.log").read_text()
    assert "POST /collective_rpc" in log, log[-3000:]  # the trainer's weights reached the server


def test_a_ranks_own_error_stays_its_own_and_the_others_name_that_rank():
    """Only a collective that failed because of a peer is turned into the one line: rank 1's own error
    reaches it unchanged (it is not blamed on rank 0), and rank 0, whose next collective then finds rank 1
    gone, names rank 1."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), str(REPO / "tests" / "distributed" / "lost_rank.py")]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    lines = [line.split("]:", 1)[-1].strip() for line in result.stdout.splitlines() if "rank " in line]
    assert "rank 1: RuntimeError: CUDA out of memory (the rank's own failure)" in lines, result.stdout
    assert any(line.startswith("rank 0: LostRankError: rank 1 (machine 0) of 2 stopped answering") for line in lines)
