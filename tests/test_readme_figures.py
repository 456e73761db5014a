"""Every measured figure in README.md and docs/*.md comes from a committed artefact under benchmarks/results/.

A figure is the number written right before a marker, `0.800<!--fig:ARTEFACT#QUERY;option=value-->`
(syntax in benchmarks/README.md). The check reads README.md and every docs page, resolves each
marker's query in its artefact and compares the printed number with the artefact's value rounded to
the printed number of decimals. benchmarks/README.md indexes the artefacts: each marker's artefact is
in its figure index, each indexed artefact is quoted by a marker, and every JSON/CSV file under
benchmarks/results/ is in the index or in its supporting-data table.
"""

from __future__ import annotations

import csv
import json
import re
import statistics
from collections.abc import Callable
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS = "benchmarks/results/"

# The number is unsigned (a negative figure declares scale=-1); thousands may be comma-separated.
MARKER = re.compile(r"(?P<number>(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)<!--fig:(?P<spec>.*?)-->")
ANY_MARKER = re.compile(r"<!--fig:(.*?)-->")
QUERY_SEGMENT = re.compile(r"\[(?P<literal>[^\]]+)\]|\{(?P<conditions>[^}]+)\}|(?P<plain>[^.\[\]{}]+)")


class FigureError(ValueError):
    """A marker that cannot be resolved: bad syntax, an absent artefact or key, or an ambiguous query."""


def _equal(values: list) -> object:
    """The one value all matches share: a single figure printed for several runs ('104 steps')."""
    if len(set(values)) != 1:
        raise FigureError(f"agg=equal over values that differ: {values}")
    return values[0]


AGGREGATES = {"min": min, "max": max, "mean": statistics.fmean, "sum": sum, "len": len, "equal": _equal}
OPTIONS = {"agg", "scale", "offset"}
ARTEFACT_SUFFIXES = (".json", ".csv")


def load_artefact(relative_path: str) -> object:
    """The parsed artefact: JSON as is, CSV as a list of row dicts."""
    path = REPO_ROOT / relative_path
    if path.suffix == ".csv":
        with path.open(newline="") as handle:
            return list(csv.DictReader(handle))
    return json.loads(path.read_text())


def parse_spec(spec: str) -> tuple[str, str, dict[str, str]]:
    """`ARTEFACT#QUERY;key=value;...` -> (artefact, query, options). Not `|`: it would split a table cell."""
    target, *option_parts = spec.strip().split(";")
    if "#" not in target:
        raise FigureError(f"marker {spec!r} has no '#QUERY' after the artefact path")
    artefact, query = target.split("#", 1)
    options = {}
    for part in option_parts:
        key, sep, value = part.partition("=")
        if not sep or key not in OPTIONS:
            raise FigureError(f"marker {spec!r}: option {part!r} is not one of {sorted(OPTIONS)} as key=value")
        options[key] = value
    if not artefact.startswith(RESULTS) or not artefact.endswith(ARTEFACT_SUFFIXES):
        raise FigureError(f"marker {spec!r}: the artefact must be a JSON or CSV file under {RESULTS}")
    return artefact, query, options


def _children(node: object) -> list:
    return list(node.values()) if isinstance(node, dict) else list(node) if isinstance(node, list) else []


def _step(nodes: list, segment: re.Match, fanned_out: bool) -> list:
    """One query segment applied to every current node. After a wildcard or a filter, nodes that lack a
    key are dropped (an arm without critics); on a single path a missing key is an error."""
    if segment["plain"] == "*":
        return [child for node in nodes for child in _children(node)]
    if segment["conditions"] is not None:
        wanted = dict(condition.split("=", 1) for condition in segment["conditions"].split(","))
        return [child for node in nodes for child in _children(node)
                if isinstance(child, dict) and all(k in child and str(child[k]) == v for k, v in wanted.items())]
    key = segment["literal"] if segment["literal"] is not None else segment["plain"]
    found = []
    for node in nodes:
        if isinstance(node, dict) and key in node:
            found.append(node[key])
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            found.append(node[int(key)])
        elif not fanned_out:
            raise FigureError(f"no {key!r} here")
    return found


