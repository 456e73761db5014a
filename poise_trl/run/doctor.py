"""`poise doctor`: a preflight of a launch over several machines, in seconds, before a run can hang in it.

Every machine runs the same `poise doctor RECIPE --machines N` (its machine index from --node-rank, else
NODE_RANK, GROUP_RANK or SLURM_NODEID). Machine 0 opens a TCPStore at the rendezvous address the launch will
use (MASTER_ADDR:MASTER_PORT); every machine publishes there its report (host, package versions, the random
token it wrote into the output folder), waits for all the others' and checks them against its own: the
versions are equal, every other machine's token file can be read here (the output folder is one filesystem
that every machine sees). Each machine also checks what only it can see: the socket interfaces NCCL and gloo
are told to use exist, the recipe's vLLM server answers and serves the recipe's model, and the memory plan
of one GPU (`run.plan`). One line per problem, with its fix; `poise doctor` exits 1 when there is one.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import secrets
import socket
import urllib.request
from importlib import metadata
from pathlib import Path

import torch
from torch.distributed import TCPStore

from poise_trl.core.loading import resolve_model_path
from poise_trl.engines.generation import vllm_distribution
from poise_trl.engines.vllm_server import server_url, short_reason
from poise_trl.run.plan import parse_memory, plan_recipe, sharding_from_accelerate_config

VERSIONED = ("torch", "transformers", "trl", "vllm", "poise-trl")  # vllm: whichever build (engines.generation)
REPORTS = ".poise-doctor"  # the folder each machine's token goes to, under the output folder


def node_rank(environ=os.environ) -> int:
    return next((int(environ[k]) for k in ("NODE_RANK", "GROUP_RANK", "SLURM_NODEID") if environ.get(k)), 0)


def versions() -> dict[str, str]:
    found = {}
    for name in VERSIONED:
        try:  # vLLM ships as `vllm` or as a CPU build under another distribution name
            if name == "vllm":
                found[name] = " ".join(vllm_distribution() or ["not installed"])
            else:
                found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def interface_problems(environ=os.environ) -> list[str]:
    """NCCL_SOCKET_IFNAME (prefixes, `=` for exact names, `^` to exclude) and GLOO_SOCKET_IFNAME (exact
    names) naming an interface this machine lacks: the rendezvous would answer, the first collective hang."""
    names = sorted(name for _, name in socket.if_nameindex())
    problems = []
    for variable, prefixes in (("NCCL_SOCKET_IFNAME", True), ("GLOO_SOCKET_IFNAME", False)):
        value = environ.get(variable, "")
        if not value or value.startswith("^"):  # unset, or a list to avoid: any other interface serves
            continue
        exact = not prefixes or value.startswith("=")
        wanted = [w for w in value.lstrip("=").split(",") if w]
        missing = [w for w in wanted if not any(n == w if exact else n.startswith(w) for n in names)]
        if missing:
            problems.append(f"{variable}={value}: no interface {', '.join(missing)} on this machine (it has "
                            f"{', '.join(names)}): set it to the interface the machines reach each other on, or "
                            "unset it")
    return problems


def server_problems(plan) -> list[str]:
    """The recipe's vLLM server (`vllm_mode: server`) answers /v1/models and serves the recipe's model."""
    url = server_url(plan.args)
    if url is None:
        return []
    url, model = url.rstrip("/"), resolve_model_path(plan.settings.model)
    start = (f"start it on the server machine (python -m poise_trl.engines.vllm_server --model {model} --host "
             "0.0.0.0 --port PORT) and point vllm_server_base_url at it")
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as answer:
            served = [entry.get("id") for entry in json.load(answer).get("data", [])]
    except (OSError, ValueError) as exc:
        return [f"vLLM server {url} does not answer ({short_reason(getattr(exc, 'reason', exc))}): {start}"]
    if model not in served and plan.settings.model not in served:
        return [f"vLLM server {url} serves {', '.join(map(str, served)) or 'no model'}, not the recipe's model "
                f"{model}: restart it with --model {model}"]
    return []


def memory_line(plan, machines: int) -> tuple[str, bool]:
    """The memory plan of one GPU for this launch: every GPU of every machine (one where torch sees none)."""
    per_machine = torch.cuda.device_count() or 1
    gpu_bytes = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else parse_memory(
        "80GB")
    config = plan.settings.accelerate_config
    sharding = sharding_from_accelerate_config(config) if config else None
    memory = plan_recipe(plan, gpus=machines * per_machine, gpu_bytes=gpu_bytes, sharding=sharding)
    return f"memory plan: {memory.verdict()}", memory.fits


def exchange(report: dict, node: int, machines: int, rendezvous: str, wait_s: float,
             folder: Path) -> tuple[bool, list[str]]:
    """Every machine's report, through a TCPStore at the rendezvous address (machine 0 hosts it), checked
    against this machine's (`cross_checks`) before the machines part. (every machine reported, problems)"""
    host, _, port = rendezvous.rpartition(":")
    timeout = datetime.timedelta(seconds=wait_s)
    try:
        store = TCPStore(host, int(port), machines, is_master=node == 0, timeout=timeout, wait_for_workers=False)
    except (RuntimeError, ValueError, OSError) as exc:
        where = "cannot be opened on this machine (port in use?)" if node == 0 else "does not answer"
        return False, [f"rendezvous {rendezvous} {where} ({' '.join(str(exc).split())[:100]}): set MASTER_ADDR to "
                           "machine 0's address as this machine reaches it and MASTER_PORT to a free port open "
                           "between the machines, and start doctor on machine 0 too"]
    store.set(f"report-{node}", json.dumps(report))
    keys = [f"report-{i}" for i in range(machines)]
    try:
        store.wait(keys, timeout)
    except Exception:  # noqa: BLE001 - torch raises DistStoreError or RuntimeError by version
        silent = [i for i, key in enumerate(keys) if not store.check([key])]
        return False, [f"machine {', '.join(map(str, silent))} did not report within {wait_s:g} s: run the same "
                           f"`poise doctor --machines {machines}` on every machine"]
    problems = cross_checks([json.loads(store.get(key)) for key in keys], node, folder)
    store.set(f"read-{node}", "1")  # every machine keeps its token, and machine 0 the store, until all have read
    try:
        store.wait([f"read-{i}" for i in range(machines)], timeout)
    except Exception:  # noqa: BLE001 - a machine that left after reading: nothing is lost
        pass
    return True, problems


