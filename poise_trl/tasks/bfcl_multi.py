"""BFCL multi-turn: the Berkeley Function Calling Leaderboard's multi-turn categories (v4, `bfcl-eval`), as per-turn
episodes whose earlier turns are replayed from the ground truth.

`bfcl-multi:base` (and `:miss_func`, `:miss_param`, `:long_context`; `bfcl-multi` takes all four). Each entry's
backends (GorillaFileSystem, TwitterAPI, ...) are built fresh for every rollout from its initial config (`World`);
calls are read as JSON (the model's `<tool_call>` blocks) or with `ast` (the ground truth's `cd(folder='x')`), checked
against the method's signature and dispatched on our own instances: no text ever reaches BFCL's `eval`-based executor,
whose instances live in module globals. A turn is scored by BFCL's own state and response checks
(`multi_turn_checker.state_checker`, `response_checker`) on our instances and results. Details: docs/tasks.md.
"""

from __future__ import annotations

import ast
import copy
import importlib
import inspect
import json
import random

from poise_trl.tasks.bfcl import INSTALL_HINT, _read_jsonl, parse_tool_calls, tools_system_prompt
from poise_trl.tasks.family import TaskError, TaskFamily, split_of

CATEGORIES = ("base", "miss_func", "miss_param", "long_context")
# BFCL's line where a held-out function becomes available (constants/default_prompts.py)
MORE_FUNCTIONS_PROMPT = "I have updated some more functions you can choose from. What about now?"


def _backend_config():
    try:
        from bfcl_eval.constants import executable_backend_config  # noqa: PLC0415 - an optional package
    except ModuleNotFoundError as error:
        raise TaskError(f"task bfcl-multi runs BFCL's backends from the bfcl-eval package: {INSTALL_HINT}") from error
    return executable_backend_config


def entries(category: str) -> list[dict]:
    """The category's entries, each with its `ground_truth` (a list of turns, each a list of call strings)."""
    if category not in CATEGORIES:
        raise TaskError(f"unknown BFCL multi-turn category {category!r}; use bfcl-multi:"
                        + " or bfcl-multi:".join(CATEGORIES))
    name = f"BFCL_v4_multi_turn_{category}.json"
    answers = {entry["id"]: entry["ground_truth"] for entry in _read_jsonl(f"possible_answer/{name}")}
    return [{**entry, "ground_truth": answers[entry["id"]]} for entry in _read_jsonl(name)]


def function_docs(entry: dict, turn: int) -> list[dict]:
    """The functions the model is shown at `turn`: those of the entry's classes, less any held out until a later
    turn (miss_func)."""
    config = _backend_config()
    docs = [doc for name in entry["involved_classes"]
            for doc in _read_jsonl(f"multi_turn_func_doc/{config.MULTI_TURN_FUNC_DOC_FILE_MAPPING[name]}")]
    held_out = {name for at, names in entry.get("missed_function", {}).items() if int(at) > turn for name in names}
    return [doc for doc in docs if doc["name"] not in held_out]


class CallError(ValueError):
    """A call string or tool call that is not one plain call of a known function with literal arguments."""


def parse_call_string(text: str) -> tuple[str, list, dict]:
    """`mv(source='a', destination='b')` -> ("mv", [], {...}), with `ast` (never evaluated): only a call of a plain
    name with literal arguments is accepted."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
            raise CallError(f"not a function call: {text!r}")
        return (node.func.id, [ast.literal_eval(arg) for arg in node.args],
                {keyword.arg: ast.literal_eval(keyword.value) for keyword in node.keywords})
    except (SyntaxError, ValueError) as error:
        raise CallError(f"cannot read {text!r} as a call with literal arguments: {error}") from None


def _as_text(result) -> str:
    """A result as BFCL's executor turns it into text (multi_turn_utils.execute_multi_turn_func_call)."""
    if isinstance(result, str):
        return result
    if isinstance(result, dict):
        try:
            return json.dumps(result)
        except TypeError:
            return str(result)
    return str(result)


