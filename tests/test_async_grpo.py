"""`async: true`: TRL's experimental AsyncGRPOTrainer as the seam's second adapter (poise_trl/seam/async_grpo.py).

The pure-torch `tree_fa3` against an unpacked forward (no server); then one real vLLM CPU server for the module
(`engines.vllm_server.LocalServer`, a tiny random model), which the weight transfer, the algorithms' own
advantages, `poise train` and its resume after kill -9 train against. Skipped, with the reason, when vLLM does
not import.
"""

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import (
    SEQUENCE_TEXT,
    VARYING_REWARD,
    assert_parameters_moved,
    build_trainer,
    model_logprobs,
    server_logprobs,
    trainable_parameters,
)
from transformers import AutoModelForCausalLM

from poise_trl.core import estimators
from poise_trl.engines.generation import vllm_import_error
from poise_trl.run.recipe import RecipeError
from poise_trl.run.run_folder import CHECKPOINT_MARKER

pytestmark = pytest.mark.skipif(vllm_import_error() is not None, reason=f"{vllm_import_error()} (docs/install.md)")

def test_tree_attention_equals_the_unpacked_forward(tiny_random_model_dir):
    """Rollouts of one prompt packed into TRL's prefix trie (the prompt forwarded once, two completions sharing
    their first tokens) give each trained token the log-probability an unpacked forward of its own sequence
    gives it; a padded batch (generation, the feature pass) gives what SDPA gives."""
    from trl.experimental.async_grpo.packing import TREE_ATTENTION, TreeRow

    from poise_trl.seam.async_grpo import cpu_ready_construction

    with cpu_ready_construction():  # registers TRL's tree_fa3 and ours over it, as a trainer's construction does
        import trl.experimental.async_grpo.async_grpo_trainer as trainer_module

        trainer_module.register_tree_attention()
    tree = AutoModelForCausalLM.from_pretrained(tiny_random_model_dir, attn_implementation=TREE_ATTENTION)
    eager = AutoModelForCausalLM.from_pretrained(tiny_random_model_dir, attn_implementation="eager")
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(5, 60, (7,), generator=generator).tolist()
    completions = [torch.randint(5, 60, (n,), generator=generator).tolist() for n in (3, 5, 9)]
    completions.append(completions[1][:2] + [11, 12])  # shares two tokens with the second
    row = TreeRow()
    for completion in completions:
        ids = prompt + completion
        row.add({"input_ids": np.array(ids), "completion_mask": np.array([0] * len(prompt) + [1] * len(completion)),
                 "old_log_probs": np.zeros(len(ids), dtype=np.float32), "advantage": 0.0, "group_id": 0})
    packed = row.pack()
    assert len(packed["input_ids"]) < sum(len(prompt) + len(c) for c in completions)  # something is shared
    with torch.no_grad():
        logits = tree(input_ids=packed["input_ids"][None], position_ids=packed["position_ids"][None],
                      tree_kv_index=packed["tree_kv_index"], tree_cu_seqlens_q=packed["tree_cu_seqlens_q"],
                      tree_cu_seqlens_k=packed["tree_cu_seqlens_k"],
                      tree_max_seqlen_q=int(packed["tree_max_seqlens"][0]),
                      tree_max_seqlen_k=int(packed["tree_max_seqlens"][1])).logits[0]
        index = packed["token_index"]
        got = logits.log_softmax(-1)[index, packed["shift_labels"][index]]
        wanted = []
        for completion in completions:
            ids = torch.tensor([prompt + completion])
            log_probs = eager(input_ids=ids).logits[0].log_softmax(-1)
            wanted += [log_probs[t - 1, ids[0, t]] for t in range(len(prompt), ids.shape[1])]
        assert (got - torch.stack(wanted)).abs().max() < 1e-5

        ids = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
        mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6])
        sdpa = AutoModelForCausalLM.from_pretrained(tiny_random_model_dir, attn_implementation="sdpa")
        difference = tree(input_ids=ids, attention_mask=mask).logits - sdpa(input_ids=ids, attention_mask=mask).logits
        assert difference[mask.bool()].abs().max() < 1e-5


