"""Math answers: find the final answer in a completion and grade it with math-verify.

The answer part is the text after the last `</think>` (an unclosed `<think>` scores 0); its last box, else
the text after a "final answer" cue, else its end goes to math-verify. Grading runs in killable worker
processes (`worker_pool`): a grade that overruns `timeout_seconds` is False. Details: docs/tasks.md.
"""

from __future__ import annotations

import functools
import json
import math
import numbers
import re
import sys
import threading
import time
from collections.abc import Sequence
from decimal import Decimal

import sympy
from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
from math_verify.errors import TimeoutException
from math_verify.utils import timeout as signal_timeout

from poise_trl.tasks.family import answer_part
from poise_trl.tasks.worker_pool import WorkerPool, grade_in_workers

# Cheap guards before math-verify: deep nesting or long answers (routine garbage in training) keep sympy busy
# for the whole timeout. MATH-500's longest answer is 53 characters, its deepest 2 levels.
MAX_ANSWER_CHARS = 1000
MAX_NESTING = 10
MAX_EXPONENT = 10_000  # also the largest factorial or binomial argument an answer may use
GRADE_TIMEOUT_S = 5.0  # per completion; a MATH-500 solution against its gold takes about 1 ms (median)
MAX_DECIMAL_EXPONENT = 100  # `a\times10^{b}` is written out as a plain decimal up to this |b|

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BRACE_TOKEN_RE = re.compile(r"\\.|[{}]", re.DOTALL)  # an escape such as \{ is one token, not a brace
_EXTRACTION = (LatexExtractionConfig(), ExprExtractionConfig())


def gold_alternatives(gold) -> list:
    """The golds that `gold` accepts, any one of them right: the items of a list or tuple, or of a JSON list
    of strings (`["353", "352"]`, how `join_alternatives` keeps them in a string column); else `[gold]`."""
    if isinstance(gold, (list, tuple)):
        return list(gold)
    if isinstance(gold, str) and gold.lstrip().startswith('["'):
        try:
            items = json.loads(gold)
        except ValueError:
            return [gold]
        if isinstance(items, list) and items and all(isinstance(item, str) for item in items):
            return items
    return [gold]


def join_alternatives(golds: Sequence[str]) -> str:
    """Golds of which any one is right as one `answer` string (the gold, a JSON list, or "" for none).

    One string type, because TRL passes columns through as they are and lists would not mix with strings.
    """
    unique = list(dict.fromkeys(golds))
    if len(unique) == 1:
        return unique[0]
    return json.dumps(unique, ensure_ascii=False) if unique else ""


def answer_to_str(value) -> str:
    """A gold answer as a string; numbers drop a float's `.0` (AIME files store 70 as 70.0)."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        if math.isfinite(value) and float(value).is_integer():
            return str(int(value))
        return str(value)
    return "" if value is None else str(value).strip()


# ------------------------------------------------------------------------------ finding the answer


def _closing_brace(text: str, start: int) -> int | None:
    """Index of the `}` that closes the group opened just before `start`; None if it never closes."""
    depth = 1
    for token in _BRACE_TOKEN_RE.finditer(text, start):
        if token.group() == "{":
            depth += 1
        elif token.group() == "}":
            depth -= 1
            if depth == 0:
                return token.start()
    return None


def _boxed_spans(text: str) -> list[tuple[int, int, str]]:
    """(start, end, content) of every closed outermost `\\boxed{...}` / `\\fbox{...}` in `text`, in order."""
    spans, position = [], 0
    while (match := _BOX_RE.search(text, position)) is not None:
        end = _closing_brace(text, match.end())
        if end is None:
            break
        spans.append((match.start(), end + 1, text[match.end() : end]))
        position = end + 1
    return spans


def all_boxed(text: str) -> list[str]:
    """Contents of every closed outermost `\\boxed{...}` / `\\fbox{...}` in `text`, in order."""
    return [content for _, _, content in _boxed_spans(text)]


def _final_boxes(text: str, spans: list[tuple[int, int, str]]) -> list[str]:
    """Contents of the last box of `text` and of the boxes before it that belong to the same answer.

    math-verify's rule: boxes < 10 characters apart, or < 70 with `,`, `;`, `and`, `or` and other contents.
    """
    first = len(spans) - 1
    while first > 0:
        between = text[spans[first - 1][1] : spans[first][0]]
        separated = len(between) < 70 and _SEPARATOR_RE.search(between) is not None
        if not (len(between) < 10 or (separated and spans[first - 1][2] != spans[first][2])):
            break
        first -= 1
    return [content.strip() for _, _, content in spans[first:]]


_SEPARATOR_RE = re.compile(r"\b(?:and|or)\b|[,;]")


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`) in `text`; None if there is none or it never closes."""
    start = max(_BOX_RE.finditer(text), key=lambda match: match.start(), default=None)
    if start is None or (end := _closing_brace(text, start.end())) is None:
        return None
    return text[start.end() : end]


