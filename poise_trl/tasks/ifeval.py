"""IFEval-style instruction following: a writing request with 1-3 verifiable constraints.

lm-eval's IFEval instructions drawn per prompt from a seed; reward: the share of constraints the answer
follows by IFEval's strict check (offline, those needing nltk's punkt data are left out). Details:
docs/tasks.md ("IFEval").
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import io
import random

from poise_trl.tasks.family import TaskError, TaskFamily, answer_part, split_of

INSTALL_HINT = "pip install --no-deps lm-eval==0.4.13 && pip install nltk langdetect immutabledict sacrebleu requests"

try:
    import langdetect
    import nltk
except ModuleNotFoundError as error:
    raise ModuleNotFoundError(f"task ifeval needs lm-eval's IFEval checkers: {INSTALL_HINT}") from error


@contextlib.contextmanager
def _no_punkt_download():
    """Refuses the punkt_tab download the registry starts on import when nltk has no copy (and hides the
    'Downloaded punkt_tab' line it prints regardless); no supported instruction uses punkt."""
    download = nltk.download
    nltk.download = lambda *args, **kwargs: False
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        nltk.download = download


with _no_punkt_download():
    try:
        from lm_eval.tasks.ifeval import instructions_registry
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(f"task ifeval needs lm-eval's IFEval checkers: {INSTALL_HINT}") from error

# langdetect samples at random; a fixed seed gives a completion the same reward on every call.
langdetect.DetectorFactory.seed = 0

INSTRUCTIONS = instructions_registry.INSTRUCTION_DICT
EXCLUDED = {
    "length_constraints:number_sentences": "it counts sentences with nltk's punkt model, a download",
    "change_case:capital_word_frequency": "it splits words with nltk's punkt model, a download",
    "detectable_format:constrained_response": "a bare 'My answer is yes/no/maybe.' fits no writing request",
}
SUPPORTED = tuple(sorted(set(INSTRUCTIONS) - set(EXCLUDED)))
REPEAT_PROMPT = "combination:repeat_prompt"

# Generic requests any constraint can apply to. No commas: combination:repeat_prompt has the request
# repeated, which would break punctuation:no_comma.
BASE_REQUESTS = (
    "Write a short note about the ocean.",
    "Write a short story about a lost umbrella.",
    "Describe a busy train station at dawn.",
    "Write a letter to a friend who moved to another city.",
    "Explain how bread rises to a curious child.",
    "Write a product description for a reusable water bottle.",
    "Write a blog post about learning to ride a bicycle as an adult.",
    "Describe your ideal weekend in the mountains.",
    "Write a review of an imaginary neighbourhood cafe.",
    "Write a short speech for a school science fair.",
    "Explain why people enjoy gardening.",
    "Write a diary entry from the point of view of a lighthouse keeper.",
    "Give advice to someone starting their first job.",
    "Write a travel guide entry for a small coastal town.",
    "Describe the smell and sound of rain in a forest.",
    "Write an advertisement for a community library.",
    "Write a short essay about the value of friendship.",
    "Explain how to plan a picnic for a large family.",
    "Write a thank-you note to a volunteer firefighter.",
    "Describe a city from the view of a pigeon.",
    "Write a short biography of a fictional inventor.",
    "Write a poem about the changing seasons.",
    "Explain the rules of a board game you invented.",
    "Write an email asking a neighbour to water your plants.",
    "Describe the first day of spring in a small village.",
    "Write a short history of an imaginary island.",
    "Give tips for keeping a kitchen tidy.",
    "Write a motivational message for students before exams.",
    "Describe a market stall that sells only blue things.",
    "Write a news report about a town festival.",
    "Explain why sleep matters for health.",
    "Write a fairy tale about a clockmaker and a fox.",
    "Write a welcome message for new members of a hiking club.",
    "Describe how a river changes from its source to the sea.",
    "Write a short guide to caring for a houseplant.",
    "Write a letter from a cat to its owner.",
)
DEFAULT_SIZE = {"train": 4000, "test": 500}
MAX_FRUITLESS_DRAWS = 5000  # draws in a row that add no prompt before the allow-list counts as used up


# ------------------------------------------------------------------------------------------------ config


def _count(config: dict, key: str, default: int) -> int:
    value = config.get(key, default)
    if type(value) is not int or value < 1:
        raise TaskError(f"ifeval config {key} must be a positive integer, not {value!r}")
    return value


def _allowed(config: dict) -> list[str]:
    ids = config.get("instructions", SUPPORTED)
    if not isinstance(ids, (list, tuple)) or not ids or not all(isinstance(i, str) for i in ids):
        raise TaskError(f"ifeval config instructions must be a non-empty list of instruction ids, not {ids!r}")
    for instruction_id in ids:
        if instruction_id in EXCLUDED:
            raise TaskError(f"ifeval leaves out instruction {instruction_id!r}: {EXCLUDED[instruction_id]}")
        if instruction_id not in INSTRUCTIONS:
            close = difflib.get_close_matches(instruction_id, SUPPORTED, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise TaskError(f"unknown IFEval instruction {instruction_id!r}; {hint}supported: {', '.join(SUPPORTED)}")
    return sorted(set(ids))


def _settings(config: dict) -> tuple[list[str], int, int]:
    allowed = _allowed(config)
    fewest, most = _count(config, "min_constraints", 1), _count(config, "max_constraints", 3)
    if fewest > most:
        raise TaskError(f"ifeval config min_constraints ({fewest}) is above max_constraints ({most})")
    if fewest > len(allowed):
        raise TaskError(f"ifeval config min_constraints ({fewest}) is above the {len(allowed)} instructions allowed")
    return allowed, fewest, most


# --------------------------------------------------------------------------------------------------- rows


@contextlib.contextmanager
def _seeded_global_random(seed: int):
    """The registry's instructions draw their arguments from the global `random`: seed it for one prompt
    and give the caller's state back."""
    state = random.getstate()
    random.seed(seed)
    try:
        yield
    finally:
        random.setstate(state)


