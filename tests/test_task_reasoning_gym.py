import json
import statistics

import pytest
import reasoning_gym
from reasoning_gym.utils import SYSTEM_PROMPTS

from poise_trl.tasks import TaskError
from poise_trl.tasks.reasoning_gym import (
    DEFAULT_TRAIN_SIZE,
    TASK,
    TEST_SEED_OFFSET,
    cached_dataset,
    generator_names,
)

ROWS_PER_FAMILY = 20

# A spread of generators: arithmetic, algebra, logic, graphs, games, strings, induction, geometry,
# probability and ARC (scored on a regenerated entry). Left out: generators whose own scorer gives
# partial credit to near misses (calendar_arithmetic, time_intervals, complex_arithmetic, rectangle_count,
# acre, emoji_mystery, pool_matrix, codeio), keeps no gold answer (graph_color, rush_hour, ...), or
# scores any non-empty answer 1.0 (game_of_life_halting, an upstream bug).
ORACLE_FAMILIES = [
    "basic_arithmetic", "chain_sum", "products", "decimal_arithmetic", "gcd", "lcm", "prime_factorization",
    "count_primes", "fraction_simplification", "bitwise_arithmetic",
    "simple_equations", "polynomial_multiplication",
    "knights_knaves", "syllogism", "circuit_logic", "self_reference",
    "shortest_path", "largest_island", "course_schedule", "family_relationships",
    "maze", "mini_sudoku", "n_queens", "tower_of_hanoi",
    "spell_backward", "letter_counting", "caesar_cipher", "word_sorting", "isomorphic_strings",
    "number_sequence", "list_functions", "count_bits", "base_conversion",
    "simple_geometry", "coin_flip", "arc_agi",
]


def completion(answer: str) -> str:
    return f"<think>Let me work it out.</think><answer>{answer}</answer>"


def perturbed(answer: str) -> str:
    """Every digit and letter moved on by one: the answer's shape, with its content wrong."""
    def shift(c: str) -> str:
        if c.isdigit():
            return str((int(c) + 1) % 10)
        for first in ("a", "A"):
            if first <= c <= chr(ord(first) + 25):
                return chr((ord(c) - ord(first) + 1) % 26 + ord(first))
        return c
    return "".join(map(shift, answer))


def round_trip(verifier: dict) -> dict:
    return json.loads(json.dumps(verifier))


def test_rows_are_what_reasoning_gym_yields():
    for name, config in [("leg_counting", {"max_animals": 4}), ("arc_agi", {}), ("basic_arithmetic", {})]:
        rows = TASK.build_rows(name, config, "train", 5, 7)
        entries = list(reasoning_gym.create_dataset(name, size=5, seed=7, **config))
        assert len(rows) == len(entries)
        for index, (row, entry) in enumerate(zip(rows, entries, strict=True)):
            assert row["id"] == f"{name}/7/{index}"
            assert row["prompt"] == [{"role": "system", "content": SYSTEM_PROMPTS["DeepSeekZero"]},
                                     {"role": "user", "content": entry["question"]}]
            assert row["answer"] == str(entry["answer"])
            assert row["verifier"]["entry"] == json.loads(json.dumps(entry))
            assert row["verifier"]["config"] == {**config, "size": 5, "seed": 7}
            assert round_trip(row["verifier"]) == row["verifier"]


def test_system_prompt_is_chosen_from_reasoning_gyms_own():
    rows = TASK.build_rows("gcd", {"system_prompt": "direct"}, "train", 2, 0)
    assert rows[0]["prompt"][0]["content"] == SYSTEM_PROMPTS["direct"]
    assert "system_prompt" not in rows[0]["verifier"]["config"]