def extract_final_answer(text: str) -> str | None:
    """The content of the last `\\boxed{}` after the last `</think>`, stripped; None when there is none."""
    part = answer_part(text)
    if part is None or (boxed := last_boxed(part)) is None:
        return None
    return boxed.strip() or None


# ------------------------------------------------------------------------- one form for numbers

_GSM8K_RE = re.compile(r"####\s*(.+?)\s*$", re.DOTALL)
_MATH_DELIMITERS = ((r"\(", r"\)"), (r"\[", r"\]"), ("$$", "$$"), ("$", "$"))
# `9 (apples)`, `13 (first-aid kits)`, `5 cm`, `12 dollars`: a number followed only by words is the number
# (the MATH, GSM8K and ASDiv convention); math-verify would otherwise read the words as a product of
# symbols. Not when a word is maths (`2 pi`) or joins answers (`3 or 4`).
_NUMBER_WITH_UNIT_RE = re.compile(r"^(?P<number>[-+]?\\?\$?\s*(?:\d[\d,]*(?:\.\d+)?|\.\d+))\s*"
                                  r"(?!.*\b(?:and|or|pi|sqrt|sin|cos|tan|log|ln|exp|mod)\b)"
                                  r"(?:\(\s*[A-Za-z][A-Za-z .'-]*\)|[A-Za-z]{2,}(?:\s+[A-Za-z]+)*)\.?$")
# LaTeX thousands separators (`10\,000`, `10{,}000`, `10\!,000`, `10\ 000`); a plain comma is left to
# math-verify, which tells `1,000` from a pair. A leading 0 is a decimal comma (`0,111`), not thousands.
_LATEX_THOUSANDS_RE = re.compile(r"(?<![\d.])[1-9]\d{0,2}(?:(?:\\[,;! ]|\{,\}|,\\!|~)\d{3})+(?![\d])")
_THOUSANDS_SEPARATOR_RE = re.compile(r"\\[,;! ]|\{,\}|,|~")
# `8.7\times10^{8}`, `8.7 \cdot 10^8`: math-verify keeps these unevaluated and then misses `870000000`.
_TIMES_POWER_OF_TEN_RE = re.compile(r"(?<![\w.\\])(?P<mantissa>\d+(?:\.\d+)?)\s*(?:\\times|\\cdot|×)\s*10\s*\^\s*"
                                    r"(?:\{\s*(?P<braced>[-+]?\d+)\s*\}|(?P<bare>[-+]?\d))(?![\d.])")
# `4.5e33` as a number of its own (a whole answer, or a word in a sentence: "L is 4.5e33 erg/s."); not
# inside a name or a power (`x2e3`, `10^2e3`), nor before a power (`2e3^2`, which reads as a product).
_E_NOTATION_RE = re.compile(r"(?<![\w.^_])(?P<mantissa>\d+(?:\.\d+)?)[eE](?P<exponent>[-+]?\d+)(?![\w^]|\.\d)")


