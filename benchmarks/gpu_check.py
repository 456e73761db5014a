"""GPU check: POISE against GRPO at Qwen3-1.7B's shape in bf16 on one air-gapped GPU, in one command.

    python benchmarks/gpu_check.py prepare [--dry-run]   # on a networked machine, once
    python benchmarks/gpu_check.py command               # the device command and the paths it carries
    python benchmarks/gpu_check.py run [--device cuda] [--output benchmarks/results/gpu_check.json]

The GPU node is assumed to have Python 3.12, torch, transformers 5.17, accelerate, peft, pandas and pyarrow, but no
TRL, datasets or math-verify, and no network. `prepare` downloads, for cp312 manylinux x86_64, every package
in the requirement closure of TRL, datasets and math-verify that the node's packages (NODE_HAS) do not
bring (`missing_requirements`: read from this machine's package metadata, pinned to the versions
installed here) into `.gpu_check_wheels/` (ignored by git; with the tracked tree the carry must stay under
64 MiB), with a manifest of names, versions, sizes and sha256.
`run` installs them with `pip install --no-index --no-deps --target` and puts the target first on sys.path
(and PYTHONPATH, for the arms' processes).

`run` builds a random-init Qwen3 at the 1.7B geometry (real vocabulary, 28 blocks, width 2048) with Qwen3's
tokenizer, saved in bf16, then measures, in one JSON artefact:

1. `capture_cost`: POISE's generation capture on its own, in this process: the same 32 rows generate the
   same 128 tokens (one seed, no early stop) without (A) and with (B) the capture, in the order ABBA per
   round (a drift within a round cancels; `order_effect_ms` is A's first minus A's last), every decode
   step timed with CUDA events recorded from before the capture's first hook to after its last.
2. `poise_vs_grpo`: POISE and GRPO taking turns step by step (step_cost's baton: two processes, one
   computing at a time; 1 warmup + 3 measured steps per arm), each phase timed per step
   (`phase_seconds_by_step`), 16 prompts x 2 rollouts of 128 tokens, micro-batches of 8 rows with
   gradient checkpointing; the whole-step ratio with its interval, kept as a check.
3. `poise_over_grpo_by_phases`: the ratio the check resolves. A POISE step is a GRPO step (same
   rollouts, same loss) plus the capture and the probe's phases, so POISE/GRPO = 1 + (capture ms per
   decode step x decode steps + advantages, predict and refit seconds) / GRPO's step seconds, with a
   bootstrap interval over the paired generations and GRPO's steps.
4. Each arm's CUDA allocator peak beside `poise plan`'s estimate; the probe's refit at 4096 rows x width
   2048 (poise_scale's fit point).

Sizing, from benchmarks/results/gpu_check.json (H100, the earlier design: 512-token completions, 2 runs
of 1 warmup + 2 measured steps per arm, 581.8 s): its measured steps took 20.4-46.5 s (POISE 33.0 s mean,
CV 18%; GRPO 31.0 s, CV 37%), so a whole-step ratio at +-3% (95%) needs n = (1.96 / 0.03)^2 x (0.18^2 +
0.37^2) = 723 steps per arm: no whole-step design fits 6 minutes, hence (3). Its figures: 98 s outside the
steps (wheels, model build, 4 process starts; 581.8 s minus the 483.9 s its 12 steps took); a warmup step
took 57 s against 32 s measured (25 s once per arm and run); a measured step split into generation
(23.2 s GRPO, 25.9 s POISE: 45-51 ms per decode step at 512) and 7.1-7.8 s besides. At 128 tokens a step
is 128 x 0.045 + 7.5 = 13.3 s, and this call: 98 s + capture_cost 9 generations (a warmup + 2 ABBA
rounds) x 128 x 0.048 s = 55 s + 2 warmups x (25 + 13.3) s = 77 s + 6 measured steps x 13.3 s = 80 s,
310 s of the 360. Resolution of (3): if the capture cost what the earlier run's generation gap says
(2.77 s per 512 decode steps: 5.4 ms each, 0.69 s a 128-token step, 5.2% of 13.3 s), GRPO's step time at
its CV of 37% over 3 steps moves that 5.2% by 1.96 x 0.052 x 0.37 / 3^0.5 = +-2.2%; the capture's own
interval (8 generations of 128 paired decode steps) comes on top and is in the artefact: the check
says whether its interval is within +-3% (`resolved`), and `--capture-rounds`/`--steps` buy more.

`--device cpu --shape tiny` with smaller `--prompts/--completion-length/--steps/--fit-*` runs the same
path on the CPU (the test; wall-clock timers stand in for CUDA events there).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO_ROOT = Path(__file__).resolve().parents[1]
WHEELS = REPO_ROOT / ".gpu_check_wheels"
CARRY_LIMIT_BYTES = 64 * 2**20  # what the device tool carries: the tracked tree and the wheels together
# The device image's package list (the tool's KINDS.md) also names pandas, pyarrow, xxhash, six and
# python-dateutil. Its pyarrow is 25.0.1 (`pip show` on the H100), which datasets accepts (>= 24); carried,
# pyarrow's 47 MB wheel and the tracked tree no longer fit the 64 MiB carry.
NODE_HAS = ("torch", "transformers", "accelerate", "peft", "pandas", "pyarrow", "xxhash", "six",
            "python-dateutil")
NEEDED = ("trl", "datasets", "math-verify")
TARGET_ENVIRONMENT = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.0",
                      "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
                      "implementation_name": "cpython", "platform_python_implementation": "CPython",
                      "extra": ""}
# shape: (Qwen3 size, decoder blocks (None: all), config numbers replaced); `tiny` is the CPU test's geometry,
# Qwen3's vocabulary and tokenizer at width 64.
SHAPES = {
    "1.7b": ("1.7b", None, {}),
    "tiny": ("0.6b", 1, {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2,
                         "num_key_value_heads": 1, "head_dim": 32}),
}
DEVICE_COMMAND = ("set -o pipefail; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; "
                  "PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py run --output $OUT/gpu_check.json 2>&1 "
                  "| tee $OUT/gpu_check.log")


# ------------------------------------------------------------------------------------------ preparation


def _closure(roots, installed: dict[str, str]) -> set[str]:
    """Canonical names of `roots` and everything they require on the GPU node (markers evaluated for
    CPython 3.12 on Linux x86_64, no extras), as far as this machine's metadata tells."""
    seen, todo = set(), [canonicalize_name(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen or name not in installed:
            seen.add(name)
            continue
        seen.add(name)
        for line in importlib.metadata.requires(name) or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate(TARGET_ENVIRONMENT):
                todo.append(canonicalize_name(requirement.name))
    return seen


def missing_requirements() -> dict[str, str]:
    """{name: version} the node lacks: the closure of NEEDED minus that of NODE_HAS, at this machine's
    versions."""
    installed = {canonicalize_name(d.metadata["Name"]): d.version for d in importlib.metadata.distributions()}
    lacking = sorted(_closure(NEEDED, installed) - _closure(NODE_HAS, installed))
    unknown = [name for name in lacking if name not in installed]
    if unknown:
        sys.exit(f"error: {', '.join(unknown)} required but not installed here: install the project "
                 "(pip install -e .) before preparing the GPU check")
    return {name: installed[name] for name in lacking}


PIP_TARGET = ["--only-binary=:all:", "--platform", "manylinux_2_28_x86_64", "--python-version", "3.12",
              "--implementation", "cp", "--abi", "cp312"]


def resolve_wheels(pins: dict[str, str]) -> list[dict]:
    """The wheel pip picks for each pin on the GPU node (CPython 3.12, manylinux_2_28 x86_64): name, version,
    file. pip's own dry run, reading the package index (metadata only where the index serves it)."""
    with tempfile.TemporaryDirectory(prefix="gpu_check_resolve_") as scratch:
        report = Path(scratch) / "report.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed",
                        "--no-deps", *PIP_TARGET, "--target", scratch, "--report", str(report),
                        *(f"{name}=={version}" for name, version in pins.items())], check=True)
        chosen = json.loads(report.read_text())["install"]
    return [{"name": canonicalize_name(item["metadata"]["name"]), "version": item["metadata"]["version"],
             "file": item["download_info"]["url"].rsplit("/", 1)[-1]} for item in chosen]


