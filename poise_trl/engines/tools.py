"""A recipe's tools and environment, run where a hang can be killed, within the recipe's limits (training's
rollouts and the evaluation tools' conversations, `evaluation/agent.py`).

TRL's GRPOTrainer calls a rollout's tools in its own process and turns an exception into `{"error": ...}` for the
model, but a call that hangs stalls the run. Here every call runs in a child process that is killed, and replaced,
when it outruns `tool_timeout`:

- the recipe's `tools` share one worker process, which imports them by their import paths;
- an `environment` instance lives in a worker of its own, one per instance of TRL's pool (TRL builds an instance
  once and resets it for each rollout), so its state survives between the calls of a rollout. TRL sees a stand-in
  class with the environment's name, methods, signatures and docstrings (the tool schema comes from them); reading
  an attribute of the stand-in (a reward reading the environment's state) reads the instance's. After a timeout the
  worker is replaced by a fresh instance reset with the rollout's row, and the model is told so.

A call with arguments that do not fit the tool's signature is refused before it runs; a result longer than
`tool_result_tokens` tokens is cut. The model reads one error line for each failure and the run goes on; each step
logs `tools/calls`, `tools/errors` (raised, bad arguments, died), `tools/timeouts` and `tools/turns_per_rollout`
(assistant turns of the step's rollouts). The turn limit is TRL's `max_tool_calling_iterations`.
"""

from __future__ import annotations

import functools
import inspect

from transformers import TrainerCallback

from poise_trl.core.distributed import summed_over_processes
from poise_trl.core.loading import RecipeError, import_callable
from poise_trl.engines.tool_worker import CallTimeout, ToolError, Worker


def _signature(function, bound: bool) -> inspect.Signature:
    try:
        signature = inspect.signature(function, eval_str=True)  # `int`, not 'int', in the model's error line
    except NameError:
        signature = inspect.signature(function)
    return signature.replace(parameters=list(signature.parameters.values())[1:]) if bound else signature


def environment_class(path: str) -> type:
    """The environment class at `path` (module:Class), whose public methods are the tools."""
    found = import_callable(path, "environment")
    if not isinstance(found, type):
        raise RecipeError(f"environment {path!r} is not a class: give module:Class, a class whose public methods "
                          "are the tools")
    return found


def environment_tools(instance) -> list:
    """An environment instance's tools as TRL hands them to a rollout: its public methods but reset and get_reward
    (listed on the class: listing the instance would evaluate its properties)."""
    return [getattr(instance, name) for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
            if name not in ("reset", "get_reward") and not name.startswith("_")]


