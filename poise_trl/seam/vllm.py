"""The seam to TRL's vLLM server mode (`VLLMGeneration`, `VLLMClient`): on a machine without CUDA the trainer
writes the weights to one safetensors file that every vLLM worker reloads (`engines.vllm_server.WeightReload`),
so server and trainer share a file system. docs/engines.md ("vLLM server mode").
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from contextlib import contextmanager
from pathlib import Path

from safetensors.torch import save_file

from poise_trl.engines.vllm_server import RELOAD_METHOD, WEIGHTS_FILE, VLLMServerError, short_reason


def file_weight_sync_generation():
    """TRL's `VLLMGeneration` whose server mode, on a machine without CUDA, syncs through a file. Defined on
    demand: TRL's generation modules import vLLM, which a run without it must not need."""
    from trl.generation.vllm_client import VLLMClient  # noqa: PLC0415 (TRL's generation modules import vLLM)
    from trl.generation.vllm_generation import VLLMGeneration  # noqa: PLC0415 (likewise)

    class FileSyncVLLMGeneration(VLLMGeneration):
        def _syncs_through_file(self) -> bool:
            return self.mode == "server" and self.accelerator.device.type != "cuda"

        def _init_vllm(self):
            if not self._syncs_through_file():
                return super()._init_vllm()
            if self.accelerator.is_main_process:
                base_url = self.server_base_url or f"http://{self.server_host}:{self.server_port}"
                self.vllm_client = VLLMClient(base_url=base_url, connection_timeout=self.server_timeout)
                require_weight_reload(self.vllm_client)
                self.weights_dir = tempfile.mkdtemp(prefix="poise-vllm-weights-")
                weakref.finalize(self, shutil.rmtree, self.weights_dir, True)
            self.accelerator.wait_for_everyone()

        def sync_weights(self):
            if not self._syncs_through_file():
                return super().sync_weights()
            # Every process walks the parameters (gathering sharded ones is collective); clones, because
            # TRL unmerges a LoRA adapter once the walk ends.
            weights = {name: tensor.detach().to("cpu").contiguous().clone()
                       for name, tensor in self._iter_named_params()}
            if self.accelerator.is_main_process:
                push_weights_through_file(self.vllm_client, weights, Path(self.weights_dir) / WEIGHTS_FILE)

    return FileSyncVLLMGeneration


def collective_rpc(client, method: str, *args: str, timeout: float | None = None) -> list:
    """`method` of our worker extension on every vLLM worker, tried once: TRL's client session would send a
    reload that timed out again while the first may still be loading."""
    import requests  # noqa: PLC0415 (comes with vLLM)

    answer = requests.post(f"{client.base_url}/collective_rpc", json={"method": method, "args": list(args)},
                           timeout=timeout)
    if answer.status_code != 200:
        raise RuntimeError(f"/collective_rpc {method}: {answer.status_code} {answer.text[:200]}")
    return answer.json()["results"]


def require_weight_reload(client) -> None:
    try:
        collective_rpc(client, "can_reload_weights_from_file")
    except Exception as exc:  # 404 without dev mode, 500 without the extension: TRL's client raises Exception
        raise VLLMServerError(
            f"the vLLM server at {client.base_url} cannot take new weights without a GPU ({short_reason(exc)}): "
            "start it with `python -m poise_trl.engines.vllm_server --model MODEL --port PORT`, which adds "
            "poise-trl's weight-reload extension") from None


def push_weights_through_file(client, weights: dict, path: Path, policy_version: int | None = None,
                              timeout: float | None = None) -> None:
    save_file(weights, str(path))
    collective_rpc(client, RELOAD_METHOD, str(path), *([] if policy_version is None else [str(policy_version)]),
                   timeout=timeout)
    client.reset_prefix_cache()  # cached prefixes hold the old weights' keys and values


@contextmanager
def server_generation(args):
    """While a trainer is built: TRL's GRPOTrainer builds its `VLLMGeneration` by the name in its own
    module, so server mode gets the file-sync subclass there for the construction only."""
    if not (getattr(args, "use_vllm", False) and args.vllm_mode == "server"):
        yield
        return
    import trl.trainer.grpo_trainer as grpo_trainer  # noqa: PLC0415 (imports vLLM where it is installed)

    original = grpo_trainer.VLLMGeneration
    grpo_trainer.VLLMGeneration = file_weight_sync_generation()
    try:
        yield
    finally:
        grpo_trainer.VLLMGeneration = original