def resolve(document: object, query: str) -> list:
    """Values at `query`: keys joined by '.', `[key with . or spaces]`, list indices, `*` for every
    element, `{key=value,key2=value2}` for the elements whose keys print as those values."""
    nodes, position, fanned_out = [document], 0, False
    for segment in QUERY_SEGMENT.finditer(query):
        if segment.start() != position:
            raise FigureError(f"query {query!r} does not parse at {query[position:]!r}")
        nodes = _step(nodes, segment, fanned_out)
        fanned_out = fanned_out or segment["plain"] == "*" or segment["conditions"] is not None
        position = segment.end() + (segment.end() < len(query) and query[segment.end()] == ".")
    if position != len(query):
        raise FigureError(f"query {query!r} does not parse at {query[position:]!r}")
    return nodes


def figure_value(document: object, query: str, options: dict[str, str]) -> float:
    values = resolve(document, query)
    if "agg" in options:
        if options["agg"] not in AGGREGATES:
            raise FigureError(f"agg={options['agg']} is not one of {sorted(AGGREGATES)}")
        if not values:
            raise FigureError(f"query {query!r} matched nothing to aggregate")
        value = AGGREGATES[options["agg"]](values if options["agg"] == "len" else [float(v) for v in values])
    elif len(values) == 1:
        value = values[0]
    elif not values:
        raise FigureError(f"query {query!r} matched nothing")
    else:
        raise FigureError(f"query {query!r} matched {len(values)} values: add agg=min|max|mean|sum|len|equal")
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise FigureError(f"query {query!r} is {value!r}, not a number")
    return (float(value) + float(options.get("offset", 0))) * float(options.get("scale", 1))


def printed_matches(printed: str, value: float) -> bool:
    """True when `printed` is `value` rounded to the printed decimals (either way on an exact tie)."""
    decimals = len(printed.partition(".")[2])
    return abs(float(printed.replace(",", "")) - value) <= 0.5 * 10**-decimals + 1e-9 * max(1.0, abs(value))


def readme_markers(readme_text: str) -> list[tuple[str, str]]:
    """(printed number, marker spec) for every marker; a marker with no number right before it is an error."""
    numbered = list(MARKER.finditer(readme_text))
    bare = {m.start() for m in ANY_MARKER.finditer(readme_text)} - {m.end("number") for m in numbered}
    if bare:
        raise FigureError(f"markers with no number right before them: {[readme_text[i:i + 80] for i in sorted(bare)]}")
    return [(m["number"], m["spec"]) for m in numbered]


def check_figures(readme_text: str, loader: Callable[[str], object] = load_artefact) -> list[str]:
    """One line per figure that does not match its artefact (empty when all match)."""
    problems, documents = [], {}
    for printed, spec in readme_markers(readme_text):
        try:
            artefact, query, options = parse_spec(spec)
            if artefact not in documents:
                documents[artefact] = loader(artefact)
            value = figure_value(documents[artefact], query, options)
        except (FigureError, OSError, ValueError) as error:
            problems.append(f"{printed} <- {spec}: {error}")
            continue
        if not printed_matches(printed, value):
            problems.append(f"{printed} <- {spec}: the artefact says {value!r}")
    return problems


def marked_artefacts(readme_text: str) -> set[str]:
    return {parse_spec(spec)[0] for _, spec in readme_markers(readme_text)}


def index_tables(benchmarks_readme: str) -> dict[str, set[str]]:
    """The `artefact` column of the table under each `## ` heading: {heading: artefact paths}."""
    tables, section, column = {}, None, None
    for line in benchmarks_readme.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("## "):
            section, column = line[3:].strip(), None
        elif line.startswith("|") and section is not None and column is None:
            column = cells.index("artefact") if "artefact" in cells else None
        elif line.startswith("|") and column is not None and len(cells) > column:
            tables.setdefault(section, set()).update(re.findall(r"`([^`]+)`", cells[column]))
    return tables


def artefacts_on_disk() -> set[str]:
    return {str(p.relative_to(REPO_ROOT)) for p in (REPO_ROOT / RESULTS).rglob("*")
            if p.suffix in ARTEFACT_SUFFIXES}


FIGURE_INDEX, SUPPORTING = "Figure index", "Supporting data"


def figure_documents() -> dict[str, str]:
    """README.md and every docs page, by repository-relative path: the places a figure may be quoted."""
    paths = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
    return {str(path.relative_to(REPO_ROOT)): path.read_text() for path in paths}


@pytest.fixture(scope="module")
def documents() -> dict[str, str]:
    return figure_documents()


@pytest.fixture(scope="module")
def readme(documents) -> str:
    """All documents' text together (markers never span two files)."""
    return "\n".join(documents.values())


