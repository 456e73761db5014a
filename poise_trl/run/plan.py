"""`poise plan`: per-GPU memory of a recipe from the model's config alone, and whether it fits.

Bytes per GPU for one training micro-batch: weights, gradients and optimizer state under the launch's
sharding, activations, TRL's fused LM head, vLLM's colocate share, a KL reference and the algorithm's own
items (`Algorithm.memory_items`). The total slightly overestimates the peak (`tests/test_plan.py`).
Each item's rule: docs/multi-gpu.md ("What the plan counts").
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml
from huggingface_hub import hf_hub_download
from transformers import AutoConfig, AutoModelForCausalLM

from poise_trl.core.loading import BUNDLED_DATA, resolve_model_path
from poise_trl.run.recipe import RecipeError, RunPlan

GIB = 2**30
STORED_CONFIGS = BUNDLED_DATA / "model_configs"
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DEFAULT_PROMPT_LENGTH = 512  # tokens of chat template + question; DAPO-Math prompts are mostly shorter
CUDA_RUNTIME_BYTES = int(1.5 * GIB)  # CUDA context, cuBLAS workspaces, NCCL buffers (an assumption, not measured here)
LM_HEAD_TOKEN_TILE, LM_HEAD_VOCAB_TILE = 4096, 32768  # trl.kernels.chunked_logprob tile shape
SHARDINGS = ("single", "ddp", "fsdp2", "fsdp2_shard_grad_op", "zero1", "zero2", "zero3")


@dataclass(frozen=True)
class Sharding:
    """How a launch places the model on its GPUs (read from an accelerate config or its environment)."""

    kind: str = "single"
    mixed_precision: str | None = None  # "bf16", "fp16", "no"; None: follow the recipe's bf16 key
    offload_optimizer: bool = False
    offload_params: bool = False
    num_processes: int | None = None

    def __post_init__(self):
        if self.kind not in SHARDINGS:
            raise ValueError(f"unknown sharding {self.kind!r}; expected one of {', '.join(SHARDINGS)}")

    @property
    def label(self) -> str:
        return {"single": "one process", "ddp": "DDP", "fsdp2": "FSDP2 full shard",
                "fsdp2_shard_grad_op": "FSDP2 (no reshard after forward)", "zero1": "DeepSpeed ZeRO-1",
                "zero2": "DeepSpeed ZeRO-2", "zero3": "DeepSpeed ZeRO-3"}[self.kind]


def _true(value) -> bool:
    return str(value).lower() in ("true", "1", "yes")


def sharding_from_accelerate_config(path: str | Path) -> Sharding:
    """Read `distributed_type`, `fsdp_config` / `deepspeed_config` and `mixed_precision` from an accelerate config."""
    path = Path(resolve_model_path(str(path)))  # recipes name a shipped one as recipes/accelerate/NAME.yaml
    if not path.is_file():
        raise RecipeError(f"accelerate config {str(path)!r} not found (shipped ones: recipes/accelerate/*.yaml)")
    config = yaml.safe_load(path.read_text()) or {}
    kind_of = {"NO": "single", "MULTI_GPU": "ddp", "MULTI_CPU": "ddp", "FSDP": "fsdp2", "DEEPSPEED": "zero2"}
    distributed = str(config.get("distributed_type", "NO")).upper()
    if distributed not in kind_of:
        raise RecipeError(f"{path}: distributed_type {distributed!r} is not planned; use NO, MULTI_GPU, FSDP or "
                          "DEEPSPEED")
    kind, offload_optimizer, offload_params = kind_of[distributed], False, False
    if distributed == "FSDP":
        fsdp = config.get("fsdp_config") or {}
        if int(fsdp.get("fsdp_version", 1)) != 2:
            raise RecipeError(f"{path}: only FSDP2 is planned; set fsdp_config.fsdp_version: 2")
        kind = "fsdp2" if _true(fsdp.get("fsdp_reshard_after_forward", True)) else "fsdp2_shard_grad_op"
        offload_optimizer = offload_params = _true(fsdp.get("fsdp_offload_params", False))
    if distributed == "DEEPSPEED":
        deepspeed = config.get("deepspeed_config") or {}
        kind = f"zero{int(deepspeed.get('zero_stage', 2))}"
        if kind == "zero0":
            kind = "ddp"
        offload_optimizer = str(deepspeed.get("offload_optimizer_device", "none")).lower() in ("cpu", "nvme")
        offload_params = str(deepspeed.get("offload_param_device", "none")).lower() in ("cpu", "nvme")
    for key in ("num_processes", "num_machines"):  # GPUs over all machines, machines
        value = config.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise RecipeError(f"{path}: {key}: {value!r} is not a count: give {key} >= 1")
    processes = config.get("num_processes")
    return Sharding(kind, config.get("mixed_precision"), offload_optimizer, offload_params,
                    int(processes) if processes else None)


def sharding_from_environment(environ=os.environ) -> Sharding:
    """The sharding `accelerate launch` exported to this process (plain torchrun: DDP)."""
    processes = int(environ.get("WORLD_SIZE", "1"))
    mixed = environ.get("ACCELERATE_MIXED_PRECISION")
    if _true(environ.get("ACCELERATE_USE_DEEPSPEED", "false")):
        stage = int(environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2"))
        kind = f"zero{stage}" if stage else "ddp"
        offload_optimizer = environ.get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "none") in ("cpu", "nvme")
        offload_params = environ.get("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "none") in ("cpu", "nvme")
        return Sharding(kind, mixed, offload_optimizer, offload_params, processes)
    if _true(environ.get("ACCELERATE_USE_FSDP", "false")):
        reshard = _true(environ.get("FSDP_RESHARD_AFTER_FORWARD", "true"))
        offload = _true(environ.get("FSDP_OFFLOAD_PARAMS", "false"))
        return Sharding("fsdp2" if reshard else "fsdp2_shard_grad_op", mixed, offload, offload, processes)
    return Sharding("ddp" if processes > 1 else "single", mixed, num_processes=processes)


def parse_memory(text: str) -> int:
    """'80GB', '80GiB', '141G' -> bytes. GPU memory is sold in binary units (an "80GB" H100 has
    81,559 MiB), so GB counts 2^30 bytes here; MB 2^20."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*(GB|GiB|G|MB|MiB|M)?\s*", str(text), re.IGNORECASE)
    if not match:
        raise ValueError(f"cannot read GPU memory {text!r}; write it like 80GB or 141GiB")
    value, unit = float(match.group(1)), (match.group(2) or "GB").lower()
    scale = GIB if unit in ("gb", "g", "gib") else 2**20
    return int(value * scale)


