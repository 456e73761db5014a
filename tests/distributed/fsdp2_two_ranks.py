"""Run by tests/test_fsdp.py under `torchrun --nproc_per_node 2` (CPU, gloo): the POISE feature hook
and one training step with TRL's fused LM head on a model sharded by FSDP2 (`fully_shard` on every
decoder block and the root, as accelerate's fsdp2.yaml does), against the same model unsharded.

accelerate's own FSDP path needs GPUs (its MULTI_CPU state never enables FSDP), so this applies
`fully_shard` directly: the sharding accelerate would apply, not its launcher."""

import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM
from trl.trainer.utils import add_fused_lm_head

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_features import THINK, make_batch  # noqa: E402

from poise_trl.probe.capture import extract_features  # noqa: E402

LAYER = 0.55  # the recipes' probe_layer: block 1 of 2


def train_step(model, optimizer, batch) -> None:
    """One SGD step on TRL's fused-head log-probs of the completions (what GRPO's loss differentiates).
    SGD, not AdamW: Adam's first step moves every weight by +-lr whatever its gradient's size, so
    rounding noise on a zero gradient would hide whether the sharded gradient equals the reference."""
    prompt_ids, prompt_mask, completion_ids, completion_mask = batch
    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    attention_mask = torch.cat([prompt_mask, completion_mask], 1)
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, : prompt_ids.shape[1]] = -100
    log_probs = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True).log_probs
    (-(log_probs.sum() / completion_mask.sum())).backward()
    optimizer.step()


def full_state(model) -> dict[str, torch.Tensor]:
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone().contiguous()
            for name, p in model.named_parameters()}


def main(model_dir: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    batch = make_batch()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    reference = copy.deepcopy(model)  # before patching: the fused head's closure holds the model it patched
    for net in (model, reference):
        add_fused_lm_head(net, outputs=("log_probs", "entropy"))

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    weight = model.model.layers[0].mlp.up_proj.weight
    assert isinstance(weight, DTensor) and weight.to_local().shape[0] * 2 == weight.shape[0], "not sharded"

    # Optimizers are built while the parameters are sharded, as accelerate's prepare does: after a
    # forward, FSDP2 leaves the root's parameters unsharded, and an optimizer built then would
    # step throw-away copies of the embedding and final norm.
    optimizers = {net: torch.optim.SGD(net.parameters(), lr=0.5) for net in (reference, model)}
    results = {}
    for name, net in (("reference", reference), ("sharded", model)):
        feats = extract_features(net, *batch, THINK, LAYER, batch_size=4)
        (layer, f), = feats.items()
        for part in ("prompt", "response", "entropy"):
            results[f"{name}.{part}"] = getattr(f, part)
        train_step(net, optimizers[net], batch)
        for key, value in full_state(net).items():
            results[f"{name}.after_step.{key}"] = value
        after = extract_features(net, *batch, THINK, LAYER, batch_size=4)[layer]
        results[f"{name}.after_step.response_features"] = after.response
    save_file({k: v.contiguous() for k, v in results.items()}, str(Path(out) / f"rank{rank}.safetensors"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
