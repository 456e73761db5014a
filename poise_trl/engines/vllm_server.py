"""Training against a vLLM server (`vllm_mode: server`): the server poise-trl starts, the worker side of the
weight sync where there is no GPU (the trainer side is `seam.vllm`), and one error line when the server stops
answering.

`python -m poise_trl.engines.vllm_server --model MODEL --port PORT [vllm serve options]` runs vLLM's
OpenAI server with `trl vllm-serve`'s additions and this module's worker extension. Without a GPU the
trainer writes the weights to one safetensors file that every worker reloads (`WeightReload`), so server
and trainer share a file system. docs/engines.md ("vLLM server mode"). vLLM's workers import this module
(for `WeightReload`): TRL and the task registry are imported only where they are used.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file

from poise_trl.core.loading import resolve_model_path

WEIGHTS_FILE = "model.safetensors"
RELOAD_METHOD = "reload_weights_from_file"


class VLLMServerError(ValueError):
    """The vLLM server a run trains against cannot be used (not answering, or not started by this module).
    A ValueError, so the CLI reports it in one `error:` line."""


class ServerFault(RuntimeError):
    """Training against a server stopped mid-run for a reason the raiser names, with its fix; `server_errors`
    adds what rerunning does."""


class WeightReload:
    """vLLM worker extension (`--worker-extension-cls poise_trl.engines.vllm_server.WeightReload`): the worker
    methods `/collective_rpc` calls to reload weights on a machine without NCCL."""

    def reload_weights_from_file(self, path: str, policy_version: str = "") -> None:
        # vLLM's reload repacks every layer it loads for the CPU kernels (vLLM's own `reload_weights`).
        self.model_runner.reload_weights(weights_iterator=iter(load_file(path).items()))
        refresh_tied_output_layers(self.model_runner.get_model())
        self.policy_version = int(policy_version) if policy_version else None

    def served_policy_version(self) -> int | None:
        """The trainer's policy version of the weights last reloaded (the asynchronous trainer names one)."""
        return getattr(self, "policy_version", None)

    def can_reload_weights_from_file(self) -> bool:
        return True


def refresh_tied_output_layers(model) -> None:
    """Repack every embedding-like layer from its current weight after a reload (a no-op on a GPU).

    A tied LM head loads nothing of its own, so on a CPU its matmul would keep the old weights packed at load.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod  # noqa: PLC0415 (optional)

    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, UnquantizedEmbeddingMethod) and module.weight.numel():
            method.process_weights_after_loading(module)


def server_url(args) -> str | None:
    """The vLLM server GRPOTrainer's config trains against (None: not server mode)."""
    if not (getattr(args, "use_vllm", False) and args.vllm_mode == "server"):
        return None
    return args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}"


def short_reason(exc: BaseException) -> str:
    """The socket error under requests' nested wrappers ("Connection refused"), else the error's first line."""
    text = str(exc)
    found = re.search(r"\[Errno -?\d+\] ([^'\")]+)", text)
    first_line = text.splitlines()[0][:160] if text else ""
    return found.group(1).strip() if found else f"{exc.__class__.__name__}: {first_line}"


@contextmanager
def server_errors(url: str | None, rerun_outcome, server: LocalServer | None = None):
    """A vLLM server that does not answer, or a `ServerFault`, as one VLLMServerError line that says what
    rerunning the same command does (`rerun_outcome()`, called when the error happens: the checkpoints written
    until then count). `server`: the one `poise train` started (a rerun starts another), else the user's."""
    if url is None:
        yield
        return
    from requests.exceptions import RequestException  # noqa: PLC0415 (comes with vLLM, not by default)

    try:
        yield
    except ServerFault as exc:
        raise VLLMServerError(f"{exc}; then run the same command: {rerun_outcome()}") from None
    except RequestException as exc:
        restart = (f"its output is in {server.log}; running the same command starts a new one" if server else
                   "start it again (python -m poise_trl.engines.vllm_server) and run the same command")
        raise VLLMServerError(f"the vLLM server at {url} does not answer ({short_reason(exc)}); {restart}: "
                              f"{rerun_outcome()}") from None


