"""IFEval task family: seeded prompts from lm-eval's IFEval registry, graded by its own checkers."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from poise_trl.tasks import TaskError  # noqa: E402
from poise_trl.tasks.ifeval import EXCLUDED, SUPPORTED, TASK  # noqa: E402

# English without commas, for langdetect and the no-comma rule; the short words have no vowels.
FILLER = (
    "The ocean covers most of our planet and holds more life than any forest on land. "
    "Its tides follow the moon and its currents carry warm water far to the north. "
    "sky dry myth hymn"
)
FRENCH = "La mer est calme ce matin et les bateaux quittent le port sous un ciel clair et doux."
GERMAN = "Das Meer ist heute Morgen ruhig und die Boote verlassen den Hafen unter einem klaren Himmel."
SPANISH = "El mar está tranquilo esta mañana y los barcos salen del puerto bajo un cielo despejado."


def filler_without(*avoided: str) -> str:
    """FILLER less every word that contains one of `avoided` (words, or single letters)."""
    words = [w for w in FILLER.split() if not any(a.lower() in w.lower() for a in avoided)]
    return " ".join(words) + "."


def paragraphs(count: int) -> list[str]:
    return [f"Paragraph {i} tells of the sea and its long slow waves." for i in range(1, count + 1)]


# instruction id -> a response that follows it, from the instruction's arguments
RESPONSES = {
    "change_case:english_capital": lambda a: FILLER.upper(),
    "change_case:english_lowercase": lambda a: FILLER.lower(),
    "combination:repeat_prompt": lambda a: f"{a['prompt_to_repeat']} {FILLER}",
    "combination:two_responses": lambda a: f"{FILLER}\n******\nA calm sea at night is dark and quiet.",
    "detectable_content:number_placeholders": lambda a: FILLER + " [name]" * a["num_placeholders"],
    "detectable_content:postscript": lambda a: f"{FILLER}\n\n{a['postscript_marker']} Bring a towel.",
    "detectable_format:json_format": lambda a: "```json\n" + json.dumps({"note": FILLER}) + "\n```",
    "detectable_format:multiple_sections": lambda a: "\n".join(
        f"{a['section_spliter']} {i}\n{FILLER}" for i in range(1, a["num_sections"] + 1)
    ),
    "detectable_format:number_bullet_lists": lambda a: "\n".join(["* A point."] * a["num_bullets"]),
    "detectable_format:number_highlighted_sections": lambda a: FILLER + " *a part*" * a["num_highlights"],
    "detectable_format:title": lambda a: f"<<the sea>>\n{FILLER}",
    "keywords:existence": lambda a: " ".join(a["keywords"]) + " " + FILLER,
    "keywords:forbidden_words": lambda a: filler_without(*a["forbidden_words"]),
    "keywords:frequency": lambda a: (
        f"{a['keyword']} " * a["frequency"] + FILLER
        if a["relation"] == "at least"
        else filler_without(a["keyword"])
    ),
    "keywords:letter_frequency": lambda a: (
        a["letter"] * a["let_frequency"] + " " + FILLER
        if a["let_relation"] == "at least"
        else filler_without(a["letter"])
    ),
    "length_constraints:nth_paragraph_first_word": lambda a: "\n\n".join(
        f"{a['first_word']} {p}" if i == a["nth_paragraph"] else p
        for i, p in enumerate(paragraphs(a["num_paragraphs"]), start=1)
    ),
    "length_constraints:number_paragraphs": lambda a: "\n***\n".join(paragraphs(a["num_paragraphs"])),
    "length_constraints:number_words": lambda a: (
        "word " * a["num_words"] if a["relation"] == "at least" else "A short answer."
    ),
    "punctuation:no_comma": lambda a: FILLER,
    "startend:end_checker": lambda a: f"{FILLER} {a['end_phrase']}",
    "startend:quotation": lambda a: f'"{FILLER}"',
    "language:response_language": lambda a: {"fr": FRENCH, "de": GERMAN, "es": SPANISH}.get(
        a["language"], ""
    ),
}


def single_constraint_rows(instruction_id, size=12):
    config = {"instructions": [instruction_id], "min_constraints": 1, "max_constraints": 1}
    return TASK.build_rows(None, config, "train", size, 0)


def test_every_supported_instruction_has_a_response_builder():
    assert set(RESPONSES) == set(SUPPORTED)
    assert not set(SUPPORTED) & set(EXCLUDED)


@pytest.mark.parametrize("instruction_id", sorted(set(RESPONSES) - {"language:response_language"}))
def test_responses_that_follow_their_constraint_score_one(instruction_id):
    for row in single_constraint_rows(instruction_id):
        (kwargs,) = row["verifier"]["kwargs"]
        response = RESPONSES[instruction_id](kwargs)
        assert TASK.score(response, row["verifier"]) == 1.0, (row["prompt"][0]["content"], response)
        assert TASK.score(f"<think>Plan it.</think>\n\n{response}", row["verifier"]) == 1.0


def test_response_language():
    rows = single_constraint_rows("language:response_language", size=60)
    known = [row for row in rows if row["verifier"]["kwargs"][0]["language"] in ("fr", "de", "es")]
    assert known
    for row in known:
        assert (
            TASK.score(RESPONSES["language:response_language"](row["verifier"]["kwargs"][0]), row["verifier"])
            == 1.0
        )
        assert TASK.score(FILLER, row["verifier"]) == 0.0


# Instructions one response can follow together; compose() writes it.
COMPOSABLE = [
    "detectable_format:title",
    "detectable_content:postscript",
    "keywords:existence",
    "punctuation:no_comma",
    "startend:end_checker",
    "detectable_content:number_placeholders",
    "detectable_format:number_highlighted_sections",
    "change_case:english_lowercase",
    "keywords:forbidden_words",
]


def compose(verifier) -> str:
    """A response following every constraint of `verifier` (all COMPOSABLE); "zephyr" is in no word list."""
    args = dict(zip(verifier["instruction_id_list"], verifier["kwargs"], strict=True))
    avoided = args.get("keywords:forbidden_words", {}).get("forbidden_words", [])
    parts = ["<<zephyr>>"] if "detectable_format:title" in args else []
    parts += [*args.get("keywords:existence", {}).get("keywords", []), filler_without(*avoided)]
    parts += ["[zephyr]"] * args.get("detectable_content:number_placeholders", {}).get("num_placeholders", 0)
    parts += ["*zephyr*"] * args.get("detectable_format:number_highlighted_sections", {}).get("num_highlights", 0)
    if "detectable_content:postscript" in args:
        parts.append("\n" + args["detectable_content:postscript"]["postscript_marker"] + " zephyr")
    parts.append(args.get("startend:end_checker", {}).get("end_phrase", ""))
    text = " ".join(parts)
    return text.lower() if "change_case:english_lowercase" in args else text


def test_composed_responses_follow_all_their_constraints():
    rows = TASK.build_rows(None, {"instructions": COMPOSABLE, "min_constraints": 2}, "train", 60, 1)
    assert all(2 <= len(row["verifier"]["instruction_id_list"]) <= 3 for row in rows)
    assert len({tuple(row["verifier"]["instruction_id_list"]) for row in rows}) > 20
    for row in rows:
        assert TASK.score(compose(row["verifier"]), row["verifier"]) == 1.0, row["prompt"][0]["content"]


def test_no_prompt_forbids_a_word_of_its_required_end_phrase():
    # The registry's word list holds "other", "anything", "can" and "help", words of its end phrases.
    config = {"instructions": ["keywords:forbidden_words", "startend:end_checker"], "min_constraints": 2}
    for row in TASK.build_rows(None, config, "train", 600, 0):
        assert TASK.score(compose(row["verifier"]), row["verifier"]) == 1.0, row["prompt"][0]["content"]


def test_breaking_one_of_two_constraints_scores_half():
    config = {"instructions": ["punctuation:no_comma", "detectable_format:title"], "min_constraints": 2}
    (row,) = TASK.build_rows(None, config, "train", 1, 0)
    assert TASK.score("<<the sea>>\nWaves, wind and salt.", row["verifier"]) == 0.5
    assert TASK.score("<<the sea>>\nWaves and wind and salt.", row["verifier"]) == 1.0
    assert TASK.score("Waves, wind and salt.", row["verifier"]) == 0.0


def test_answer_part_and_empty_responses():
    row = single_constraint_rows("punctuation:no_comma", size=1)[0]
    assert TASK.score("<think>a, b, c</think>No commas here.", row["verifier"]) == 1.0  # thoughts not graded
    assert TASK.score("<think>No commas here and the thought never ends", row["verifier"]) == 0.0
    assert TASK.score("<think>ok</think>   ", row["verifier"]) == 0.0  # IFEval fails an empty response


def test_prompts_are_seeded_and_the_splits_share_none():
    train = TASK.build_rows(None, {}, "train", 800, 0)
    assert train == TASK.build_rows(None, {}, "train", 800, 0)
    assert train != TASK.build_rows(None, {}, "train", 800, 1)
    test = TASK.build_rows(None, {}, "test", 300, 0)
    train_prompts = {row["prompt"][0]["content"] for row in train}
    assert len(train_prompts) == len(train)
    assert not train_prompts & {row["prompt"][0]["content"] for row in test}
    assert not {row["id"] for row in train} & {row["id"] for row in test}
    sizes = {len(row["verifier"]["instruction_id_list"]) for row in train}
    assert sizes == {1, 2, 3}
    assert json.loads(json.dumps(train[0]["verifier"])) == train[0]["verifier"]


def test_prompts_never_pair_conflicting_instructions():
    from lm_eval.tasks.ifeval.instructions_registry import INSTRUCTION_CONFLICTS

    for row in TASK.build_rows(None, {"min_constraints": 2}, "train", 1000, 2):
        ids = row["verifier"]["instruction_id_list"]
        for i, first in enumerate(ids):
            for second in ids[i + 1 :]:
                assert (
                    second not in INSTRUCTION_CONFLICTS[first] and first not in INSTRUCTION_CONFLICTS[second]
                )


def test_building_rows_leaves_the_global_random_state_alone():
    import random

    random.seed(123)
    expected = random.random()
    random.seed(123)
    TASK.build_rows(None, {}, "train", 20, 0)
    assert random.random() == expected


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"instructions": ["length_constraints:number_sentences"]}, "punkt"),
        ({"instructions": ["keywords:existance"]}, "did you mean 'keywords:existence'"),
        ({"instructions": 3}, "list of instruction ids"),
        ({"instructions": "punctuation:no_comma"}, "list of instruction ids"),
        ({"min_constraints": 3, "max_constraints": 2}, "above max_constraints"),
        ({"max_constraints": 0}, "positive integer"),
        ({"instructions": ["punctuation:no_comma"], "min_constraints": 2}, "above the 1 instructions"),
    ],
)
def test_bad_config(config, message):
    with pytest.raises(TaskError, match=message):
        TASK.build_rows(None, config, "train", 5, 0)


def test_asking_for_more_prompts_than_the_allow_list_makes():
    config = {"instructions": ["punctuation:no_comma"], "max_constraints": 1}
    with pytest.raises(TaskError, match="lower size"):
        TASK.build_rows(None, config, "train", 100, 0)


def test_import_and_scoring_never_touch_the_network(tmp_path):
    # nltk finds no punkt data (NLTK_DATA points at an empty folder); an audit hook sees every name lookup,
    # connection and URL request, whoever makes it (the registry's own import looks up GitHub's host).
    code = (
        "import sys\n"
        "def hook(event, args):\n"
        "    if event in ('socket.getaddrinfo', 'socket.connect', 'urllib.Request'):\n"
        "        print('NETWORK', event, args[:2], flush=True)\n"
        "sys.addaudithook(hook)\n"
        "from poise_trl.tasks.ifeval import TASK\n"
        "rows = TASK.build_rows(None, {}, 'train', 50, 0)\n"
        "print('MEAN', sum(TASK.score('A calm sea.', row['verifier']) for row in rows) / len(rows))\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "NLTK_DATA": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert done.returncode == 0, done.stderr
    assert "NETWORK" not in done.stdout and "MEAN" in done.stdout, done.stdout