def _plain_decimal(mantissa: str, exponent: str) -> str | None:
    if abs(int(exponent)) > MAX_DECIMAL_EXPONENT:
        return None
    text = format(Decimal(mantissa).scaleb(int(exponent)), "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def canonical_numbers(text: str) -> str:
    """`text` with scientific notation written out as plain decimals and LaTeX thousands separators removed.

    math-verify reads `4.5e33` with Euler's e, leaves `8.7\\times10^{8}` unevaluated (so it differs from
    `870000000`), and reads `10\\,000` as the product `10 \\cdot 0`.
    """
    text = re.sub(r"(?<!\\)%", r"\\%", text)  # `62.5%`: math-verify knows percent as `\%`
    text = _LATEX_THOUSANDS_RE.sub(lambda m: _THOUSANDS_SEPARATOR_RE.sub("", m.group()), text)

    def times_power(match: re.Match) -> str:
        exponent = match.group("braced") or match.group("bare")
        return _plain_decimal(match.group("mantissa"), exponent) or match.group()

    def e_notation(match: re.Match) -> str:
        return _plain_decimal(match.group("mantissa"), match.group("exponent")) or match.group()

    text = _TIMES_POWER_OF_TEN_RE.sub(times_power, text)
    return _E_NOTATION_RE.sub(e_notation, text)


# Minerva's answer line (Lewkowycz et al. 2022, appendix D), used by worked solutions in some eval files.
_MINERVA_ANSWER_RE = re.compile(r"Final Answer: The final answer is (.*?)\.? I hope it is correct", re.DOTALL)
_DOLLAR_LIST_RE = re.compile(r"\$[^$]+\$(?:\s*(?:,|and)\s*\$[^$]+\$)+")  # `$69$,$84$` (OlympiadBench)
_ORDINAL_RE = re.compile(r"\^\{?\\(?:mathrm|text)\{(?:st|nd|rd|th)\}\}?")  # `5^{\mathrm{th}}`
_BOLD_RE = re.compile(r"\\(?:textbf|mathbf|bf)\s*\{([^{}]*)\}")
_TRAILING_DOTS_RE = re.compile(r"\s*,\s*\\[lc]?dots\s*$")  # `1, 2, 3, \dots`


def _tidy_answer(text: str) -> str:
    """One answer in the form the grader compares, golds and predictions alike (Minerva's rules). Idempotent.

    Drops `$...$`, trailing punctuation, bold, units after a number, ordinals and `, \\dots`; then
    `canonical_numbers`.
    """
    text = text.strip()
    if _DOLLAR_LIST_RE.fullmatch(text):
        text = ", ".join(part.strip() for part in re.findall(r"\$([^$]+)\$", text))
    for _ in range(3):  # `$\\(...\\)$.` nests
        text = text.rstrip(" .;,").strip()
        for left, right in _MATH_DELIMITERS:
            inner = text[len(left) : -len(right)]
            if len(text) > len(left) + len(right) and text.startswith(left) and text.endswith(right):
                if left != "$" or "$" not in inner:
                    text = inner.strip()
    if (bold := _BOLD_RE.fullmatch(text)) is not None:  # styling (Minerva's rule); AIME's `\\textbf{(073)}`
        text = bold.group(1).strip()
        if re.fullmatch(r"\(\s*[-+]?\d+\s*\)", text):
            text = text.strip("() ")
    if (unit := _NUMBER_WITH_UNIT_RE.match(text)) is not None:
        text = unit.group("number").replace("\\$", "").replace("$", "").strip()
    if re.fullmatch(r"[-+]?[1-9]\d{0,2}(?:,\d{3})+(?:\.\d+)?", text):  # GSM8K's `1,234` is a number
        text = text.replace(",", "")
    text = _TRAILING_DOTS_RE.sub("", _ORDINAL_RE.sub("", text))
    return canonical_numbers(text)


def normalize_gold_answer(text) -> str:
    """A dataset's gold answer in the form the grader compares, once when the dataset is loaded. Idempotent.

    A worked solution becomes its answer (its last boxes joined with `, `, the number after GSM8K's `####`,
    or Minerva's "Final Answer" line), then `_tidy_answer`; alternatives are normalised one by one.
    """
    if len(alternatives := gold_alternatives(text)) != 1:
        return join_alternatives([gold for item in alternatives if (gold := normalize_gold_answer(item))])
    text = answer_to_str(alternatives[0])
    if spans := _boxed_spans(text):
        text = ", ".join(box for box in _final_boxes(text, spans) if box)
    elif (gsm8k := _GSM8K_RE.search(text)) is not None:
        text = gsm8k.group(1)
    elif minerva := _MINERVA_ANSWER_RE.findall(text):
        text = minerva[-1]
    return _tidy_answer(text)


# --------------------------------------------------------------------------- grading, in-process


def _too_complex(text: str) -> bool:
    if len(text) > MAX_ANSWER_CHARS:
        return True
    depth = 0
    for char in text:
        if char in "{([":
            depth += 1
            if depth > MAX_NESTING:
                return True
        elif char in "})]":
            depth = max(depth - 1, 0)
    return False


def _explosive(expr: sympy.Basic) -> bool:
    """Whether comparing `expr` would evaluate a gigantic power, factorial or binomial (refused at once)."""
    for node in sympy.postorder_traversal(expr):
        if isinstance(node, sympy.Pow):
            sizes = [node.exp]
        elif isinstance(node, (sympy.factorial, sympy.factorial2, sympy.binomial)):
            sizes = node.args
        else:
            continue
        if any(size.is_number and not abs(size.evalf()) <= MAX_EXPONENT for size in sizes):
            return True
    return False


def _safe(parsed: list, timeout: int | None) -> tuple:
    """`parsed`, or () when one of its expressions is explosive."""
    if any(signal_timeout(timeout)(_explosive)(p) for p in parsed if isinstance(p, sympy.Basic)):
        return ()
    return tuple(parsed)


@functools.lru_cache(maxsize=4096)
def _parse_latex(answer: str, timeout: int | None) -> tuple:
    """Parse a bare answer such as `\\frac{14}{3}`; cached because GRPO grades every gold G times per step.

    math-verify only recognises math inside an environment (a bare `\\left( 3, \\frac{\\pi}{2} \\right)`
    parses as 3), so the answer is wrapped in `\\boxed{}` first, then `$...$`, then tried as is.
    """
    answer = _tidy_answer(answer)
    if not answer or _too_complex(answer):
        return ()
    for wrapped in (f"\\boxed{{{answer}}}", f"${answer}$", answer):
        if parsed := parse(wrapped, extraction_config=_EXTRACTION, parsing_timeout=timeout):
            return _safe(parsed, timeout)
    return ()


def _extract(text: str, timeout: int | None) -> tuple:
    """math-verify's own extraction from free text: from the last answer cue if there is one, else from
    the end. A reply's final answer can sit far from its end ("The answer is 42. Let me check: ...")."""
    cues = list(_ANSWER_CUE_RE.finditer(text))
    windows = [text[cues[-1].start() :][:MAX_ANSWER_CHARS]] if cues else []
    windows.append(text[-MAX_ANSWER_CHARS:])
    for window in windows:
        if not _too_complex(window):
            window = _FULL_STOP_AFTER_NUMBER_RE.sub("", canonical_numbers(window))
            parsed = parse(window, extraction_config=_EXTRACTION, parsing_timeout=timeout)
            if parsed := _safe(parsed, timeout):
                return parsed
    return ()


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str, timeout: int | None) -> tuple:
    """The parsed gold: normalised (a no-op for golds the loader normalised) and parsed once per gold; a
    gold that is a worked solution with no marked answer goes through math-verify's extraction."""
    return _parse_latex(normalize_gold_answer(gold), timeout) or _extract(gold, timeout)


