"""BFCL: the Berkeley Function Calling Leaderboard's single-turn Python categories (v4, `bfcl-eval`).

`bfcl` takes all four categories, `bfcl:<category>` one. Functions are JSON tools in the system prompt;
calls are read from `<tool_call>` blocks after the last `</think>`. Reward 1 or 0 by BFCL's AST rule,
reimplemented (bfcl-eval's checker imports every model client). Details: docs/tasks.md ("BFCL").
"""

from __future__ import annotations

import json
import random
import re
from importlib import resources

from poise_trl.tasks.family import TaskError, TaskFamily, answer_part, split_of

# variant -> the category's name in BFCL's file names
CATEGORIES = {
    "simple": "simple_python",
    "multiple": "multiple",
    "parallel": "parallel",
    "parallel_multiple": "parallel_multiple",
}
INSTALL_HINT = "pip install --no-deps bfcl-eval==2026.3.23"

SYSTEM_PROMPT = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                 "You are provided with function signatures within <tools></tools> XML tags:\n"
                 "<tools>\n{tools}\n</tools>\n\n"
                 "For each function call, return a json object with function name and arguments within "
                 '<tool_call></tool_call> XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": '
                 "<args-json-object>}}\n</tool_call>")

# BFCL's Python type names where JSON Schema (what chat templates show) names them otherwise.
_JSON_SCHEMA_TYPES = {"dict": "object", "float": "number", "tuple": "array", "any": "string"}
# BFCL's type names -> the Python type a decoded argument must have; "any" is compared as a string.
_PYTHON_TYPES = {
    "string": str,
    "integer": int,
    "float": float,
    "boolean": bool,
    "array": list,
    "tuple": list,
    "dict": dict,
    "any": str,
}
# BFCL forgives case, spacing and this punctuation in strings ("April 1, 2024" == "april 1 2024").
_IGNORED_IN_STRINGS_RE = re.compile(r"[ ,./\-_*^]")


# ------------------------------------------------------------------------------------------------- rows


def _data_file(name: str):
    try:
        return resources.files("bfcl_eval") / "data" / name
    except ModuleNotFoundError as error:
        raise TaskError(
            f"task bfcl reads its questions from the bfcl-eval package: {INSTALL_HINT}"
        ) from error


def _read_jsonl(name: str) -> list[dict]:
    return [json.loads(line) for line in _data_file(name).read_text(encoding="utf-8").splitlines() if line]


def _json_schema(node):
    """BFCL's function description with JSON Schema type names, as a chat template's tools list has them."""
    if isinstance(node, dict):
        return {
            key: _JSON_SCHEMA_TYPES.get(value, value)
            if key == "type" and isinstance(value, str)
            else _json_schema(value)
            for key, value in node.items()
        }
    if isinstance(node, list):
        return [_json_schema(item) for item in node]
    return node


def tools_system_prompt(functions: list[dict]) -> str:
    """The tools section as Qwen3's chat template renders `tools=`: its `tojson` keeps non-ASCII text (x²)."""
    tools = [{"type": "function", "function": _json_schema(function)} for function in functions]
    return SYSTEM_PROMPT.format(tools="\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools))


def _first_choice(option):
    """A possible value as a call writes it: BFCL's possible dicts (alone or in a list) hold a list of
    possible values for each key, compared one level deep."""
    if isinstance(option, dict):
        return {key: options[0] for key, options in option.items() if options[0] != ""}
    if isinstance(option, list) and option and all(isinstance(item, dict) for item in option):
        return [_first_choice(item) for item in option]
    return option


def gold_completion(possible_answer: list[dict]) -> str:
    """The expected calls as a completion, each parameter at its first possible value (left out where that
    is "", BFCL's mark of an optional parameter)."""
    calls = []
    for expected in possible_answer:
        ((name, arguments),) = expected.items()
        chosen = {
            param: _first_choice(options[0]) for param, options in arguments.items() if options[0] != ""
        }
        calls.append(json.dumps({"name": name, "arguments": chosen}))
    return "\n".join(f"<tool_call>\n{call}\n</tool_call>" for call in calls)


def _category_rows(category: str) -> list[dict]:
    questions = _read_jsonl(f"BFCL_v4_{category}.json")
    answers = {
        entry["id"]: entry["ground_truth"]
        for entry in _read_jsonl(f"possible_answer/BFCL_v4_{category}.json")
    }
    return [
        {
            "id": question["id"],
            "prompt": [
                {"role": "system", "content": tools_system_prompt(question["function"])},
                *question["question"][0],  # single-turn categories: one turn
            ],
            "answer": gold_completion(answers[question["id"]]),
            "verifier": {"functions": question["function"], "possible_answer": answers[question["id"]]},
        }
        for question in questions
    ]


def _categories(variant: str | None) -> list[str]:
    if variant is None:
        return list(CATEGORIES.values())
    if variant not in CATEGORIES:
        raise TaskError(f"unknown BFCL category {variant!r}; use bfcl:{' or bfcl:'.join(CATEGORIES)}, "
                        "or bfcl for all four")
    return [CATEGORIES[variant]]


def build_rows(variant: str | None, config: dict, split: str, size: int | None, seed: int) -> list[dict]:
    """The split's questions of the chosen categories in a seeded order, the first `size` of them (all when
    `size` is None or larger than the split)."""
    if split not in ("train", "test", "all"):
        raise TaskError(f"unknown split {split!r} for bfcl; use 'train', 'test' or 'all'")
    rows = [
        row
        for category in _categories(variant)
        for row in _category_rows(category)
        if split in ("all", split_of(row["id"]))
    ]
    random.Random(seed).shuffle(rows)
    return rows if size is None else rows[:size]


# ------------------------------------------------------------------------------------------------ calls


def _loads(text: str):
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):  # JSON nested deeper than the interpreter's stack
        return None