def prepare(dry_run: bool) -> None:
    wheels = resolve_wheels(missing_requirements())
    for wheel in wheels:
        print(f"{wheel['file']}")
    if dry_run:
        print(f"{len(wheels)} wheels resolve for CPython 3.12 on manylinux x86_64")
        return
    WHEELS.mkdir(exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", *PIP_TARGET, "--dest",
                    str(WHEELS), *(f"{w['name']}=={w['version']}" for w in wheels)], check=True)
    for path in WHEELS.glob("*.whl"):
        if path.name not in {w["file"] for w in wheels}:
            path.unlink()  # left from an earlier preparation
    for wheel in wheels:
        data = (WHEELS / wheel["file"]).read_bytes()
        wheel.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    total, tracked = sum(w["bytes"] for w in wheels), tracked_bytes()
    if total + tracked > CARRY_LIMIT_BYTES:
        sys.exit(f"error: the wheels take {total / 2**20:.1f} MiB and the tracked tree {tracked / 2**20:.1f} MiB, "
                 "over the 64 MiB the device carries: add what the node has to NODE_HAS")
    (WHEELS / "manifest.json").write_text(json.dumps(wheels, indent=2) + "\n")
    print(f"{len(wheels)} wheels, {total / 2**20:.1f} MiB in {WHEELS.name}/ (carry it to the GPU node: "
          "`python benchmarks/gpu_check.py command`)")