def cross_checks(reports: list[dict], me: int, folder: Path) -> list[str]:
    """Versions equal to this machine's, and every other machine's token readable in the output folder."""
    problems = []
    mine = reports[me]["versions"]
    for other in reports:
        if other["node"] == me:
            continue
        for name, version in mine.items():
            theirs = other["versions"].get(name)
            if theirs != version:
                problems.append(f"{name} differs: this machine ({me}) has {version}, machine {other['node']} "
                                f"({other['host']}) has {theirs}: install the same version on every machine")
        token = folder / REPORTS / f"machine-{other['node']}.token"
        if not token.is_file() or token.read_text() != other["token"]:
            problems.append(f"output folder {folder} is not shared with machine {other['node']} ({other['host']}): "
                            "its file is not here: put output_dir on a filesystem every machine mounts (each "
                            "writes checkpoint files that all need to resume)")
    return problems


def run_doctor(plan=None, machines: int = 1, node: int | None = None, output_dir: str | None = None,
               rendezvous: str | None = None, wait_s: float = 30.0) -> tuple[list[str], list[str]]:
    """(notes, problems) of this machine's preflight; see the module docstring."""
    node = node_rank() if node is None else node
    folder = Path(output_dir or (plan.args.output_dir if plan is not None else "."))
    notes = [f"machine {node} of {machines} ({socket.gethostname()}): " +
             ", ".join(f"{name} {version}" for name, version in versions().items())]
    problems = interface_problems()
    if plan is not None:
        problems += server_problems(plan)
        line, fits = memory_line(plan, machines)
        (notes if fits else problems).append(line)
    try:
        (folder / REPORTS).mkdir(parents=True, exist_ok=True)
        token = folder / REPORTS / f"machine-{node}.token"
        token.write_text(secret := secrets.token_hex(8))
    except OSError as exc:
        return notes, [*problems, f"output folder {folder} is not writable here ({exc.strerror}): give one this "
                                  "machine can write"]
    if machines > 1:
        environ = os.environ
        rendezvous = rendezvous or f"{environ.get('MASTER_ADDR', '127.0.0.1')}:{environ.get('MASTER_PORT', '29500')}"
        report = {"node": node, "host": socket.gethostname(), "versions": versions(), "token": secret}
        reported, found = exchange(report, node, machines, rendezvous, wait_s, folder)
        problems += found
        if reported:
            notes.append(f"rendezvous {rendezvous}: checked against the other {machines - 1} machine(s)")
    token.unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # the last machine out removes the folder: `poise train` wants none
        token.parent.rmdir()
    return notes, problems