# -- against a real vLLM CPU server ------------------------------------------------------------


@pytest.fixture(scope="module")
def server(random_model_dir, tmp_path_factory):
    from poise_trl.engines.vllm_server import LocalServer

    with LocalServer(random_model_dir, tmp_path_factory.mktemp("vllm-server") / "server.log") as server:
        yield server


def async_recipe(server, algo: str, **overrides) -> dict:
    return {"algo": algo, "async": True, "max_staleness": 1, "model": str(server.model), "dataset": "toy-arith",
            "rewards": [VARYING_REWARD], "dataset_size": 64, "per_device_train_batch_size": 8,
            "max_completion_length": 16, "learning_rate": 1e-3, "eval_every": 0, "eval_limit": 8,
            "eval_max_new_tokens": 8, "eval_num_samples": 1, "logging_steps": 1, "save_strategy": "no",
            "vllm_server_base_url": server.url, "seed": 0, **overrides}


def recording_rounds(trainer) -> list:
    """Every round the trainer scores: (trainer's policy version then, its samples)."""
    rounds, score = [], trainer.score_groups

    def record(groups):
        samples = score(groups)
        rounds.append((trainer.model_version, [(s.metrics["reward"], s.advantage, s.model_version,
                                                s.metrics["rollout/server_policy_version"]) for s in samples]))
        return samples

    trainer.score_groups = record
    return rounds


def test_rloo_async_advantages_versions_and_weights(server, tmp_path):
    """RLOO's own advantages reach TRL's loss; each rollout carries the version it was asked from and the
    version the server served, never more than max_staleness behind the trainer; after the run the server
    samples the trainer's weights."""
    trainer = build_trainer(async_recipe(server, "rloo", num_generations=4, max_steps=3), tmp_path)
    rounds = recording_rounds(trainer)
    trainer.train()
    assert trainer.state.global_step == 3
    assert len(rounds) >= 3
    for version, samples in rounds:
        columns = zip(*samples, strict=True)
        rewards, advantages, asked, served = (torch.tensor(column, dtype=torch.float64) for column in columns)
        assert torch.allclose(advantages, estimators.rloo_advantages(rewards, 4), atol=1e-6)
        assert (served >= asked).all() and (version - asked <= 1).all()
    logged = [entry for entry in trainer.state.log_history if "sample/staleness_max" in entry]
    assert len(logged) == 3 and all(entry["sample/staleness_max"] <= 1 for entry in logged)
    assert all(entry["rollout/server_policy_version"] >= 1 for entry in logged)
    assert trainer.generated_rollouts >= 3 * 8

    assert_server_samples_trainer_weights(server, trainer)


def test_dapo_without_dynamic_sampling_runs_off_policy_with_its_overlong_shaping(server, tmp_path):
    """DAPO's own events run asynchronously (its overlong metrics are logged) and give group-normalized rewards
    after the overlong penalty of each rollout's completion length (16-token cap, 8-token penalty band)."""
    recipe = async_recipe(server, "dapo", num_generations=4, max_steps=2, dynamic_sampling=False,
                          overlong_buffer_length=8)
    trainer = build_trainer(recipe, tmp_path)
    shaped = []
    compute = trainer.compute_advantages

    def record(rewards, output):
        advantages = compute(rewards, output)
        shaped.append((rewards, trainer.round.completion_lengths, advantages))
        return advantages

    trainer.compute_advantages = record
    trainer.train()
    assert trainer.state.global_step == 2 and shaped
    for rewards, lengths, advantages in shaped:
        penalty = estimators.overlong_penalty(lengths, 16, 8, 1.0)
        assert (penalty < 0).any()
        wanted = estimators.group_normalized_advantages(rewards + penalty, 4)
        assert torch.allclose(advantages, wanted, atol=1e-6)
    assert any("dapo/overlong_penalty_mean" in entry for entry in trainer.state.log_history)