def load_model_config(model: str) -> dict:
    """config.json of a local folder, of the stored copy in data/model_configs/<org>--<name>/, or from the hub
    (config.json only: the weights are never downloaded)."""
    for folder in (Path(model), Path(resolve_model_path(model)), STORED_CONFIGS / model.replace("/", "--")):
        if (folder / "config.json").is_file():
            return json.loads((folder / "config.json").read_text())
    try:
        return json.loads(Path(hf_hub_download(model, "config.json")).read_text())
    except Exception as exc:  # offline, unknown repo, gated: all end in the same advice
        raise RecipeError(
            f"cannot read the config of model {model!r} ({exc.__class__.__name__}): give a local folder with a "
            f"config.json, or store one in data/model_configs/{model.replace('/', '--')}/config.json"
        ) from None


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs from a decoder-only config; parameter counts come from a meta-device instance."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    qk_norm: bool
    parameters: int
    layer_parameters: int
    lm_head_parameters: int
    tied_embeddings: bool
    config_dtype: str

    @classmethod
    def from_config(cls, config: dict) -> ModelShape:
        return _shape_from_json(json.dumps(config, sort_keys=True))

    @classmethod
    def _from_config(cls, config: dict) -> ModelShape:
        model_type = config.get("model_type")
        try:
            hf_config = AutoConfig.for_model(**config)
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(hf_config)
        except (ValueError, KeyError, TypeError) as exc:
            raise RecipeError(f"cannot plan a {model_type!r} model: {exc}") from None
        layers = model.get_decoder().layers
        head = model.get_output_embeddings()
        text = hf_config.get_text_config()
        heads = text.num_attention_heads
        return cls(
            vocab_size=text.vocab_size,
            hidden_size=text.hidden_size,
            num_layers=text.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
            intermediate_size=text.intermediate_size,
            qk_norm=hasattr(layers[0].self_attn, "q_norm"),
            parameters=sum(p.numel() for p in model.parameters()),
            layer_parameters=max(sum(p.numel() for p in layer.parameters()) for layer in layers),
            lm_head_parameters=head.weight.numel(),
            tied_embeddings=head.weight is model.get_input_embeddings().weight,
            config_dtype=str(config.get("torch_dtype") or config.get("dtype") or "float32"),
        )

    def lora_parameters(self, rank: int) -> int:
        """LoRA on every linear of every block (peft's "all-linear"): r x (in + out) per projection."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        h, f = self.hidden_size, self.intermediate_size
        per_layer = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + f) + (f + h)
        return rank * per_layer * self.num_layers


@functools.lru_cache(maxsize=16)
def _shape_from_json(text: str) -> ModelShape:
    """Building even a meta-device 4B model takes a fraction of a second: once per config."""
    return ModelShape._from_config(json.loads(text))


@functools.lru_cache(maxsize=16)
def _model_shape(model: str) -> ModelShape:
    """An algorithm's extra model (a critic), read once: `suggest` builds dozens of plans."""
    return ModelShape.from_config(load_model_config(model))