# "so the sum is 14/3." math-verify reads the full stop as a decimal point (`14/3.0`, left unevaluated)
# and "14/3 ." as 14. A digit's `.` before a space or the end closes a sentence; `2.5`, `2.\overline{3}` stay.
_FULL_STOP_AFTER_NUMBER_RE = re.compile(r"(?<=\d)\s*\.(?=\s|$)")
# "Final Answer: The final answer is 24", "so the answer is 24": an unboxed answer can sit far from the end.
_ANSWER_CUE_RE = re.compile(r"final answer|the answer is|answer\s*:", re.IGNORECASE)
_FINAL_ANSWER_RE = re.compile(r"final answer", re.IGNORECASE)  # overrides an earlier box; "our answer:" doesn't


def _predictions(part: str, timeout: int | None, decimal_comma: bool = False) -> list[tuple]:
    """Parsed candidates for the answer in `part`, most specific first; [] when there is none.

    The last box (with `_final_boxes`) unless a "final answer" follows; `decimal_comma`: `1,22` is 1.22.
    """
    spans = _boxed_spans(part)
    cue = max((match.start() for match in _FINAL_ANSWER_RE.finditer(part)), default=-1)
    if not _BOX_RE.search(part) or (spans and cue > spans[-1][1]):
        return [parsed] if (parsed := _extract(part, timeout)) else []
    if last_boxed(part) is None:  # the last box never closes: a cut-off answer, not a cue to fall back
        return []
    boxes = _final_boxes(part, spans)
    candidates = [boxes[-1]] + ([", ".join(boxes)] if len(boxes) > 1 else [])
    candidates += [_without_percent(text) for text in candidates if "%" in text]
    if decimal_comma:
        candidates += [text.replace(",", ".") for text in candidates if _DECIMAL_COMMA_RE.fullmatch(text)]
    return [parsed for text in candidates if (parsed := _parse_latex(text, timeout))]