class World:
    """Fresh instances of one entry's backends, loaded from its initial config; `call` runs one validated call."""

    def __init__(self, entry: dict):
        config = _backend_config()
        long_context = "long_context" in entry["id"]
        self.instances, self.methods = {}, {}
        for class_name in entry["involved_classes"]:
            instance = getattr(importlib.import_module(config.CLASS_FILE_PATH_MAPPING[class_name]), class_name)()
            if class_name not in config.STATELESS_CLASSES:
                instance._load_scenario(copy.deepcopy(entry["initial_config"].get(class_name, {})),
                                        long_context=long_context)
            self.instances[class_name] = instance
            self.methods.update({name: method for name, method in inspect.getmembers(instance, inspect.ismethod)
                                 if not name.startswith("_")})

    def named(self, name: str, args: list, kwargs: dict) -> dict:
        """The arguments of a call by name, as the model's JSON tool calls give them (`sort('a')` -> file_name)."""
        return dict(inspect.signature(self.methods[name]).bind(*args, **kwargs).arguments)

    def call(self, name: str, args: list, kwargs: dict, available: set[str]) -> str:
        """The result text of `name(*args, **kwargs)` on our instances, or BFCL's error line for a call that fails,
        names no available function or does not fit its signature."""
        if name not in available or name not in self.methods:
            return f"Error during execution: function {name!r} is not available"
        method = self.methods[name]
        try:
            inspect.signature(method).bind(*args, **kwargs)
        except TypeError as error:
            return f"Error during execution: {error}"
        try:
            return _as_text(method(*args, **kwargs))
        except Exception as error:  # noqa: BLE001 - the model reads it, as BFCL's executor returns it
            return f"Error during execution: {error}"


def ground_truth_calls(turn: list[str]) -> list[tuple[str, list, dict]]:
    return [parse_call_string(text) for text in turn]


def model_calls(completion: str) -> list[tuple[str, list, dict]]:
    """The calls of one assistant message in the model's tool-call format (`<tool_call>` JSON blocks)."""
    return [(name, [], arguments) for call in parse_tool_calls(completion) or [] for name, arguments in call.items()]


def available_functions(entry: dict, turn: int) -> set[str]:
    return {doc["name"] for doc in function_docs(entry, turn)}


def check_turns(entry: dict, model_turns: list[list[list[tuple]]]) -> dict:
    """BFCL's multi-turn check (multi_turn_checker.multi_turn_checker) on our own instances: for each turn, the
    model's steps (each a list of calls) run on the model's world, the ground truth on another; a turn that needs
    calls and has none, a state that differs or a ground-truth result missing from the model's results so far
    fails the entry. The check ends with the model's last turn. {"valid": bool, ...BFCL's error fields}."""
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import (  # noqa: PLC0415 - optional package
        response_checker,
        state_checker,
    )

    model_world, truth_world = World(entry), World(entry)
    model_results = []
    for turn, truth in enumerate(entry["ground_truth"]):
        available = available_functions(entry, turn)
        truth_calls = ground_truth_calls(truth)
        truth_results = [truth_world.call(*call, available) for call in truth_calls]
        steps = model_turns[turn]
        model_results += [model_world.call(*call, available) for step in steps for call in step]
        if not truth:
            continue
        if not any(steps):
            return {"valid": False, "error_type": "multi_turn:empty_turn_model_response", "turn": turn}
        for check in (state_checker(model_world.instances, truth_world.instances),
                      response_checker(model_results, truth_results, turn)):
            if not check["valid"]:
                return {**check, "turn": turn}
        if turn + 1 == len(model_turns):
            break
    return {"valid": True}


# ------------------------------------------------------------------------------------------ per-turn episodes


def replayed_world(entry: dict, turn: int) -> World:
    """A fresh world with the ground truth's calls of the turns before `turn` run on it: where a per-turn episode
    starts (the evaluation tools run the model's calls of `turn` on it, `evaluation/agent.py`)."""
    world = World(entry)
    for index in range(turn):
        available = available_functions(entry, index)
        for call in ground_truth_calls(entry["ground_truth"][index]):
            world.call(*call, available)
    return world


def replayed_prompt(entry: dict, turn: int) -> list[dict]:
    """The conversation up to `turn`'s user message: the tools shown at `turn` in the system prompt, each earlier
    turn as its user message, the ground truth's calls and their results on a fresh world."""
    world = World(entry)
    messages = [{"role": "system", "content": tools_system_prompt(function_docs(entry, turn))}]
    for index in range(turn + 1):
        messages += entry["question"][index] or [{"role": "user", "content": MORE_FUNCTIONS_PROMPT}]
        if index == turn:
            break
        available = available_functions(entry, index)
        calls = ground_truth_calls(entry["ground_truth"][index])
        if calls:
            # arguments as JSON text: a dataset column unifies dicts of different keys, filling the gaps with None
            messages.append({"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": name,
                                                  "arguments": json.dumps(world.named(name, args, kwargs))}}
                for name, args, kwargs in calls]})
            messages += [{"role": "tool", "name": name, "content": world.call(name, args, kwargs, available)}
                         for name, args, kwargs in calls]
        else:
            messages.append({"role": "assistant", "content": ""})
    return messages


def gold_completion(entry: dict, turn: int) -> str:
    """The turn's ground-truth calls in the model's tool-call format (arguments by name)."""
    world = World(entry)
    return "\n".join(f'<tool_call>\n{json.dumps({"name": name, "arguments": world.named(name, args, kwargs)})}\n'
                     "</tool_call>" for name, args, kwargs in ground_truth_calls(entry["ground_truth"][turn]))