@pytest.fixture(scope="module")
def index() -> dict[str, set[str]]:
    return index_tables((REPO_ROOT / "benchmarks" / "README.md").read_text())


def test_every_figure_matches_its_artefact(documents):
    assert sum(len(readme_markers(text)) for text in documents.values()) > 100, "the docs lost their figure markers"
    problems = [f"{name}: {problem}" for name, text in documents.items() for problem in check_figures(text)]
    assert problems == []


def test_docs_pages_are_read(documents):
    """A figure moved from README.md to a docs page is still checked."""
    assert "docs/measurements.md" in documents and readme_markers(documents["docs/measurements.md"])


def test_a_changed_artefact_value_fails_the_check(readme):
    artefact = "benchmarks/results/compare_toy_study/compare.json"
    original = load_artefact(artefact)
    altered = json.loads(json.dumps(original))
    altered["results"]["poise"]["final_accuracy"]["mean"] += 0.01

    def loader(path: str) -> object:
        return altered if path == artefact else load_artefact(path)

    problems = check_figures(readme, loader)
    assert problems and all("results.poise.final_accuracy.mean" in p for p in problems)


def test_rounding_scale_offset_and_aggregates():
    doc = {"a": {"b.c": 0.6043}, "ratio": 1.122, "runs": [{"seed": 0, "steps": 104, "x": 0.0820, "n": 2986.67},
                                                          {"seed": 1, "steps": 104, "x": 0.1702, "n": 1}]}
    t = "benchmarks/results/t.json"
    text = (f"0.60<!--fig:{t}#a[b.c]--> 60.4<!--fig:{t}#a[b.c];scale=100-->"
            f" 8<!--fig:{t}#runs.*.x;agg=min;scale=100-->-17<!--fig:{t}#runs.*.x;agg=max;scale=100-->%"
            f" 0.170<!--fig:{t}#runs.{{seed=1,steps=104}}.x--> 2,987<!--fig:{t}#runs.0.n-->"
            f" 12<!--fig:{t}#ratio;offset=-1;scale=100-->% 2<!--fig:{t}#runs.*;agg=len-->"
            f" 104<!--fig:{t}#runs.*.steps;agg=equal-->")
    assert check_figures(text, lambda path: doc) == []
    wrong = text.replace("0.60<", "0.61<").replace("-17<", "-18<").replace(" 2<", " 3<").replace("2,987", "2,986")
    assert len(check_figures(wrong, lambda path: doc)) == 4
    doc["runs"][1]["steps"] = 103
    problems = check_figures(text, lambda path: doc)  # agg=equal over 104 and 103; the filter now matches nothing
    assert [p.split(" <- ")[0] for p in problems] == ["0.170", "104"]


def test_malformed_markers_are_reported_not_skipped():
    doc = {"runs": [{"x": 1.0}, {"x": 2.0}]}
    cases = ["1<!--fig:benchmarks/results/t.json#runs.*.x-->",  # two values, no agg
             "1<!--fig:benchmarks/results/t.json#runs.0.y-->",  # absent key
             "1<!--fig:benchmarks/results/t.json#runs.0.x;round=2-->",  # unknown option
             "1<!--fig:elsewhere/t.json#runs.0.x-->"]  # not under benchmarks/results
    for text in cases:
        assert len(check_figures(text, lambda path: doc)) == 1, text
    with pytest.raises(FigureError, match="no number right before"):
        readme_markers("about <!--fig:benchmarks/results/t.json#runs.0.x--> here")


def test_every_marked_artefact_is_indexed_and_every_indexed_artefact_is_quoted(readme, index):
    indexed, supporting = index.get(FIGURE_INDEX, set()), index.get(SUPPORTING, set())
    marked = marked_artefacts(readme)
    assert marked - indexed == set(), "the docs quote artefacts missing from benchmarks/README.md's figure index"
    assert indexed - marked == set(), "indexed artefacts no figure in the docs quotes: move them to supporting data"
    assert indexed & supporting == set()


def test_every_artefact_under_results_is_indexed(index):
    listed = index.get(FIGURE_INDEX, set()) | index.get(SUPPORTING, set())
    assert artefacts_on_disk() - listed == set(), "new artefacts: add them to benchmarks/README.md"
    assert listed - artefacts_on_disk() == set(), "benchmarks/README.md lists artefacts that do not exist"