def tracked_bytes() -> int:
    """The size of the files git tracks: they travel to the device with the carried wheels."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO_ROOT, capture_output=True, check=True).stdout
    return sum((REPO_ROOT / name).stat().st_size for name in listed.decode().split("\0") if name)


def install_wheels(target: Path, wheels: list[dict]) -> list[dict]:
    """The prepared `wheels` (the manifest's entries), installed offline into `target`, which goes first on
    sys.path and PYTHONPATH."""
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--target",
                    str(target), *(str(WHEELS / w["file"]) for w in wheels)], check=True)
    sys.path.insert(0, str(target))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))
    return [{key: w[key] for key in ("name", "version", "bytes")} for w in wheels]


def check_node_versions(target: Path) -> None:
    """Exit with one line if a package in `target` requires a version of a node package (NODE_HAS) that the
    node does not have: those are not carried, so a too-old one would fail deep inside the run."""
    node_packages = {canonicalize_name(name) for name in NODE_HAS}
    unmet = []
    for dist in importlib.metadata.distributions(path=[str(target)]):
        for line in dist.requires or []:
            requirement = Requirement(line)
            if canonicalize_name(requirement.name) not in node_packages or not (
                    requirement.marker is None or requirement.marker.evaluate(TARGET_ENVIRONMENT)):
                continue
            try:
                have = importlib.metadata.version(requirement.name)
            except importlib.metadata.PackageNotFoundError:
                have = "none"
            if not requirement.specifier.contains(have, prereleases=True):
                unmet.append(f"{dist.metadata['Name']} needs {requirement.name}{requirement.specifier}, "
                             f"the node has {have}")
    if unmet:
        sys.exit(f"error: {'; '.join(unmet)}: remove it from NODE_HAS in benchmarks/gpu_check.py and prepare "
                 "again, so that it travels")


# ------------------------------------------------------------------------------------------ the run


def build_policy(shape: str, dtype: str, device: str, output_dir: Path) -> dict:
    """The real-shape world's random-init Qwen3 (`poise toy build --world qwen3-shape`) at `shape`,
    initialised on `device` (seconds for 1.7B parameters on a GPU, minutes on a CPU) and saved in `dtype`
    with Qwen3's tokenizer. Returns its geometry."""
    import torch
    from transformers import Qwen3ForCausalLM

    from poise_trl.run.toy import real_shape_config, write_qwen3_tokenizer

    size, layers, replaced = SHAPES[shape]
    config = real_shape_config(size, layers)
    config.update(replaced)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(getattr(torch, dtype))
    model.config.dtype = dtype
    model.save_pretrained(output_dir)
    write_qwen3_tokenizer(output_dir)
    return {"parameters": model.num_parameters(), "vocab_size": config.vocab_size,
            "hidden_size": config.hidden_size, "num_hidden_layers": config.num_hidden_layers,
            "intermediate_size": config.intermediate_size}


class DecodeStepTimer:
    """Times every forward of `model` (generate's prefill, then one per decode step) from a pre-hook put
    before all others to a hook added after the capture's, with CUDA events (no host synchronisation
    while generate runs; read at the end), or wall clocks on the CPU."""

    def __init__(self, model, device: str):
        import torch

        self.model, self.cuda = model, device == "cuda"
        self.clock = (lambda: torch.cuda.Event(enable_timing=True)) if self.cuda else None
        self.marks: list = []

    def _mark(self, *args, **kwargs):
        if self.cuda:
            event = self.clock()
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def __enter__(self):
        self.marks = []
        self.handles = [self.model.register_forward_pre_hook(self._mark, prepend=True),
                        self.model.register_forward_hook(self._mark)]
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()

    def decode_step_ms(self) -> list[float]:
        """Milliseconds of each decode step (the prefill, the first forward, left out)."""
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            spans = [start.elapsed_time(end) for start, end in zip(self.marks[::2], self.marks[1::2], strict=True)]
        else:
            spans = [(end - start) * 1e3 for start, end in zip(self.marks[::2], self.marks[1::2], strict=True)]
        return spans[1:]


def capture_cost(model_dir: Path, device: str, dtype: str, rows: int, tokens: int, rounds: int,
                 seed: int = 0) -> dict:
    """Decode-step milliseconds without (A) and with (B) POISE's GenerationCapture, ABBA per round."""
    import random

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from poise_trl.probe.capture import GenerationCapture

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    think = tokenizer.convert_tokens_to_ids("</think>")
    prompts = torch.randint(1000, 20000, (rows, 32), generator=torch.Generator().manual_seed(seed)).to(device)

    def generate(with_capture: bool) -> list[float]:
        torch.manual_seed(seed)  # the same tokens with and without the capture: it changes no logit
        capture = GenerationCapture(model, 0.55, [tokenizer.eos_token_id], think)
        with torch.no_grad(), (capture if with_capture else contextlib.nullcontext()), DecodeStepTimer(
                model, device) as timer:
            model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), do_sample=True,
                           min_new_tokens=tokens, max_new_tokens=tokens, pad_token_id=tokenizer.eos_token_id)
        return timer.decode_step_ms()

    generate(False)  # warmup: kernels, allocator
    plain, captured, order_effect = [], [], []
    for _ in range(rounds):
        first, b1, b2, last = generate(False), generate(True), generate(True), generate(False)
        plain += [first, last]
        captured += [b1, b2]
        order_effect.append(statistics.mean(first) - statistics.mean(last))
    # per generation, the mean over its decode steps; pairs: (A1, B1), (A4, B2) of each round
    differences = [statistics.mean(b) - statistics.mean(a) for a, b in zip(plain, captured, strict=True)]
    rng = random.Random(seed)
    draws = sorted(statistics.mean(rng.choices(differences, k=len(differences))) for _ in range(4000))
    return {"rows": rows, "decode_steps_per_generation": tokens - 1, "rounds": rounds, "order": "ABBA",
            "timer": "cuda events" if device == "cuda" else "wall clock",
            "plain_ms_per_decode_step": round(statistics.mean(map(statistics.mean, plain)), 4),
            "capture_ms_per_decode_step": round(statistics.mean(map(statistics.mean, captured)), 4),
            "capture_cost_ms_per_decode_step": round(statistics.mean(differences), 4),
            "capture_cost_95_interval": [round(draws[100], 4), round(draws[3899], 4)],
            "order_effect_ms": [round(x, 4) for x in order_effect],
            "decode_step_ms": {"plain": [[round(x, 3) for x in g] for g in plain],
                               "capture": [[round(x, 3) for x in g] for g in captured]}}