def layer_activation_bytes(shape: ModelShape, tokens: int, compute: int, residual: int) -> int:
    """Bytes autograd saves in one Qwen2/Qwen3/Llama decoder block for `tokens` tokens.

    `compute`: bytes of a matmul output (2 under bf16 autocast); `residual`: of the residual stream. SDPA runs
    a flash kernel (CUDA and CPU), which keeps no (heads, S, S) scores.
    """
    h, f = shape.hidden_size, shape.intermediate_size
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    norm = 4 + residual + compute
    qk_chain = (4 + 4 * compute) if shape.qk_norm else 3 * compute
    per_token = 2 * norm * h + qk_chain * (q + kv) + compute * kv + 2 * compute * q + 4 * compute * f
    return tokens * per_token


def lm_head_bytes(shape: ModelShape, tokens: int, compute: int, residual: int, device: str = "cuda",
                  weight_grad: bool = True) -> int:
    """TRL's fused LM head (trl.kernels.chunked_logprob): a 4096 x 32768 tile, per-token stats, grads.

    Without Triton (the CPU) `_backward_tile` adds 8 fp32 temporaries of the tile's used width and a mask.
    """
    tile = min(tokens, LM_HEAD_TOKEN_TILE) * LM_HEAD_VOCAB_TILE * compute
    forward = tokens * shape.hidden_size * residual + tile + 9 * 4 * tokens
    backward = tokens * shape.hidden_size * 4 + (shape.lm_head_parameters * 4 if weight_grad else 0)
    if device == "cpu":
        backward += min(tokens, LM_HEAD_TOKEN_TILE) * min(shape.vocab_size, LM_HEAD_VOCAB_TILE) * (8 * 4 + 1)
    return forward + backward


@dataclass
class PlanItem:
    name: str
    bytes: int
    note: str = ""