def _conflicting(first: str, second: str) -> bool:
    conflicts = instructions_registry.INSTRUCTION_CONFLICTS
    return second in conflicts.get(first, ()) or first in conflicts.get(second, ())


def _text_required(args: dict) -> str:
    """Text the constraints make a response contain, as often as they make it."""
    parts = list(args.get("keywords:existence", {}).get("keywords", []))
    frequency = args.get("keywords:frequency")
    if frequency and frequency["relation"] == "at least":
        parts += [frequency["keyword"]] * frequency["frequency"]
    sections = args.get("detectable_format:multiple_sections")
    if sections:
        parts += [sections["section_spliter"]] * sections["num_sections"]
    parts.append(args.get("length_constraints:nth_paragraph_first_word", {}).get("first_word", ""))
    parts.append(args.get("startend:end_checker", {}).get("end_phrase", ""))
    parts.append(args.get("detectable_content:postscript", {}).get("postscript_marker", ""))
    parts.append(args.get(REPEAT_PROMPT, {}).get("prompt_to_repeat", ""))
    return " ".join(parts).lower()


def _contradicts(ids: list[str], kwargs: list[dict]) -> bool:
    """Constraints no response meets together that the registry's conflict map lets through, e.g. a word
    both required and forbidden, a forbidden word in the required end phrase, a letter kept under a count
    that required words exceed, "SECTION" headers in an all-lowercase response."""
    args = dict(zip(ids, kwargs, strict=True))
    first_word = args.get("length_constraints:nth_paragraph_first_word")
    if first_word and first_word["nth_paragraph"] > first_word["num_paragraphs"]:
        return True  # the registry may ask for paragraph n+1 of n
    required = _text_required(args)
    forbidden = list(args.get("keywords:forbidden_words", {}).get("forbidden_words", []))
    frequency = args.get("keywords:frequency")
    if frequency and frequency["relation"] == "less than":
        forbidden.append(frequency["keyword"])
    letter = args.get("keywords:letter_frequency")
    too_many_letters = (
        bool(letter)
        and letter["let_relation"] == "less than"
        and (required.count(letter["letter"]) >= letter["let_frequency"])
    )
    splitter = args.get("detectable_format:multiple_sections", {}).get("section_spliter", "")
    wrong_case = ("change_case:english_lowercase" in args and splitter == "SECTION") or (
        "change_case:english_capital" in args and splitter == "Section"
    )
    return wrong_case or too_many_letters or any(word.lower() in required for word in forbidden)