def assert_server_samples_trainer_weights(server, trainer) -> None:
    """The server's log-probabilities of a fixed sequence are the trainer's (a LoRA adapter merged): TRL
    syncs after every step, the last one included."""
    ids = trainer.processing_class(SEQUENCE_TEXT)["input_ids"]
    wanted = model_logprobs(trainer.model, ids)  # the tree attention's padded path: a plain forward
    assert (server_logprobs(server.url, ids) - wanted).abs().max() < 1e-3


def test_lora_reaches_the_server_merged(server, tmp_path):
    # Two steps: PEFT starts lora_B at zero, so lora_A has no gradient before the second.
    recipe = async_recipe(server, "grpo", num_generations=4, max_steps=2, learning_rate=5e-2,
                          peft={"r": 8, "lora_alpha": 16})
    trainer = build_trainer(recipe, tmp_path)
    before = trainable_parameters(trainer)
    trainer.train()
    assert all("lora_" in name for name in before)
    assert_parameters_moved(before, trainer)
    assert_server_samples_trainer_weights(server, trainer)


@pytest.mark.parametrize(("algo", "settings", "says"), [
    ("dapo", {}, "set dynamic_sampling: false"),
    ("asyppo", {}, "critics"),
    ("reinforce_pp", {}, "set beta: 0"),
    ("poise", {"prompt_selection": True}, "set prompt_selection: false"),
])
def test_what_cannot_run_off_policy_is_one_line(server, tmp_path, algo, settings, says):
    with pytest.raises(RecipeError, match=says) as error:
        build_trainer(async_recipe(server, algo, **settings), tmp_path)
    assert "\n" not in str(error.value)


RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "toy" / "poise_async.yaml"


def poise_train(out: Path, overrides: dict) -> subprocess.Popen:
    command = [sys.executable, "-m", "poise_trl.cli.main", "train", str(RECIPE), "-o", str(out), "--no-progress",
               *(f"{key}={json.dumps(value)}" for key, value in overrides.items())]
    tests = str(Path(__file__).parent)  # the recipe's reward lives in tests/helpers.py
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))}
    # Its own session: kill -9 reaches the rollout worker TRL spawns too.
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def test_poise_train_async_killed_then_rerun_resumes(server, tmp_path):
    """`poise train recipes/toy/poise_async.yaml` (smaller, against the module's server): killed with -9 after
    its second checkpoint, the same command resumes from it and finishes, every step logged once, the
    staleness and the probe's feature pass logged."""
    max_steps = 6
    overrides = {"model": str(server.model), "rewards": [VARYING_REWARD], "vllm_server_base_url": server.url,
                 "dataset_size": 64, "per_device_train_batch_size": 8, "max_completion_length": 16,
                 "max_steps": max_steps, "save_steps": 2, "logging_steps": 1, "probe_bootstrap_steps": 2,
                 "probe_prompt_components": 4, "probe_response_components": 4, "eval_every": 0, "eval_limit": 8,
                 "eval_max_new_tokens": 8, "eval_num_samples": 1}
    out = tmp_path / "run"
    process = poise_train(out, overrides)
    deadline = time.time() + 300
    while not (out / "checkpoint-2" / CHECKPOINT_MARKER).exists():
        assert process.poll() is None, process.communicate()[1][-4000:]
        assert time.time() < deadline, "checkpoint-2 never appeared"
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    newest = max(int(p.parent.name.split("-")[1]) for p in out.glob(f"checkpoint-*/{CHECKPOINT_MARKER}"))
    assert newest < max_steps, "the run finished before it was killed"

    process = poise_train(out, overrides)
    stdout, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr[-4000:]
    assert f"resuming from checkpoint-{newest}" in stdout
    summary = json.loads((out / "summary.json").read_text())
    steps = [entry["step"] for entry in summary["train_log"] if "loss" in entry]
    assert steps == list(range(1, max_steps + 1))
    logged = [entry for entry in summary["train_log"] if "loss" in entry]
    assert all(entry["sample/staleness_max"] <= 1 and entry["probe/features_from_extra_pass"] == 1.0
               for entry in logged)
    assert (out / f"checkpoint-{newest}" / "rollout_state.json").exists()  # TRL's: the prompt index, the version