@dataclass
class MemoryPlan:
    items: list[PlanItem]
    gpu_bytes: int
    gpus: int
    sharding: Sharding
    model: str
    parameters: int
    tokens_per_micro_batch: int
    suggestions: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(item.bytes for item in self.items)

    @property
    def fits(self) -> bool:
        return self.total <= self.gpu_bytes

    def verdict(self) -> str:
        head = (f"{self.model} on {self.gpus} GPU(s) of {self.gpu_bytes / GIB:.1f} GiB, {self.sharding.label}: "
                f"{self.total / GIB:.1f} GiB per GPU")
        if self.fits:
            return f"{head}: fits ({(self.gpu_bytes - self.total) / GIB:.1f} GiB to spare)"
        fixes = "; ".join(self.suggestions) if self.suggestions else "no single change found: shorten the sequences"
        return f"{head}: does NOT fit. It fits with: {fixes}"


@dataclass
class PlanInputs:
    """The recipe values the plan reads (trainer-config defaults filled in)."""

    model: str
    rows: int
    prompt_length: int
    completion_length: int
    gradient_checkpointing: bool
    bf16: bool
    load_dtype: str
    use_vllm: bool
    vllm_mode: str
    vllm_gpu_memory_utilization: float
    beta: float
    peft_rank: int | None
    # the algorithm's own items (`Algorithm.memory_items` bound to the recipe's values), given a PlanView
    algorithm_items: Callable[[PlanView], list[tuple[str, int, str]]] | None = None
    # A recipe with tools (`tool_context`): the schema TRL renders into every prompt, the turn and result limits
    tool_schema_tokens: int = 0
    tool_turns: int = 0
    tool_result_tokens: int = 0


@dataclass(frozen=True)
class PlanView:
    """What an algorithm's memory items see of the plan being built (`Algorithm.memory_items`)."""

    inputs: PlanInputs
    sequence: int  # prompt + completion tokens of one row
    autocast: bool  # bf16/fp16 autocast on the GPU

    def model_shape(self, model: str) -> ModelShape:
        return _model_shape(model)

    def dtype_bytes(self, dtype: str) -> int:
        return DTYPE_BYTES[dtype]

    def activation_bytes(self, shape: ModelShape, tokens: int, compute: int, residual: int) -> int:
        """Saved activations of a whole model's forward over `tokens` (checkpointed: block inputs + one
        block)."""
        layer = layer_activation_bytes(shape, tokens, compute, residual)
        if self.inputs.gradient_checkpointing:
            return shape.num_layers * tokens * shape.hidden_size * residual + layer
        return shape.num_layers * layer


def plan_inputs(plan: RunPlan, prompt_length: int = DEFAULT_PROMPT_LENGTH,
                completion_length: int | None = None) -> PlanInputs:
    """What the recipe asks for (not what this machine would run: a CPU machine plans a GPU launch)."""
    settings, value = plan.settings, plan.requested
    load_dtype = (value("model_init_kwargs") or {}).get("dtype", "float32")  # TRL's create_model_from_path default
    rows = int(value("per_device_train_batch_size"))
    memory_items = plan.algorithm.memory_items
    return PlanInputs(
        model=settings.model, rows=rows, prompt_length=prompt_length,
        completion_length=int(completion_length or value("max_completion_length")),
        gradient_checkpointing=bool(value("gradient_checkpointing")), bf16=bool(value("bf16")),
        load_dtype=str(load_dtype), use_vllm=bool(value("use_vllm")), vllm_mode=str(value("vllm_mode")),
        vllm_gpu_memory_utilization=float(value("vllm_gpu_memory_utilization") or 0.0),
        beta=float(value("beta") or 0.0), peft_rank=int(settings.peft.get("r", 8)) if settings.peft else None,
        algorithm_items=functools.partial(memory_items, value) if memory_items else None,
        **(tool_context(plan) if settings.tools or settings.environment else {}),
    )