@pytest.mark.parametrize("name", ORACLE_FAMILIES)
def test_true_answers_score_full_and_wrong_ones_nothing(name):
    rows = TASK.build_rows(name, {}, "train", ROWS_PER_FAMILY, 0)
    verifiers = [round_trip(row["verifier"]) for row in rows]
    oracle = statistics.mean(TASK.score(completion(r["answer"]), v) for r, v in zip(rows, verifiers, strict=True))
    word = statistics.mean(TASK.score(completion("wrong"), v) for v in verifiers)
    # An answer with no digit or letter (list_functions' "[]") has no perturbed form.
    changed = [(perturbed(r["answer"]), v) for r, v in zip(rows, verifiers, strict=True)
               if perturbed(r["answer"]) != r["answer"]]
    assert len(changed) >= len(rows) // 2
    near = statistics.mean(TASK.score(completion(answer), v) for answer, v in changed)
    print(f"{name}: oracle {oracle:.3f}, 'wrong' {word:.3f}, perturbed {near:.3f}")
    assert oracle >= 0.99
    assert word <= 0.05
    assert near <= 0.05


def test_every_generator_scores_its_gold_the_same_after_a_json_round_trip():
    """The JSON verifier must grade as the live entry does (else the generator belongs in
    SCORED_ON_REGENERATED_ENTRY); default configs, two rows each."""
    for name in generator_names():
        dataset = reasoning_gym.create_dataset(name, size=2, seed=3)
        for row, entry in zip(TASK.build_rows(name, {}, "train", 2, 3), dataset, strict=True):
            live = min(max(float(dataset.score_answer(row["answer"], entry)), 0.0), 1.0)
            assert TASK.score(completion(row["answer"]), round_trip(row["verifier"])) == live, name


def test_unparsable_completions_score_zero():
    row = TASK.build_rows("prime_factorization", {}, "train", 1, 0)[0]
    verifier = row["verifier"]
    with pytest.raises(ValueError):  # the generator's own scorer raises on words; the task gives 0
        cached_dataset("prime_factorization", json.dumps(verifier["config"], sort_keys=True)).score_answer(
            "wrong", verifier["entry"])
    assert TASK.score(completion("wrong"), verifier) == 0.0
    assert TASK.score(row["answer"], verifier) == 0.0  # no <answer> tag
    assert TASK.score(f"<think>so <answer>{row['answer']}</answer>", verifier) == 0.0  # cut off mid-thought
    assert TASK.score(completion(row["answer"]), verifier) == 1.0


def test_held_out_split_is_a_later_seed_without_train_questions():
    # A small question space, so the later seed repeats some train questions.
    config = {"min_value": 2, "max_value": 12, "min_numbers": 2, "max_numbers": 2}
    train = TASK.build_rows("lcm", config, "train", 40, 5)
    test = TASK.build_rows("lcm", config, "test", 40, 5)
    train_questions = {row["prompt"][1]["content"] for row in train}
    later = list(reasoning_gym.create_dataset("lcm", size=40, seed=5 + TEST_SEED_OFFSET, **config))
    kept = [(i, e) for i, e in enumerate(later) if e["question"] not in train_questions]
    assert 0 < len(kept) < len(later)
    assert [row["id"] for row in test] == [f"lcm/{5 + TEST_SEED_OFFSET}/{i}" for i, _ in kept]
    assert [row["verifier"]["entry"]["question"] for row in test] == [e["question"] for _, e in kept]
    assert not train_questions & {row["prompt"][1]["content"] for row in test}


def test_default_size():
    assert len(TASK.build_rows("gcd", {}, "train", None, 0)) == DEFAULT_TRAIN_SIZE


@pytest.mark.parametrize(
    "variant, config, message",
    [
        ("leg_countin", {}, "did you mean leg_counting"),
        ("leg_counting", {"max_animal": 3}, "its keys are max_animals, max_instances, min_animals, min_instances"),
        ("leg_counting", {"seed": 3}, "set size and seed on the task"),
        ("leg_counting", {"min_animals": 5, "max_animals": 2}, "max_animals must be >= min_animals"),
        ("leg_counting", {"system_prompt": "terse"}, "DeepSeekZero, default"),
        (None, {}, "reasoning-gym:<generator>"),
        ("composite", {}, "give each generator its own task"),
    ],
)
def test_bad_names_and_keys_give_one_line(variant, config, message):
    with pytest.raises(TaskError) as error:
        TASK.build_rows(variant, config, "train", 3, 0)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_variants_and_config_keys_cover_the_generators():
    assert "leg_counting" in TASK.variants() and "composite" not in TASK.variants()
    assert {"max_animals", "min_value", "system_prompt"} <= TASK.config_keys
    assert not {"size", "seed"} & TASK.config_keys
