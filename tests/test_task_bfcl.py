"""BFCL task family: rows from bfcl-eval's bundled v4 data, and BFCL's AST rule on completions.

The cases are BFCL's own questions and possible answers (bfcl-eval 2026.3.23, data/ and
data/possible_answer/)."""

import json

import pytest

from poise_trl.tasks import TaskError  # noqa: E402
from poise_trl.tasks.bfcl import CATEGORIES, TASK, parse_tool_calls  # noqa: E402


def all_rows(variant):
    return TASK.build_rows(variant, {}, "train", None, 0) + TASK.build_rows(variant, {}, "test", None, 0)


def tool_calls(calls):
    return "\n".join(
        f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls
    )


def row_by_id(row_id):
    return next(row for variant in CATEGORIES for row in all_rows(variant) if row["id"] == row_id)


@pytest.mark.parametrize("variant", list(CATEGORIES))
def test_possible_answers_written_as_calls_score_one(variant):
    rows = all_rows(variant)
    # verifiers travel as JSON text with sorted keys (poise_trl.tasks.task_rows)
    rewards = [TASK.score(row["answer"], json.loads(json.dumps(row["verifier"], sort_keys=True))) for row in rows]
    # BFCL's own data has answers whose first values its rule rejects: simple_python_200 (a required
    # parameter whose first possible value is the optional mark) and parallel_multiple_26 (a parameter the
    # function lacks).
    assert sum(rewards) / len(rewards) >= 0.98, variant