def build_rows(variant: str | None, config: dict, split: str, size: int | None, seed: int) -> list[dict]:
    """One row per turn of each entry that needs calls: the replayed conversation before it, scored on that turn."""
    if split not in ("train", "test", "all"):
        raise TaskError(f"unknown split {split!r} for bfcl-multi; use 'train', 'test' or 'all'")
    categories = CATEGORIES if variant is None else (variant,)
    turns = [(entry, turn) for category in categories for entry in entries(category)
             if split in ("all", split_of(entry["id"])) for turn, truth in enumerate(entry["ground_truth"]) if truth]
    random.Random(seed).shuffle(turns)
    turns = turns if size is None else turns[:size]
    return [{"id": f"{entry['id']}:{turn}", "prompt": replayed_prompt(entry, turn),
             "answer": gold_completion(entry, turn),
             "verifier": {"category": entry["id"].rsplit("_", 1)[0].removeprefix("multi_turn_"), "id": entry["id"],
                          "turn": turn}} for entry, turn in turns]


_ENTRIES: dict[str, dict[str, dict]] = {}


def entry_of(entry_id: str) -> dict:
    """An entry by its id (`multi_turn_miss_func_3`), its category's entries read once."""
    category = entry_id.removeprefix("multi_turn_").rsplit("_", 1)[0]
    if category not in _ENTRIES:
        _ENTRIES[category] = {entry["id"]: entry for entry in entries(category)}
    return _ENTRIES[category][entry_id]


# --------------------------------------------------------------------------------- BFCL's result-file format


def call_string(name: str, args: list, kwargs: dict) -> str:
    """A parsed call as BFCL's decoded call strings write it: `mv(source='a', destination='b')`."""
    return f"{name}({', '.join([*map(repr, args), *(f'{key}={value!r}' for key, value in kwargs.items())])})"


def result_line(steps: list[str], verifier: dict) -> dict:
    """A per-turn episode as a line of BFCL's multi-turn result file (`BFCL_v4_multi_turn_<category>_result.json`):
    `result` holds, per turn, per step, the decoded call strings multi_turn_checker reads; the turns before the
    episode's turn as replayed from the ground truth (one step each), the episode's turn as the model's assistant
    messages `steps` (those with calls). The line stops at the episode's turn."""
    entry = entry_of(verifier["id"])
    replayed = [[turn] if turn else [] for turn in entry["ground_truth"][: verifier["turn"]]]
    model = [[call_string(*call) for call in calls] for calls in map(model_calls, steps)]
    return {"id": entry["id"], "result": [*replayed, [step for step in model if step]]}


def check_result_line(line: dict) -> dict:
    """BFCL's multi-turn check of a result line up to its last turn (`check_turns`), its call strings read with
    `ast` (`parse_call_string`); a string that is not one plain call is skipped, as BFCL's decoder skips what it
    cannot decode. {"valid": bool, ...BFCL's error fields}."""
    def readable(step):
        calls = []
        for text in step:
            try:
                calls.append(parse_call_string(text))
            except CallError:
                continue
        return calls
    entry = entry_of(line["id"])
    return check_turns(entry, [[readable(step) for step in turn] for turn in line["result"]])


def score_conversation(steps: list[str], verifier: dict) -> float:
    """1 when the episode's turn, one step per assistant message, passes BFCL's state and response checks, read
    from its result line (`result_line`, `check_result_line`)."""
    return float(check_result_line(result_line(steps, verifier))["valid"])


def score(completion: str, verifier: dict) -> float:
    """A one-message episode's score (`score_conversation`)."""
    return score_conversation([completion], verifier)


class ToolSession:
    """The tools of one rollout of a per-turn episode (`evaluation/agent.py`): a world replayed to the episode's
    turn, each call dispatched on it as the reward runs it."""

    def __init__(self, verifier: dict):
        entry, turn = entry_of(verifier["id"]), verifier["turn"]
        self.world, self.available = replayed_world(entry, turn), available_functions(entry, turn)

    def calls(self, text: str, ids: list[int], context: str) -> list[tuple[str, dict]]:
        """The calls of one assistant message, read as the reward reads them."""
        return [(name, arguments) for name, _, arguments in model_calls(text)]

    def call(self, name: str, arguments: dict) -> str:
        return self.world.call(name, [], arguments, self.available)

    def close(self) -> None:
        pass


TASK = TaskFamily(
    name="bfcl-multi",
    description="BFCL v4 multi-turn (base, miss_func, miss_param, long_context): per-turn episodes replayed from the "
                "ground truth, BFCL's state and response checks on fresh backends",
    answer_format='<tool_call>{"name": ..., "arguments": {...}}</tool_call>',
    build_rows=build_rows,
    score=score,
    variants=lambda: list(CATEGORIES),
    score_conversation=score_conversation,
    tool_session=ToolSession,
)