def tool_context(plan: RunPlan) -> dict:
    """What a recipe's tools add to a row (docs/multi-gpu.md, "Multi-turn rollouts"): the tokens of their schema
    in the prompt (TRL renders it into every prompt; measured with the model's tokenizer and the template TRL's tool
    loop renders with, 0 where the tokenizer cannot be read here) and the limits of the turns that follow it. TRL
    keeps every turn's generation and tool result within max_completion_length, so the completion stays that."""
    from poise_trl.core.loading import load_tokenizer  # noqa: PLC0415 - TRL's chat templates: only for tools
    from poise_trl.evaluation.agent import RecipeTools, Toolbox  # noqa: PLC0415

    settings = plan.settings
    limits = RecipeTools((settings.tools,) if isinstance(settings.tools, str) else tuple(settings.tools or ()),
                         settings.environment, int(plan.requested("max_tool_calling_iterations")),
                         settings.tool_result_tokens, settings.tool_timeout)
    schema = 0
    try:
        tokenizer = load_tokenizer(resolve_model_path(settings.model))
    except (OSError, ValueError):
        tokenizer = None
    if tokenizer is not None:
        toolbox = Toolbox(tokenizer, limits)
        question = [{"role": "user", "content": "?"}]
        with_tools, without = (len(tokenizer(tokenizer.apply_chat_template(question, tokenize=False,
                                                                           add_generation_prompt=True, **kwargs),
                                             add_special_tokens=False)["input_ids"])
                               for kwargs in (toolbox.template_kwargs, {}))
        schema = with_tools - without
        toolbox.close()
    return {"tool_schema_tokens": schema, "tool_turns": limits.max_turns, "tool_result_tokens": limits.result_tokens}


def _dtype_bytes(name: str, shape: ModelShape) -> int:
    return DTYPE_BYTES.get(shape.config_dtype if name == "auto" else name, 4)