def _describe(instruction_id: str, base_request: str) -> tuple[str, dict]:
    instruction = INSTRUCTIONS[instruction_id](instruction_id)
    if instruction_id == REPEAT_PROMPT:
        description = instruction.build_description(prompt_to_repeat=base_request)
    else:
        description = instruction.build_description()
    return description, instruction.get_instruction_args() or {}


def _draw(rng: random.Random, allowed: list[str], fewest: int, most: int) -> dict | None:
    """One prompt: a base request and non-conflicting constraints; None where the draw contradicts itself."""
    base_request = rng.choice(BASE_REQUESTS)
    ids: list[str] = []
    for _ in range(rng.randint(fewest, most)):
        candidates = [i for i in allowed if not any(_conflicting(i, chosen) for chosen in ids)]
        if not candidates:
            return None
        ids.append(rng.choice(candidates))
    with _seeded_global_random(rng.getrandbits(64)):
        descriptions, kwargs = zip(*(_describe(i, base_request) for i in ids), strict=True)
    if _contradicts(ids, list(kwargs)):
        return None
    return {"text": " ".join([base_request, *descriptions]), "ids": ids, "kwargs": list(kwargs)}


def build_rows(variant: str | None, config: dict, split: str, size: int | None, seed: int) -> list[dict]:
    if variant is not None:
        raise TaskError(
            f"ifeval has no variants (got ifeval:{variant}); choose instructions with config key instructions"
        )
    if split not in DEFAULT_SIZE:
        raise TaskError(f"unknown split {split!r} for ifeval; use 'train' or 'test'")
    allowed, fewest, most = _settings(config)
    wanted = DEFAULT_SIZE[split] if size is None else size
    rng = random.Random(f"ifeval:{split}:{seed}")
    rows, seen, fruitless = [], set(), 0
    while len(rows) < wanted:
        drawn = _draw(rng, allowed, fewest, most)
        if drawn is None or drawn["text"] in seen or split_of(drawn["text"]) != split:
            fruitless += 1
            if fruitless > MAX_FRUITLESS_DRAWS:
                raise TaskError(
                    f"ifeval made only {len(rows)} distinct {split} prompts of the {wanted} asked for from "
                    f"instructions {allowed}; lower size or allow more instructions or constraints"
                )
            continue
        fruitless = 0
        seen.add(drawn["text"])
        rows.append(
            {
                "id": "ifeval-" + hashlib.sha256(drawn["text"].encode()).hexdigest()[:16],
                "prompt": [{"role": "user", "content": drawn["text"]}],
                "answer": ", ".join(drawn["ids"]),
                "verifier": {"instruction_id_list": drawn["ids"], "kwargs": drawn["kwargs"]},
            }
        )
    return rows


# ------------------------------------------------------------------------------------------------ reward


def constraints_followed(response: str, verifier: dict) -> list[bool]:
    followed = []
    for instruction_id, kwargs in zip(verifier["instruction_id_list"], verifier["kwargs"], strict=True):
        instruction = INSTRUCTIONS[instruction_id](instruction_id)
        instruction.build_description(**kwargs)
        followed.append(bool(response) and bool(instruction.check_following(response)))
    return followed


def score(completion: str, verifier: dict) -> float:
    response = answer_part(completion)
    if response is None:
        return 0.0
    followed = constraints_followed(response.strip(), verifier)
    return sum(followed) / len(followed)


TASK = TaskFamily(
    name="ifeval",
    description="IFEval-style writing requests with 1-3 verifiable constraints (lm-eval's IFEval checkers)",
    answer_format="the response itself, following the prompt's constraints",
    build_rows=build_rows,
    score=score,
    config_keys=frozenset({"min_constraints", "max_constraints", "instructions"}),
)