def _changed(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return -987654321
    if isinstance(value, str):
        return value + " and somewhere else entirely"
    if isinstance(value, list):
        return [*value, value[0] if value else "extra"]
    return {**value, "unexpected_key": 1}


@pytest.mark.parametrize("variant", list(CATEGORIES))
def test_one_changed_argument_fails(variant):
    failed = 0
    passing = [row for row in all_rows(variant) if TASK.score(row["answer"], row["verifier"]) == 1.0]
    for row in passing:
        calls = parse_tool_calls(row["answer"])
        name, arguments = next((name, args) for call in calls for name, args in call.items() if args)
        param = next(iter(arguments))
        arguments[param] = _changed(arguments[param])
        failed += (
            TASK.score(tool_calls([(n, a) for call in calls for n, a in call.items()]), row["verifier"])
            == 0.0
        )
    assert failed == len(passing)


@pytest.mark.parametrize("variant", list(CATEGORIES))
def test_wrong_function_name_fails(variant):
    for row in all_rows(variant)[:50]:
        calls = [(n, a) for call in parse_tool_calls(row["answer"]) for n, a in call.items()]
        calls[0] = (calls[0][0] + "_v2", calls[0][1])
        assert TASK.score(tool_calls(calls), row["verifier"]) == 0.0, row["id"]


@pytest.mark.parametrize("variant", ["parallel", "parallel_multiple"])
def test_parallel_calls_in_another_order_pass(variant):
    reordered = 0
    for row in all_rows(variant):
        calls = [(n, a) for call in parse_tool_calls(row["answer"]) for n, a in call.items()]
        if len(calls) > 1 and TASK.score(row["answer"], row["verifier"]) == 1.0:
            assert TASK.score(tool_calls(calls[::-1]), row["verifier"]) == 1.0, row["id"]
            reordered += 1
    assert reordered > 150


def test_missing_or_extra_call_fails():
    row = row_by_id("parallel_multiple_0")
    calls = [(n, a) for call in parse_tool_calls(row["answer"]) for n, a in call.items()]
    assert TASK.score(tool_calls(calls[:1]), row["verifier"]) == 0.0
    assert TASK.score(tool_calls(calls + calls[:1]), row["verifier"]) == 0.0


def test_bfcl_value_rules():
    # simple_python_0: calculate_triangle_area(base=10, height=5, unit optional: "units" or left out)
    verifier = row_by_id("simple_python_0")["verifier"]
    name = "calculate_triangle_area"

    def reward(arguments):
        return TASK.score(tool_calls([(name, arguments)]), verifier)

    assert reward({"base": 10, "height": 5}) == 1.0  # optional parameter left out
    assert reward({"base": 10, "height": 5, "unit": "Units"}) == 1.0  # strings compared without case
    assert reward({"base": 10, "height": 5, "unit": "cm"}) == 0.0
    assert reward({"base": 10}) == 0.0  # required parameter missing
    assert reward({"base": 10, "height": 5, "colour": "red"}) == 0.0  # unknown parameter
    assert reward({"base": "10", "height": 5}) == 0.0  # declared integer, given a string
    assert reward({"base": 10.0, "height": 5}) == 0.0  # declared integer, given a float
    # multiple_8: location is a string among "SD", "San Diego", "San Diego, CA", "CA"; budget a dict
    verifier = row_by_id("multiple_8")["verifier"]
    arguments = {
        "location": "san diego ca",
        "propertyType": "villa",
        "bedrooms": 3,
        "budget": {"min": 300000, "max": 400000},
    }
    assert TASK.score(tool_calls([("realestate.find_properties", arguments)]), verifier) == 1.0
    arguments["budget"] = {"min": 300000, "max": 450000}
    assert TASK.score(tool_calls([("realestate.find_properties", arguments)]), verifier) == 0.0


def test_int_accepted_for_float():
    # simple_python_200: fuel_efficiency is declared float, possible value 25.0
    verifier = row_by_id("simple_python_200")["verifier"]
    arguments = {"distance": 12000, "fuel_type": "gas", "fuel_efficiency": 25}
    assert TASK.score(tool_calls([("calculate_emissions", arguments)]), verifier) == 1.0


def test_completion_formats():
    row = row_by_id("simple_python_1")  # math.factorial(number=5)
    call = {"name": "math.factorial", "arguments": {"number": 5}}
    verifier = row["verifier"]
    assert TASK.score(json.dumps([call]), verifier) == 1.0
    assert TASK.score(f"Here you go:\n```json\n{json.dumps([call])}\n```", verifier) == 1.0
    assert TASK.score(f"<think>5! please</think>\n{row['answer']}", verifier) == 1.0
    assert TASK.score(f"{row['answer']}<think>no, wait", verifier) == 0.0  # thinking never closed
    string_arguments = {"name": "math.factorial", "arguments": json.dumps({"number": 5})}
    assert TASK.score(f"<tool_call>{json.dumps(string_arguments)}</tool_call>", verifier) == 1.0
    assert (
        TASK.score("<tool_call>{'name': 'math.factorial', 'arguments': {'number': 5}}</tool_call>", verifier)
        == 0.0
    )
    assert TASK.score("The factorial of 5 is 120.", verifier) == 0.0
    assert TASK.score("", verifier) == 0.0


def test_prompt_lists_the_functions_as_tools():
    row = row_by_id("simple_python_0")
    system, user = row["prompt"]
    assert system["role"] == "system" and user["role"] == "user"
    assert user["content"].startswith("Find the area of a triangle")
    tools_block = system["content"].split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    tool = json.loads(tools_block)
    assert tool["type"] == "function" and tool["function"]["name"] == "calculate_triangle_area"
    assert tool["function"]["parameters"]["type"] == "object"  # BFCL's "dict", as JSON Schema names it
    assert "<tool_call>" in system["content"]


def test_splits_partition_each_category_and_follow_the_seed():
    for variant in CATEGORIES:
        train = {row["id"] for row in TASK.build_rows(variant, {}, "train", None, 0)}
        test = {row["id"] for row in TASK.build_rows(variant, {}, "test", None, 0)}
        assert not train & test
        assert 0.12 < len(test) / len(train | test) < 0.28, variant
    everything = TASK.build_rows(None, {}, "test", None, 0)
    assert len({row["id"] for row in everything}) == len(everything) > 150
    first = [row["id"] for row in TASK.build_rows(None, {}, "test", 20, seed=3)]
    assert first == [row["id"] for row in TASK.build_rows(None, {}, "test", 20, seed=3)]
    assert first != [row["id"] for row in TASK.build_rows(None, {}, "test", 20, seed=4)]
    assert set(first) <= {row["id"] for row in everything}


def test_bad_variant_and_split():
    with pytest.raises(TaskError, match="bfcl:simple"):
        TASK.build_rows("simpel", {}, "train", None, 0)
    with pytest.raises(TaskError, match="train"):
        TASK.build_rows("simple", {}, "validation", None, 0)