def build_plan(inputs: PlanInputs, shape: ModelShape, *, gpus: int, gpu_bytes: int, sharding: Sharding,
               device: str = "cuda") -> MemoryPlan:
    """Per-GPU bytes of every item; `device="cpu"` plans the CPU run (no CUDA runtime, no vLLM,
    no autocast) for the self-check."""
    P, n = shape.parameters, max(1, gpus)
    mixed = sharding.mixed_precision if sharding.mixed_precision is not None else ("bf16" if inputs.bf16 else "no")
    autocast = mixed in ("bf16", "fp16") and device != "cpu"
    load = _dtype_bytes(inputs.load_dtype, shape)
    deepspeed = sharding.kind.startswith("zero")
    fsdp = sharding.kind.startswith("fsdp2")
    if deepspeed and autocast:
        weight_bytes, grad_bytes, optim_bytes = 2, 2, 12  # bf16 model and grads; fp32 master + moments
    elif fsdp and autocast:
        weight_bytes, grad_bytes, optim_bytes = 4, 4, 8  # accelerate upcasts trainable params to fp32 masters
    else:
        weight_bytes, grad_bytes, optim_bytes = load, load, 2 * load  # torch AdamW keeps moments in the param dtype
    compute = 2 if autocast else load
    residual = 2 if (autocast and (deepspeed or fsdp)) else load

    shard_weights = sharding.kind in ("zero3", "fsdp2", "fsdp2_shard_grad_op")
    shard_grads = shard_weights or sharding.kind == "zero2"
    shard_optim = shard_grads or sharding.kind == "zero1"
    items: list[PlanItem] = []
    trainable = shape.lora_parameters(inputs.peft_rank) if inputs.peft_rank else P
    weights = (P / n if shard_weights else P) * weight_bytes
    note = f"{P / 1e9:.2f}B params x {weight_bytes} B" + (f" / {n} GPUs" if shard_weights else "")
    if shard_weights and sharding.offload_params:
        weights, note = 0, "offloaded to CPU"
    if shard_weights:
        # Blocks are all-gathered one at a time (plus one prefetched) in the compute dtype; FSDP2's root
        # unit (embedding, LM head, final norm) stays gathered from its forward to the end of backward.
        gathered = 2 * shape.layer_parameters * compute
        if fsdp:
            gathered += shape.lm_head_parameters * (1 if shape.tied_embeddings else 2) * compute
        if sharding.kind == "fsdp2_shard_grad_op":
            gathered = P * compute  # parameters stay unsharded between forward and backward
        weights += gathered
        note += f" + {gathered / GIB:.1f} GiB gathered"
    if inputs.peft_rank:
        weights = P * load + trainable * 4
        note = f"frozen base {P / 1e9:.2f}B x {load} B + LoRA r={inputs.peft_rank} ({trainable / 1e6:.1f}M, fp32)"
    items.append(PlanItem("weights", int(weights), note))
    sharded = shard_grads and not inputs.peft_rank
    grad_total = trainable * (4 if inputs.peft_rank else grad_bytes) / (n if sharded else 1)
    items.append(PlanItem("gradients", int(grad_total), f"{grad_bytes if not inputs.peft_rank else 4} B per trainable "
                          f"param" + (f" / {n}" if sharded else "")))
    optim = trainable * (8 if inputs.peft_rank else optim_bytes) / (n if shard_optim and not inputs.peft_rank else 1)
    optim_note = "AdamW: " + ("fp32 master + 2 moments" if optim_bytes == 12 else f"2 moments x {optim_bytes // 2} B")
    if shard_optim and not inputs.peft_rank:
        optim_note += f" / {n}"
    if sharding.offload_optimizer:
        optim, optim_note = 0, "offloaded to CPU"
    items.append(PlanItem("optimizer state", int(optim), optim_note))
    if autocast and not (deepspeed or fsdp) and not inputs.peft_rank:
        # autocast caches a bf16 copy of every weight inside the forward; backward keeps them unless recomputed
        copies = (2 * shape.layer_parameters if inputs.gradient_checkpointing else P) * 2
        items.append(PlanItem("bf16 weight copies (autocast)", int(copies), "one block with checkpointing"))

    sequence = inputs.prompt_length + inputs.tool_schema_tokens + inputs.completion_length
    tokens = inputs.rows * sequence
    view = PlanView(inputs, sequence, autocast)
    rows, turns = f"{inputs.rows} rows x {sequence} tokens", inputs.tool_turns
    if turns:
        rows += (f" (prompt {inputs.prompt_length} + tool schema {inputs.tool_schema_tokens} + {turns + 1} turns and "
                 f"{turns} rounds of tool results of <= {inputs.tool_result_tokens} tokens, all within "
                 f"max_completion_length {inputs.completion_length})")
    if inputs.gradient_checkpointing:
        act_note = f"{rows}, checkpointed: block inputs + 1 block"
    else:
        act_note = f"{rows}, {shape.num_layers} blocks"
    items.append(PlanItem("activations", int(view.activation_bytes(shape, tokens, compute, residual)), act_note))
    # The head's fp32 weight gradient is the parameter's .grad where gradients are whole and fp32;
    # LoRA freezes the head.
    head_grad = not inputs.peft_rank and (grad_bytes != 4 or shard_grads)
    head = lm_head_bytes(shape, tokens, compute, residual, device, head_grad)
    items.append(PlanItem("LM head + loss", head, f"fused head, vocab {shape.vocab_size}: no full logits"))
    if inputs.beta and not inputs.peft_rank:
        ref = (P / n if shard_weights else P) * load
        items.append(PlanItem("reference model (beta > 0)", int(ref), f"{load} B per param"))
    if inputs.algorithm_items is not None:
        items += [PlanItem(name, int(size), note) for name, size, note in inputs.algorithm_items(view)]
    if device != "cpu":
        if inputs.use_vllm and inputs.vllm_mode == "colocate":
            items.append(PlanItem("vLLM (colocate)", int(inputs.vllm_gpu_memory_utilization * gpu_bytes),
                                  f"vllm_gpu_memory_utilization {inputs.vllm_gpu_memory_utilization}: weights + KV "
                                  "cache"))
        items.append(PlanItem("CUDA runtime", CUDA_RUNTIME_BYTES, "context, cuBLAS, NCCL (assumed)"))
    return MemoryPlan(items, gpu_bytes, n, sharding, inputs.model, P, tokens)