def _without_percent(text: str) -> str:
    """`62.5\\%` -> `62.5`: a percentage written with or without its sign is the same answer (MATH's rule)."""
    return re.sub(r"\\?%", "", text)


_PLAIN_NUMBER_RE = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")
# One comma with other than three digits after it cannot separate thousands: next to a plain number it is
# a decimal comma (`1,22` is 1.22; `1,220` stays 1220). A gold is read so only with two digits or more
# after the comma, as MATH writes a pair of small roots `-2,1`, and a pair gold keeps its pair reading too.
_DECIMAL_COMMA_RE = re.compile(r"[-+]?\d+,(?:\d{1,2}|\d{4,})")
_GOLD_DECIMAL_COMMA_RE = re.compile(r"[-+]?\d+,(?:\d{2}|\d{4,})")


def _equal(expected: tuple, predicted: tuple, timeout: int | None) -> bool:
    """math-verify's verdict, except that two plain decimals are compared with relative precision 1e-6:
    math-verify rounds to 6 decimal places, which makes `2.88e-19` equal to `3.5e-19`."""
    expected_text, predicted_text = expected[-1], predicted[-1]  # parse() ends with the extracted string
    if (
        isinstance(expected_text, str) and isinstance(predicted_text, str)
        and _PLAIN_NUMBER_RE.fullmatch(expected_text) and _PLAIN_NUMBER_RE.fullmatch(predicted_text)
    ):
        a, b = Decimal(expected_text), Decimal(predicted_text)
        return abs(a - b) <= Decimal("1e-6") * max(abs(a), abs(b))
    return verify(list(expected), list(predicted), timeout_seconds=timeout)