def ratio_by_phases(capture: dict, pair: dict, tokens: int, seed: int = 0) -> dict:
    """POISE/GRPO = 1 + (capture cost of a step's decode steps + POISE's own phases) / GRPO's step."""
    import random

    own = ("poise_advantages", "probe_predict", "probe_refit")
    phases = pair["arm_a"]["phase_seconds_per_step"]
    own_seconds = sum(phases.get(phase, 0.0) for phase in own)
    grpo_steps = [s for run in pair["arm_b"]["step_seconds"] for s in run[pair["warmup_steps"]:]]
    per_generation = [statistics.mean(b) - statistics.mean(a) for a, b in
                      zip(capture["decode_step_ms"]["plain"], capture["decode_step_ms"]["capture"], strict=True)]

    def ratio(differences, steps):
        return 1 + (statistics.mean(differences) * tokens / 1e3 + own_seconds) / statistics.mean(steps)

    rng = random.Random(seed)
    draws = sorted(ratio(rng.choices(per_generation, k=len(per_generation)), rng.choices(grpo_steps,
                                                                                         k=len(grpo_steps)))
                   for _ in range(4000))
    low, high = draws[100], draws[3899]
    return {"ratio": round(ratio(per_generation, grpo_steps), 4), "ratio_95_interval": [round(low, 4), round(high, 4)],
            "resolved": high - low <= 0.06, "poise_own_phase_seconds_per_step": round(own_seconds, 4),
            "grpo_step_seconds": grpo_steps, "decode_steps_per_training_step": tokens}