def serve_command(model: str, host: str, port: int, extra_args: list[str]) -> list[str]:
    """The server command line: vLLM's OpenAI server with TRL's settings and the weight-reload extension."""
    from poise_trl.engines import generation  # noqa: PLC0415 (no tasks in vLLM's workers)

    distribution = generation.vllm_distribution()
    if distribution is not None and distribution[0] == "vllm":
        entry = ["-m", "vllm.entrypoints.cli.main", "serve", model]
    else:  # the CPU build's `vllm` command fails at start (see the module docstring)
        entry = ["-m", "vllm.entrypoints.openai.api_server", "--model", model]
    command = [sys.executable, *entry, "--host", host, "--port", str(port),
               "--worker-extension-cls", "poise_trl.engines.vllm_server.WeightReload",
               "--logprobs-mode", "processed_logprobs",  # what TRL's importance-sampling correction needs
               "--max-logprobs", "-1"]
    if torch.cuda.is_available():
        command += ["--weight-transfer-config", json.dumps({"backend": "nccl"})]
    else:  # the trainer's dtype, not vLLM's CPU default (bfloat16): the sampler and the learner agree
        command += ["--dtype", generation.checkpoint_dtype(model), *whole_prefills(model, extra_args)]
    return command + extra_args


def whole_prefills(model: str, extra_args: list[str]) -> list[str]:
    """vLLM options that schedule every prefill whole, in a token budget that holds the longest sequence.

    A prefill split across scheduler steps rewinds its request's seeded sampler, which a CPU torch Generator
    cannot ("CPU Generator does not use offset" kills the CPU build's engine), and TRL's asynchronous worker
    seeds every request. Options the user gives win."""
    if any(option.split("=")[0] in ("--max-num-batched-tokens", "--enable-chunked-prefill",
                                    "--no-enable-chunked-prefill") for option in extra_args):
        return []
    given = [value for option, value in zip(extra_args, extra_args[1:], strict=False) if option == "--max-model-len"]
    config = Path(model) / "config.json"
    longest = int(given[0]) if given else (
        json.loads(config.read_text()).get("max_position_embeddings", 2048) if config.is_file() else 2048)
    return ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(2048, longest))]


class LocalServer:
    """This module's server on a free local port, in its own process group (the engine core is a child),
    its output in `log`: what `poise train` starts for `async: true` without a server URL, and stops after.
    `port`: a given one (a server restarted where a recipe's URL points)."""

    def __init__(self, model: str | Path, log: Path, start_seconds: float = 300.0, port: int | None = None):
        self.model, self.log, self.start_seconds, self.port = model, log, start_seconds, port
        if port is None:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = None

    def start(self) -> None:
        command = [sys.executable, "-m", "poise_trl.engines.vllm_server", "--model", str(self.model),
                   "--port", str(self.port)]
        with open(self.log, "a") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + self.start_seconds
        while not self.answers():
            if self.process.poll() is not None or time.time() > deadline:
                self.stop()
                raise VLLMServerError(f"the vLLM server for {self.model} did not start in {self.start_seconds:.0f} "
                                      f"s (its output: {self.log}); fix what it says, or start one yourself and "
                                      "give its URL as vllm_server_base_url")
            time.sleep(1)

    def answers(self) -> bool:
        import requests  # noqa: PLC0415 (comes with vLLM)

        try:
            return requests.get(f"{self.url}/health", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()

    def __enter__(self) -> LocalServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    from poise_trl.engines.generation import prepare_vllm_environment  # noqa: PLC0415 (no tasks in vLLM's workers)

    parser = argparse.ArgumentParser(
        prog="python -m poise_trl.engines.vllm_server",
        description="Serve a model with vLLM for `vllm_mode: server` training (other options go to vLLM).")
    parser.add_argument("--model", required=True, help="Model folder or hub id (the recipe's `model`).")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args, extra_args = parser.parse_known_args(argv)
    model = resolve_model_path(args.model)
    prepare_vllm_environment()
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # /collective_rpc and /reset_prefix_cache live behind it
    command = serve_command(model, args.host, args.port, extra_args)
    os.execv(sys.executable, command)


if __name__ == "__main__":
    main()