def _matches(part: str, gold: str, timeout: int | None) -> bool:
    """Whether the answer part `part` gives the one gold `gold`."""
    if not gold or not (expected := _parse_gold(gold, timeout)):
        return False
    references = [expected]
    normalized = normalize_gold_answer(gold)
    if "%" in normalized and (bare := _parse_latex(_without_percent(normalized), timeout)):
        references.append(bare)
    decimal = normalized.replace(",", ".") if _GOLD_DECIMAL_COMMA_RE.fullmatch(normalized) else ""
    if decimal and (parsed_decimal := _parse_latex(decimal, timeout)):
        references.append(parsed_decimal)
    gold_is_number = _PLAIN_NUMBER_RE.fullmatch(normalized) is not None
    predictions = _predictions(part, timeout, decimal_comma=gold_is_number)
    return any(_equal(reference, predicted, timeout) for reference in references for predicted in predictions)


def _grade(completion_text: str, gold, timeout: int | None) -> bool:
    part = answer_part(completion_text)
    if part is None:
        return False
    return any(_matches(part, answer_to_str(alternative), timeout) for alternative in gold_alternatives(gold))


class _Overrun(BaseException):
    """Deadline passed in a thread; a BaseException so that math-verify and sympy don't swallow it."""


def _deadline_tracer(deadline: float):
    def tracer(frame, event, arg):
        if time.monotonic() > deadline:
            raise _Overrun  # raising also removes the tracer, so the rest of the grade runs untraced
        return None  # no per-line tracing: checking at each function call is enough and costs little

    return tracer


def _grade_here(completion_text: str, gold, timeout_seconds: float) -> bool:
    """Grade in this process, never raising: the fallback where no worker starts (SIGALRM: main thread)."""
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous_tracer = sys.gettrace()
    if not in_main_thread:
        sys.settrace(_deadline_tracer(time.monotonic() + timeout_seconds))
    try:
        # signal.alarm counts whole seconds
        return _grade(completion_text, gold, max(1, math.floor(timeout_seconds)) if in_main_thread else None)
    except (Exception, TimeoutException, _Overrun):
        return False
    finally:
        if not in_main_thread:
            sys.settrace(previous_tracer)


# sympy and math-verify initialise each kind of expression on first use (up to 2 s on a busy machine):
# a fresh worker does that before it takes grades, so that it is not on a grade's clock.
_WARM_UP = (
    (r"\boxed{\frac{1}{2}}", "0.5"),
    (r"The answer is $x^2+1$", "(x+1)^2 - 2x"),
    (r"\boxed{\{1, 2\}}", "(1, 2)"),
    (r"\boxed{\begin{pmatrix}1 & 2\end{pmatrix}}", r"\begin{pmatrix}1 & 2\end{pmatrix}"),
    (r"\boxed{x \in [1, 2)}", "[1, 2)"),
)


def grade_pair(pair: tuple[str, object], timeout_seconds: float) -> bool:
    """One `(completion_text, gold)` pair, graded in a worker process of `_POOL` (its `target`)."""
    text, gold = pair
    return _grade_here(text, gold, timeout_seconds)


_POOL = WorkerPool(f"{__name__}:grade_pair", warm_up=[(pair, 60) for pair in _WARM_UP])


def grade_batch(pairs: Sequence[tuple[str, object]], timeout_seconds: float = GRADE_TIMEOUT_S) -> list[bool]:
    """`is_correct` for each `(completion_text, gold)` pair, in one round trip to a killable worker."""
    pending = [(text if isinstance(text, str) else "", gold) for text, gold in pairs]
    return [bool(r) for r in grade_in_workers(_POOL, pending, timeout_seconds, overrun=False,
                                              here=lambda pair: _grade_here(*pair, timeout_seconds))]


def is_correct(completion_text: str, gold, timeout_seconds: float = GRADE_TIMEOUT_S) -> bool:
    """Whether the completion's final answer equals `gold` by math-verify; any failure grades False."""
    return grade_batch([(completion_text, gold)], timeout_seconds)[0]
