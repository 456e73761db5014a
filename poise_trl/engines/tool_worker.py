"""The worker process of a recipe's tools or of one environment instance (`engines/tools.py`). Every worker imports
this module, so it imports the standard library only."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import multiprocessing

# The limits of tools and environments when a recipe sets none (run/recipe.py checks a recipe's own).
DEFAULT_TOOL_TIMEOUT_S = 10.0
DEFAULT_TOOL_RESULT_TOKENS = 512
DEFAULT_TOOL_TURNS = 8  # max_tool_calling_iterations when a recipe has tools (TRL's default: no limit)
STARTUP_TIMEOUT_S = 120.0  # a worker importing its tools (torch, a simulator) before its first call


class ToolError(RuntimeError):
    """A call that failed, hung or had bad arguments: TRL hands `{"error": message}` to the model."""


class CallTimeout(Exception):
    pass


def _load(kind: str, paths: list[str]):
    objects = []
    for path in paths:
        module, _, name = path.partition(":")
        objects.append(getattr(importlib.import_module(module), name))
    if kind == "environment":
        return objects[0]()
    return {tool.__name__: tool for tool in objects}


def _serve(connection, kind: str, paths: list[str]) -> None:
    """The worker: load the tools (or build the environment), say ready, then answer calls until the pipe closes."""
    try:
        target = _load(kind, paths)
    except Exception as exc:  # noqa: BLE001 - reported to the parent in one line
        connection.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    connection.send(("ok", None))
    while True:
        try:
            operation, name, kwargs = connection.recv()
        except EOFError:
            return
        try:
            if operation == "get":
                value = getattr(target, name)
            else:
                value = (target[name] if kind == "tools" else getattr(target, name))(**kwargs)
                if inspect.iscoroutine(value):  # an async tool
                    value = asyncio.run(value)
            reply = ("ok", value)
        except Exception as exc:  # noqa: BLE001 - the model reads it
            reply = ("error", f"{type(exc).__name__}: {exc}")
        try:
            connection.send(reply)
        except Exception:  # noqa: BLE001 - a result that does not pickle goes back as its text
            connection.send(("ok", str(reply[1])))


class Worker:
    """One child process holding `kind` ("tools": the functions at `paths`; "environment": an instance of the class
    at `paths[0]`), started on first use, killed on a timeout."""

    def __init__(self, kind: str, paths: list[str]):
        self.kind, self.paths = kind, paths
        self.process = None
        self.connection = None

    def request(self, operation: str, name: str, kwargs: dict, timeout_s: float):
        if self.process is None:
            self.start()
        self.connection.send((operation, name, kwargs))
        if not self.connection.poll(timeout_s):
            self.stop()
            raise CallTimeout
        return self.answer()

    def start(self) -> None:
        context = multiprocessing.get_context("spawn")  # no copy of the trainer's threads and CUDA state
        self.connection, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child, self.kind, self.paths), daemon=True)
        self.process.start()
        child.close()
        if not self.connection.poll(STARTUP_TIMEOUT_S):
            self.stop()
            raise RuntimeError(f"{self.kind} {self.paths} did not load within {STARTUP_TIMEOUT_S:g}s")
        try:
            self.answer()
        except ToolError as exc:
            raise RuntimeError(f"{self.kind} {self.paths} cannot be loaded in a worker process: {exc}") from None

    def answer(self):
        try:
            status, value = self.connection.recv()
        except (EOFError, ConnectionError):
            self.stop()
            raise ToolError("the tool's process died during the call") from None
        if status == "error":
            raise ToolError(value)
        return value

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.join()
            self.connection.close()
        self.process = self.connection = None