def run(cli) -> None:
    import torch

    started = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    installed = "not needed: TRL imports"
    if importlib.util.find_spec("trl") is None:  # the GPU node
        manifest = WHEELS / "manifest.json"
        if not manifest.is_file():
            sys.exit("error: TRL does not import and no wheels are prepared: run `python "
                     "benchmarks/gpu_check.py prepare` on a networked machine and carry "
                     ".gpu_check_wheels/ here")
        # "site-packages" in the path: dill (datasets' fingerprint) pickles a module by value when its file is
        # under neither sys.prefix nor such a folder, and dies on pyarrow's MonthDayNano (seen on the H100)
        installed = install_wheels(workdir / "site-packages", json.loads(manifest.read_text()))
        check_node_versions(workdir / "site-packages")
    sys.path.insert(0, str(REPO_ROOT))  # poise_trl from the working tree, as the arms see it
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(REPO_ROOT)]))
    from poise_scale import fit_point
    from step_cost import new_artefact, recipe_for, run_pair, write_artefact

    from poise_trl.run.plan import GIB, plan_recipe
    from poise_trl.run.recipe import parse_recipe

    if cli.device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: --device cuda but torch sees no GPU; run with --device cpu for the CPU check")
    _, payload = new_artefact("gpu_check.py", ["transformers"], ["transformers"])
    payload["wheels_installed"] = installed
    payload["device"] = torch.cuda.get_device_name() if cli.device == "cuda" else "cpu"
    dtype = "bfloat16" if cli.device == "cuda" else "float32"
    model_dir = workdir / f"qwen3-shape-{cli.shape}"
    build_started = time.perf_counter()
    geometry = build_policy(cli.shape, dtype, cli.device, model_dir)
    payload["model"] = {"shape": cli.shape, **geometry, "dtype": dtype,
                        "build_seconds": round(time.perf_counter() - build_started, 1)}
    # each part is written as it ends: a failure late in the run keeps what came before
    payload["probe_fit"] = fit_point(cli.fit_rows, cli.fit_width, cli.device, torch.get_num_threads(),
                                     run_exact=False)
    write_artefact(payload, cli.output)
    rows = 2 * cli.prompts
    payload["capture_cost"] = capture_cost(model_dir, cli.device, dtype, rows, cli.completion_length,
                                           cli.capture_rounds)
    write_artefact(payload, cli.output)
    shape = {"model": str(model_dir), "max_completion_length": cli.completion_length,
             "per_device_train_batch_size": min(rows, cli.micro_batch),
             "gradient_accumulation_steps": max(1, rows // cli.micro_batch),
             "gradient_checkpointing": True, "bf16": dtype == "bfloat16",
             "model_init_kwargs": {"dtype": dtype}}
    payload["recipe_overrides"] = {**shape, "model": f"(the {cli.shape} model above)"}
    pair = run_pair("transformers", cli.steps, 1, cli.replicates, 0, workdir, shape)
    payload["poise_vs_grpo"] = pair
    low, high = pair["ratio_95_interval"]
    print(f"POISE/GRPO whole steps {pair['ratio_of_mean_step_seconds']:.3f} [{low:.3f}, {high:.3f}]", flush=True)
    payload["poise_over_grpo_by_phases"] = by_phases = ratio_by_phases(payload["capture_cost"], pair,
                                                                       cli.completion_length)
    low, high = by_phases["ratio_95_interval"]
    print(f"POISE/GRPO by phases {by_phases['ratio']:.3f} [{low:.3f}, {high:.3f}]", flush=True)
    write_artefact(payload, cli.output)

    gpu_bytes = torch.cuda.get_device_properties(0).total_memory if cli.device == "cuda" else 80 * GIB
    payload["plan_vs_measured"] = {}
    for arm, recipe_file in (("arm_a", "poise.yaml"), ("arm_b", "grpo_2.yaml")):
        recipe = recipe_for(recipe_file, {}, cli.steps + 1, 0, shape)
        plan = plan_recipe(parse_recipe(recipe), gpu_bytes=gpu_bytes, prompt_length=cli.prompt_length,
                           device=cli.device)
        runtime = sum(item.bytes for item in plan.items if item.name == "CUDA runtime")
        measured_key = "peak_cuda_allocated_mib" if cli.device == "cuda" else "peak_rss_mib"
        measured = pair[arm][measured_key] * 2**20
        payload["plan_vs_measured"][recipe["algo"]] = {
            "plan_items_bytes": {item.name: item.bytes for item in plan.items},
            "plan_bytes_without_cuda_runtime": plan.total - runtime,
            "measured": measured_key, "measured_bytes": int(measured),
            "measured_over_plan": round(measured / (plan.total - runtime), 3)}
    payload["plan_vs_measured"]["note"] = (
        "the plan counts one training micro-batch (weights, gradients, AdamW, activations, LM head), with "
        f"prompts of {cli.prompt_length} tokens; the measure is torch.cuda.max_memory_allocated over the "
        "whole run (generation's KV cache included) on a GPU, the process's peak RSS on the CPU")
    payload["wall_seconds"] = round(time.perf_counter() - started, 1)
    write_artefact(payload, cli.output)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="action", required=True)
    prep = commands.add_parser("prepare", help="download the wheels the GPU node lacks (networked machine)")
    prep.add_argument("--dry-run", action="store_true", help="resolve and size the wheels, download nothing")
    commands.add_parser("command", help="print the device command and the paths it carries")
    go = commands.add_parser("run", help="the check itself")
    go.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    go.add_argument("--shape", choices=list(SHAPES), default="1.7b")
    go.add_argument("--prompts", type=int, default=16, help="prompts per step, 2 rollouts each")
    go.add_argument("--completion-length", type=int, default=128)
    # toy-arith's prompts through Qwen3's chat template: 27 tokens in plan_vs_measured.json's batches
    go.add_argument("--prompt-length", type=int, default=32, help="prompt tokens the plan assumes")
    go.add_argument("--micro-batch", type=int, default=8, help="rows per training micro-batch")
    go.add_argument("--steps", type=int, default=3, help="measured steps per arm and run, after 1 warmup")
    go.add_argument("--capture-rounds", type=int, default=2, help="ABBA rounds of the capture's own timing")
    go.add_argument("--replicates", type=int, default=1,
                    help="runs of the pair (fresh processes, the first arm alternating), each with its warmup")
    go.add_argument("--fit-rows", type=int, default=4096)
    go.add_argument("--fit-width", type=int, default=2048)
    go.add_argument("--output", default="benchmarks/results/gpu_check.json")
    cli = parser.parse_args()
    if cli.action == "prepare":
        prepare(cli.dry_run)
    elif cli.action == "command":
        print(json.dumps({"command": DEVICE_COMMAND, "carry": [WHEELS.name]}, indent=2))
    else:
        run(cli)


if __name__ == "__main__":
    main()