class ToolRuntime:
    """The recipe's tools (`tools()`) and environment (`environment_factory()`) as TRL's GRPOTrainer takes them,
    each call in a worker process within the limits, counted; `attach(trainer)` logs the counts every step."""

    def __init__(self, tool_paths: list[str], environment_path: str | None, timeout_s: float, result_tokens: int,
                 tokenizer):
        self.tool_paths, self.environment_path = tool_paths, environment_path
        self.timeout_s, self.result_tokens, self.tokenizer = timeout_s, result_tokens, tokenizer
        self.workers: list[Worker] = []
        self.functions: list = []  # the stand-ins of the tools, and of the environment class, as TRL gets them
        self.environment_class = None
        self.trainer = None
        self.calls = self.errors = self.timeouts = 0
        self.turns: list[int] = []

    def worker(self, kind: str, paths: list[str]) -> Worker:
        self.workers.append(Worker(kind, paths))
        return self.workers[-1]

    def call(self, worker: Worker, signature: inspect.Signature, name: str, kwargs: dict, restart=None) -> str:
        """One tool call: arguments checked against `signature`, run by `worker` within the time limit, the result
        as text cut at the token limit; a failure raises `ToolError` with the line the model reads."""
        self.calls += 1
        try:
            signature.bind(**kwargs)
        except TypeError as exc:
            self.errors += 1
            raise ToolError(f"bad arguments for {name}: {exc}; call it as {name}{signature}") from None
        try:
            value = worker.request("call", name, kwargs, self.timeout_s)
        except CallTimeout:
            self.timeouts += 1
            if restart is not None:
                restart()
            raise ToolError(f"{name} did not answer within {self.timeout_s:g}s and was stopped"
                            + ("; the environment restarted from its initial state" if restart else "")) from None
        except ToolError:
            self.errors += 1
            raise
        return value if isinstance(value, list) else self.clip(str(value))  # a list: multimodal content blocks

    def clip(self, text: str) -> str:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) <= self.result_tokens:
            return text
        return self.tokenizer.decode(ids[: self.result_tokens]) + f" [... cut at {self.result_tokens} tokens]"

    def tools(self, functions: list) -> list:
        """Stand-ins for the recipe's tool functions (same name, signature and docstring: TRL's schema)."""
        worker = self.worker("tools", self.tool_paths)

        def stand_in(function):
            signature = _signature(function, bound=False)

            @functools.wraps(function)
            def call(**kwargs):
                return self.call(worker, signature, function.__name__, kwargs)
            return call
        self.functions = [stand_in(function) for function in functions]
        return self.functions

    def environment_factory(self, environment_class: type) -> type:
        """A stand-in class for `environment_class`: each instance owns a worker holding the real instance."""
        runtime, path = self, self.environment_path

        def __init__(stand_in):
            stand_in.worker = runtime.worker("environment", [path])
            stand_in.row = {}

        def reset(stand_in, **row):
            stand_in.row = row
            return stand_in.worker.request("call", "reset", row, runtime.timeout_s)

        def restart(stand_in):
            stand_in.worker.stop()
            reset(stand_in, **stand_in.row)

        def __getattr__(stand_in, name):  # state a reward reads (only names the stand-in does not have)
            if name.startswith("_") or name in ("worker", "row"):
                raise AttributeError(name)
            return stand_in.worker.request("get", name, {}, runtime.timeout_s)

        def method(function):
            signature = _signature(function, bound=True)

            @functools.wraps(function)
            def call(stand_in, **kwargs):
                return runtime.call(stand_in.worker, signature, function.__name__, kwargs,
                                    restart=lambda: restart(stand_in))
            return call

        members = {"__init__": __init__, "reset": reset, "__getattr__": __getattr__,
                   "__doc__": environment_class.__doc__, "__module__": environment_class.__module__}
        for name, function in inspect.getmembers(environment_class, predicate=inspect.isfunction):
            if name == "get_reward":
                members[name] = functools.wraps(function)(
                    lambda stand_in: stand_in.worker.request("call", "get_reward", {}, runtime.timeout_s))
            elif not name.startswith("_") and name != "reset":
                members[name] = method(function)
        self.environment_class = type(environment_class.__name__, (), members)
        return self.environment_class

    def counting_turns(self, reward_funcs: list) -> list:
        """The reward functions, the first plain one wrapped to count each training rollout's assistant turns from
        the conversations TRL hands it (no other place sees whole rollouts)."""
        for index, function in enumerate(reward_funcs):
            if callable(function) and not inspect.iscoroutinefunction(function):
                @functools.wraps(function)
                def counted(*args, completions=None, _reward=function, **kwargs):
                    if self.trainer is not None and self.trainer.model.training:
                        self.turns += [sum(m.get("role") == "assistant" for m in c) if isinstance(c, list) else 1
                                       for c in completions]
                    return _reward(*args, completions=completions, **kwargs)
                return [*reward_funcs[:index], counted, *reward_funcs[index + 1:]]
        return reward_funcs

    def attach(self, trainer) -> None:
        self.trainer = trainer
        trainer.add_callback(ToolCountsCallback(self))

    def flush(self) -> dict[str, float]:
        """The counts since the last step, summed over processes, and the mean turns per rollout."""
        calls, errors, timeouts, turns, rollouts = summed_over_processes(
            self.trainer.accelerator, [self.calls, self.errors, self.timeouts, sum(self.turns), len(self.turns)])
        self.calls = self.errors = self.timeouts = 0
        self.turns = []
        counts = {"tools/calls": calls, "tools/errors": errors, "tools/timeouts": timeouts}
        return counts | ({"tools/turns_per_rollout": turns / rollouts} if rollouts else {})

    def close(self) -> None:
        for worker in self.workers:
            worker.stop()


class ToolCountsCallback(TrainerCallback):
    def __init__(self, runtime: ToolRuntime):
        self.runtime = runtime

    def on_step_end(self, args, state, control, **kwargs):
        for name, value in self.runtime.flush().items():
            self.runtime.trainer.log_metric(name, value)

    def on_train_end(self, args, state, control, **kwargs):
        self.runtime.close()