def test_server_killed_mid_run_is_one_line_and_rerun_resumes(random_model_dir, tmp_path):
    """Its vLLM server killed after checkpoint 2, an asynchronous run stops with one line that names the server
    and what a rerun does; the same recipe against a server started again at the same address resumes there."""
    from transformers import TrainerCallback

    from poise_trl.engines.vllm_server import LocalServer, VLLMServerError
    from poise_trl.run.train import train_from_recipe

    server = LocalServer(random_model_dir, tmp_path / "server.log")
    server.start()

    class KillServerAfterCheckpoint2(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == 2:
                server.stop()

    recipe = async_recipe(server, "grpo", num_generations=4, max_steps=4, save_strategy="steps", save_steps=2)
    out = tmp_path / "run"
    try:
        with pytest.raises(VLLMServerError) as error:
            train_from_recipe(recipe, str(out), show_progress=False, callbacks=[KillServerAfterCheckpoint2()])
        line = str(error.value)
        assert "\n" not in line and f"the vLLM server at {server.url} does not answer" in line
        assert line.endswith("the run resumes from checkpoint-2 (step 2)")
        assert (out / "checkpoint-2" / CHECKPOINT_MARKER).exists()
        server = LocalServer(random_model_dir, tmp_path / "server.log", port=server.port)
        server.start()
        summary = train_from_recipe(recipe, str(out), show_progress=False)
    finally:
        server.stop()
    assert summary["steps"] == 4 and summary["resumed_at_steps"] == [2]


# -- faults without a server -----------------------------------------------------------------


@contextmanager
def stand_in_server(hang_on_reload_s: float = 0.0):
    """An HTTP server in a thread that answers a vLLM server's health and control routes, and takes
    `hang_on_reload_s` to answer a weight reload: what the trainer sees of a server too slow to load weights."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Routes(BaseHTTPRequestHandler):
        def answer(self, body: dict) -> None:
            payload = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            try:
                self.wfile.write(payload)
            except BrokenPipeError:  # the trainer gave up waiting
                pass

        def do_GET(self):  # /health, /v1/models
            self.answer({"data": [{"id": "stand-in"}]})

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if b"reload_weights_from_file" in body:
                time.sleep(hang_on_reload_s)
            self.answer({"results": [True]})

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Routes)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()


def test_a_weight_reload_past_weight_sync_timeout_is_one_line():
    from poise_trl.engines.vllm_server import VLLMServerError, server_errors
    from poise_trl.seam.async_grpo import FileWeightTransfer

    with stand_in_server(hang_on_reload_s=5) as url:
        transfer = FileWeightTransfer(url, timeout=5, reload_timeout=1)
        transfer.init_weight_transfer()
        transfer.next_version = lambda: 1
        started = time.time()
        with pytest.raises(VLLMServerError) as error, server_errors(url, lambda: "the run resumes from checkpoint-4"):
            transfer.send_weights(iter([("weight", torch.ones(2))]))
        assert time.time() - started < 4  # tried once, not retried
        transfer.destroy()
    line = str(error.value)
    assert "\n" not in line and f"the vLLM server at {url} did not load the new weights in 1 s" in line
    assert "raise weight_sync_timeout" in line and line.endswith("the run resumes from checkpoint-4")


def test_a_failed_rollout_worker_is_one_line_naming_its_error():
    """TRL's worker check raises a generic RuntimeError chained to the worker's own; the line names the latter."""
    from poise_trl.engines.vllm_server import VLLMServerError, server_errors
    from poise_trl.seam.async_grpo import AsyncGRPOSeam

    class FailedWorker:
        def check_health(self, stale_after_s):
            cause = RuntimeError("KeyError: 'answer'\nTraceback (most recent call last): ...")
            raise RuntimeError("Rollout worker child has failed; see chained exception.") from cause

    with stand_in_server() as url:
        trainer = SimpleNamespace(rollout_worker=FailedWorker(), args=SimpleNamespace(
            vllm_server_base_url=url, vllm_server_timeout=5, heartbeat_stale_after_s=300))
        with pytest.raises(VLLMServerError) as error, server_errors(url, lambda: "the run starts over"):
            AsyncGRPOSeam.check_rollouts(trainer)
    assert str(error.value) == (f"the rollout worker stopped (KeyError: 'answer') while the vLLM server at {url} "
                                "answers: fix what it says; then run the same command: the run starts over")


def watch_then_die(event) -> None:
    """A rollout worker's child in miniature: a thread waits on the parent's stop Event, then the process dies."""
    threading.Thread(target=event.wait, daemon=True).start()
    time.sleep(1)
    os._exit(1)


class DiedUnnoticed:
    """A child process as `stop` may find it: dead, its exit not seen yet."""

    exitcode = None

    def __init__(self, process):
        self.process = process

    def __getattr__(self, name):
        return getattr(self.process, name)


def test_stopping_a_worker_whose_child_died_waiting_returns(monkeypatch):
    """TRL's stop sets the Event a dead child's watcher thread was waiting on, and `Event.set` then waits forever;
    ours gives it STOP_SECONDS and moves on (the server-killed test above meets it for real)."""
    import multiprocessing

    from accelerate import PartialState

    from poise_trl.seam import async_grpo

    PartialState()  # TRL's stop logs through accelerate
    context = multiprocessing.get_context("spawn")
    worker = async_grpo.StoppableWorker.__new__(async_grpo.StoppableWorker)  # only `stop` is under test
    worker._stop_event_mp = context.Event()
    child = context.Process(target=watch_then_die, args=(worker._stop_event_mp,))
    child.start()
    child.join(timeout=60)  # it registered as the Event's waiter, then died
    worker._process = DiedUnnoticed(child)
    monkeypatch.setattr(async_grpo, "STOP_SECONDS", 2.0)
    started = time.time()
    worker.stop()
    assert worker._process is None and time.time() - started < 10


def test_a_group_older_than_max_staleness_is_dropped_counted_and_named_once():
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

    from poise_trl.seam.async_grpo import RoundQueue

    source = queue.Queue()
    for group, version in enumerate([0, 2, 0, 2]):  # the trainer is at version 2, max_staleness 1
        for _ in range(2):
            source.put(RolloutSample(prompt="1+1=", completion="2", input_ids=np.array([1, 2, 3]),
                                     completion_mask=np.array([0, 1, 1]), old_log_probs=np.zeros(3), advantage=0.0,
                                     model_version=version, group_id=group, metrics={"reward": 1.0}))
    logged = []
    trainer = SimpleNamespace(num_generations=2, model_version=2, args=SimpleNamespace(max_staleness=1),
                              generated_rollouts=0, generated_tokens=0, score_groups=lambda groups: sum(groups, []),
                              log_metric=lambda name, value: logged.append((name, value)))
    rounds = RoundQueue(source, trainer, groups_per_round=1)
    with pytest.warns(UserWarning, match=r"dropped a group generated 2 policy versions before .*max_staleness 1"):
        taken = [rounds.get(timeout=1) for _ in range(4)]
    assert {sample.group_id for sample in taken} == {1, 3}
    assert rounds.dropped == 4 and logged == [("sample/dropped_stale_total", 2.0)] * 2
    assert trainer.generated_rollouts == 8 and trainer.generated_tokens == 16  # dropped ones count


# -- replayed rollouts: the asynchronous path computes what the synchronous one does -------------


def test_replayed_rollouts_give_the_synchronous_advantages_and_loss(tiny_random_model_dir, tmp_path):
    """The same rollouts (rewards, vLLM-style behaviour log-probs) through POISE's synchronous path (TRL's
    pass for the features, `compute_advantages`, TRL's GRPO loss) and its asynchronous one (`RoundQueue`'s
    `score_groups`, TRL's packed asynchronous loss) give the same advantages, probe fitted after the first
    round, and the same loss, to 1e-5. No server: the asynchronous trainer only talks to one in `train`."""
    from trl.experimental.async_grpo.async_grpo_trainer import DataCollatorForRollout
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample
    from trl.experimental.async_grpo.packing import TreeRow

    from poise_trl.seam.grpo import Round

    recipe = {"algo": "poise", "model": str(tiny_random_model_dir), "dataset": "toy-arith", "dataset_size": 16,
              "num_generations": 2, "per_device_train_batch_size": 8, "max_completion_length": 6, "max_steps": 1,
              "probe_bootstrap_steps": 1, "probe_prompt_components": 2, "probe_response_components": 2,
              "probe_buffer_rows": 64, "eval_every": 0, "seed": 0}
    sync = build_trainer(recipe, tmp_path / "sync")
    replay = build_trainer({**recipe, "async": True, "vllm_server_base_url": "http://127.0.0.1:9"},
                           tmp_path / "async")
    generator = torch.Generator().manual_seed(0)
    for round_index in range(3):
        prompts = [torch.randint(5, 60, (5 + i % 2,), generator=generator) for i in range(4) for _ in range(2)]
        completions = [torch.randint(5, 60, (2 + i % 5,), generator=generator) for i in range(8)]
        rewards = torch.randint(0, 2, (8,), generator=generator).float()
        output = replay.padded_rollouts([RolloutSample(
            None, None, torch.cat([p, c]).numpy(), np.array([0] * len(p) + [1] * len(c)), None, 0.0, 0, 0, {})
            for p, c in zip(prompts, completions, strict=True)])
        with torch.no_grad():  # behaviour log-probs: the policy's own, moved, so that the ratio is not 1
            logps = sync._no_grad_policy_pass(output)[0]
        old = logps + 0.05 * torch.randn(logps.shape, generator=generator)

        sync.round = Round([{"prompt": "p"}] * 8, weighted_rewards=rewards, rewards=rewards.tolist())
        sync.round.features, sync.round.feature_source = sync.round_features(output)
        wanted = sync.compute_advantages(rewards, output)
        samples = [RolloutSample("p", "c", torch.cat([p, c]).numpy(), np.array([0] * len(p) + [1] * len(c)),
                                 np.concatenate([np.zeros(len(p)), old[i, : len(c)].numpy()]).astype(np.float32),
                                 0.0, 0, i // 2, {"reward": float(rewards[i])})
                   for i, (p, c) in enumerate(zip(prompts, completions, strict=True))]
        got = torch.tensor([s.advantage for s in replay.score_groups([samples[i : i + 2] for i in range(0, 8, 2)])])
        assert (got - wanted).abs().max() < 1e-5, (round_index, got, wanted)
    assert replay.value_estimator.in_bootstrap is False  # the last rounds used the fitted probe

    sync.model.train(), replay.model.train()
    sync.current_gradient_accumulation_steps = replay.current_gradient_accumulation_steps = 1
    inputs = {**output, "advantages": wanted, "old_per_token_logps": old,
              "num_items_in_batch": output["completion_mask"].sum()}
    sync_loss = sync._compute_loss(sync.model, inputs).item()
    row = TreeRow()
    for sample in samples:
        row.add({"input_ids": torch.as_tensor(sample.input_ids), "advantage": sample.advantage,
                 "completion_mask": torch.as_tensor(sample.completion_mask), "group_id": sample.group_id,
                 "old_log_probs": torch.as_tensor(sample.old_log_probs), "metrics": sample.metrics})
    batch = DataCollatorForRollout(replay.processing_class.pad_token_id)([[row]])
    async_loss = replay.compute_loss(replay.model, batch).item()
    assert abs(sync_loss) > 1e-3  # something to agree on
    assert abs(sync_loss - async_loss) < 1e-5, (sync_loss, async_loss)