def _tool_call_blocks(text: str) -> list[str]:
    """The text inside each `<tool_call>...</tool_call>`, in one pass: a lazy regex would rescan the rest
    of the text from every unclosed tag (quadratic on a million of them)."""
    blocks, at = [], 0
    while (start := text.find("<tool_call>", at)) >= 0 and (end := text.find("</tool_call>", start)) >= 0:
        blocks.append(text[start + len("<tool_call>"):end])
        at = end + len("</tool_call>")
    return blocks


def parse_tool_calls(text: str) -> list[dict] | None:
    """The completion's calls as BFCL writes them, `[{name: arguments}, ...]`; None when it has none in a
    readable form (or opened `<think>` and never closed it)."""
    text = answer_part(text)
    if text is None:
        return None
    blocks = _tool_call_blocks(text)
    if blocks:
        raw = [_loads(block) for block in blocks]
    else:
        start, end = text.find("["), text.rfind("]")
        raw = _loads(text[start : end + 1]) if 0 <= start < end else None
    if not isinstance(raw, list) or not raw:
        return None
    calls = []
    for call in raw:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # OpenAI's API sends arguments as a JSON string; some models copy that
            arguments = _loads(arguments)
        if not isinstance(arguments, dict):
            return None
        calls.append({call["name"]: arguments})
    return calls


# -------------------------------------------------------------------------------------------- BFCL's rule


def _normalised(value):
    return _IGNORED_IN_STRINGS_RE.sub("", value).lower().replace("'", '"') if isinstance(value, str) else value


def _as_lists(possible: list) -> list:
    # BFCL reads the optional mark "" as an empty list where it compares lists.
    return [[] if option == "" else option for option in possible]


def _type_ok(value, possible: list, expected: type, item_type: type | None) -> tuple[bool, bool]:
    """(whether `value` has an acceptable type, whether the answer names a variable rather than a value)."""
    answer_type = next((type(option) for option in possible if option != ""), None)
    is_variable = answer_type is not None and answer_type is not expected
    if type(value) is expected:
        if item_type is None:
            return True, is_variable
        items_ok = any(
            not isinstance(option, list) or all(_type_ok(item, option, item_type, None)[0] for item in value)
            for option in possible
        )
        return items_ok, is_variable
    return answer_type is not None and type(value) is answer_type, True


def _dict_matches(value, answer) -> bool:
    if not isinstance(value, dict) or not isinstance(answer, dict):
        return False
    for key, item in value.items():
        if key not in answer or _normalised(item) not in [_normalised(option) for option in answer[key]]:
            return False
    return all(key in value or "" in options for key, options in answer.items())


def _value_matches(value, possible: list, schema: dict) -> bool:
    kind = schema["type"]
    expected = _PYTHON_TYPES[kind]
    item_type = _PYTHON_TYPES[schema["items"]["type"]] if kind in ("array", "tuple") else None
    if kind == "float" and type(value) is int:
        value = float(value)
    type_ok, is_variable = _type_ok(value, possible, expected, item_type)
    if not type_ok:
        return False
    if is_variable:
        return value in possible
    if expected is dict:
        return any(_dict_matches(value, option) for option in possible if option != "")
    if expected is list and item_type is dict:
        return any(
            len(option) == len(value) and all(map(_dict_matches, value, option))
            for option in _as_lists(possible)
        )
    if expected is str:
        return _normalised(value) in [_normalised(option) for option in possible if isinstance(option, str)]
    if expected is list:
        return [_normalised(item) for item in value] in [
            [_normalised(item) for item in option] for option in _as_lists(possible)
        ]
    return value in possible


def _call_matches(call: dict, name: str, expected: dict, function: dict) -> bool:
    if name not in call:
        return False
    arguments, parameters = call[name], function["parameters"]
    if any(param not in arguments for param in parameters.get("required", [])):
        return False
    for param, value in arguments.items():
        if param not in parameters["properties"] or param not in expected:
            return False
        if not _value_matches(value, expected[param], parameters["properties"][param]):
            return False
    return all(param in arguments or "" in options for param, options in expected.items())


def _one_to_one(matches: list[list[bool]], expected: int, free: frozenset) -> bool:
    """Whether the expected calls from index `expected` on can each take a different call among `free`
    that matches them."""
    if expected == len(matches):
        return True
    return any(matches[expected][i] and _one_to_one(matches, expected + 1, free - {i}) for i in free)


def calls_match(calls: list[dict], possible_answer: list[dict], functions: list[dict]) -> bool:
    """BFCL's AST check: the calls, in any order, are the expected ones."""
    if len(calls) != len(possible_answer):
        return False
    by_name = {function["name"]: function for function in functions}
    matches = [
        [_call_matches(call, name, arguments, by_name[name]) for call in calls]
        for name, arguments in (next(iter(expected.items())) for expected in possible_answer)
    ]
    return _one_to_one(matches, 0, frozenset(range(len(calls))))


def score(completion: str, verifier: dict) -> float:
    calls = parse_tool_calls(completion)
    if calls is None:
        return 0.0
    return float(calls_match(calls, verifier["possible_answer"], verifier["functions"]))


TASK = TaskFamily(
    name="bfcl",
    description="BFCL v4 function calling (simple, multiple, parallel, parallel_multiple; Python), AST check",
    answer_format='<tool_call>{"name": ..., "arguments": {...}}</tool_call>',
    build_rows=build_rows,
    score=score,
    variants=lambda: list(CATEGORIES),
)