def suggest(inputs: PlanInputs, shape: ModelShape, *, gpus: int, gpu_bytes: int, sharding: Sharding,
            limit: int = 3) -> list[str]:
    """Changes that make the plan fit, cheapest first: each launch or setting below with the
    largest micro-batch (halving `per_device_train_batch_size`) that fits."""
    zero3 = Sharding("zero3", sharding.mixed_precision)
    candidates = []
    if not inputs.gradient_checkpointing:
        candidates.append(("gradient_checkpointing: true", dataclasses.replace(inputs, gradient_checkpointing=True),
                           gpus, sharding))
    candidates.append(("", inputs, gpus, sharding))
    if gpus > 1 and sharding.kind not in ("zero3", "fsdp2"):
        candidates.append((f"ZeRO-3 or FSDP2 on the same {gpus} GPUs", inputs, gpus, zero3))
    candidates += [(f"{more} GPUs with ZeRO-3 or FSDP2", inputs, more, zero3) for more in (2, 4, 8, 16) if more > gpus]
    if not inputs.peft_rank:
        candidates.append(("LoRA (peft: {r: 16})", dataclasses.replace(inputs, peft_rank=16), gpus, sharding))
    found = []
    for label, new_inputs, new_gpus, new_sharding in candidates:
        rows = inputs.rows
        while rows >= 1:
            trial = dataclasses.replace(new_inputs, rows=rows)
            if build_plan(trial, shape, gpus=new_gpus, gpu_bytes=gpu_bytes, sharding=new_sharding).fits:
                parts = [label] if label else []
                if rows != inputs.rows:
                    parts.append(f"per_device_train_batch_size: {rows} (scale gradient_accumulation_steps and "
                                 "steps_per_generation so the rows per optimizer step and per round stay the same)")
                found.append(" + ".join(parts))
                break
            rows //= 2
        if len(found) == limit:
            break
    return found


def plan_recipe(plan: RunPlan, *, gpus: int | None = None, gpu_bytes: int = parse_memory("80GB"),
                sharding: Sharding | None = None, prompt_length: int = DEFAULT_PROMPT_LENGTH,
                device: str = "cuda") -> MemoryPlan:
    """The memory plan of a run plan; the model configs are read, never their weights."""
    inputs = plan_inputs(plan, prompt_length=prompt_length)
    sharding = sharding or Sharding("single")
    gpus = gpus or sharding.num_processes or 1
    if gpus > 1 and sharding.kind == "single":
        sharding = dataclasses.replace(sharding, kind="ddp")
    shape = ModelShape.from_config(load_model_config(inputs.model))
    memory = build_plan(inputs, shape, gpus=gpus, gpu_bytes=gpu_bytes, sharding=sharding, device=device)
    if not memory.fits:
        memory.suggestions = suggest(inputs, shape, gpus=gpus, gpu_bytes=gpu_bytes, sharding=sharding)
    return memory


def check_memory_plan(plan: RunPlan) -> MemoryPlan | None:
    """`poise train` on a GPU: plan this launch (GPU count and sharding from accelerate's environment,
    memory of GPU 0) and stop with one line when it cannot fit; `skip_memory_plan: true` skips it."""
    if plan.settings.skip_memory_plan or not torch.cuda.is_available():
        return None
    sharding = sharding_from_environment()
    memory = plan_recipe(plan, gpus=sharding.num_processes, sharding=sharding,
                         gpu_bytes=torch.cuda.get_device_properties(0).total_memory)
    if not memory.fits:
        raise RecipeError(f"poise plan: {memory.verdict()} (skip_memory_plan: true runs it anyway)")
    return memory
