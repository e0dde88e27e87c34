"""The docs match the code and the last benchmark: the README's headline figures are those of
bench/results/latest.md, and docs/development.md's layout names every module of chat/ (and no gone one)."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
LATEST = (ROOT / "bench" / "results" / "latest.md").read_text()

# README's rows (its first benchmark table: ours | llama.cpp's (ours ratio)) → latest.md's peer table rows.
PEER_ROWS = {
    "one stream, delivered tokens/s": "one stream, delivered tok/s (p50)",
    "8 streams, aggregate tokens/s": "8 streams, aggregate tok/s",
    "first delta with 8 users at once, p50": "first delta with 8 users, p50 ms",
    "first delta at turn 6 of a ~2000-token conversation": "long conversation: turn 6 first delta ms",
}
# The ratios the README's introduction quotes, in its order.
INTRO_RATIOS = ["one stream, delivered tok/s (p50)", "8 streams, aggregate tok/s",
                "long conversation: turn 6 first delta ms"]
NUMBER = re.compile(r"\d+(?:\.\d+)?")


def table_rows(text: str) -> dict[str, list[str]]:
    """Every markdown table row of ``text`` by its first cell (the first row of a name wins)."""
    rows: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows.setdefault(cells[0], cells[1:])
    return rows


def shown_as(written: str, value: str) -> bool:
    """Whether the figure ``written`` in the README is ``value`` (from latest.md) rounded as the README rounds it."""
    decimals = len(written.partition(".")[2])
    return float(written) == round(float(value), decimals)


def same_figures(readme_cell: str, latest_cells: list[str]) -> list[str]:
    """The README cell's numbers that differ from ``latest_cells``' (in order); empty when they agree."""
    written, measured = NUMBER.findall(readme_cell), [n for c in latest_cells for n in NUMBER.findall(c)]
    assert len(written) == len(measured), (readme_cell, latest_cells)
    return [f"{w} ≠ {m}" for w, m in zip(written, measured) if not shown_as(w, m)]


def benchmark_section() -> str:
    return README.split("### Benchmark", 1)[1].split("\n## ", 1)[0]


def test_the_readme_table_beside_llama_cpp_is_the_last_run():
    readme, latest = table_rows(benchmark_section()), table_rows(LATEST)
    for ours, theirs in PEER_ROWS.items():
        mine, measured = readme[ours], latest[theirs]  # ours | llama.cpp's | ratio | goal
        # README: ours | llama.cpp's (ours N.NNx) — the ratio only where it quotes one.
        wanted = measured[:3] if "x)" in mine[1] else measured[:2]
        assert same_figures(" ".join(mine[:2]), wanted) == [], f"README's {ours!r} row is not latest.md's {theirs!r}"


def test_the_readme_ceilings_and_sweep_are_the_last_run():
    readme, latest = table_rows(benchmark_section()), table_rows(LATEST)
    ceilings = next(v for k, v in readme.items() if k.startswith("raw forward loop tokens/s"))
    assert same_figures(ceilings[0], latest["raw forward loop tok/s at batch 1 / 8 / 16"]) == []
    sweep = next(v for k, v in readme.items() if k.startswith("aggregate tokens/s at 1 / 2 / 4 / 8 streams"))
    assert same_figures(sweep[0], [latest[n][1] for n in ("1", "2", "4", "8")]) == []


def test_the_readme_introduction_quotes_the_last_run():
    intro = README.split("## Quick start", 1)[0]
    quoted = re.findall(r"(\d+\.\d+)x", intro)
    measured = [table_rows(LATEST)[name][2] for name in INTRO_RATIOS]
    assert len(quoted) == len(measured) and all(shown_as(q, m) for q, m in zip(quoted, measured)), \
        f"the README's introduction says {quoted}, the last run {measured}"


def test_the_readme_dates_the_run_it_shows():
    when = re.search(r"^# Chat server benchmark — (\d{4}-\d\d-\d\d)", LATEST, re.M).group(1)
    assert f"run ({when};" in benchmark_section()


def test_a_differing_figure_is_caught():
    assert same_figures("113 / 112 (ours 1.00x)", ["113", "112", "1"]) == []
    with pytest.raises(AssertionError):
        same_figures("1.4–1.7x", ["1.24"])
    assert same_figures("171", ["137"]) == ["171 ≠ 137"]
    assert shown_as("0.36", "0.361") and not shown_as("0.37", "0.361")


# ---- docs/development.md's layout

def documented_paths() -> set[str]:
    """The paths the layout block of docs/development.md names (``dir/`` lines open a folder for the
    indented lines below them)."""
    text = (ROOT / "docs" / "development.md").read_text()
    block = text.split("## Layout", 1)[1].split("```text", 1)[1].split("```", 1)[0]
    paths, folder = set(), ""
    for line in block.splitlines():
        if not line.strip() or line.startswith("    "):  # blank, or a description's continuation
            continue
        words = line.split()
        names = [words[0]]
        while names[-1].endswith(","):  # "sqlite.py, postgres.py   the two backends"
            names[-1] = names[-1].rstrip(",")
            names.append(words[len(names)])
        if line.startswith("  "):
            paths |= {folder + name for name in names}
        else:
            paths |= set(names)
            folder = names[0] if names[0].endswith("/") else ""
    return paths


def test_the_layout_names_every_module_of_chat():
    documented = documented_paths()
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "chat").rglob("*") if p.suffix in (".py", ".cpp")
               and p.name not in ("__init__.py", "__main__.py")}
    assert sorted(modules - documented) == [], "modules docs/development.md's layout leaves out"
    gone = {p for p in documented if p.startswith("chat/") and not (ROOT / p).exists()}
    assert sorted(gone) == [], "docs/development.md's layout names files that are gone"


# ---- docs/development.md's "Where to add" recipes cite files and names that exist

CODE_SUFFIXES = (".py", ".cpp", ".h", ".js", ".md", ".html", ".css", ".yaml", ".txt", ".toml")
IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*$")


def code_text() -> str:
    """Every source the recipes may name: chat/'s Python and C++, the tests, the page's scripts."""
    files = [p for p in (ROOT / "chat").rglob("*") if p.suffix in (".py", ".cpp", ".h")]
    files += list((ROOT / "tests").glob("*.py")) + list((ROOT / "static").rglob("*.js"))
    return "\n".join(p.read_text(errors="replace") for p in files if "vendor" not in p.parts)


def cited(section: str) -> tuple[set[str], set[str]]:
    """The paths and the identifiers a text cites in backticks (``name()`` as ``name``)."""
    paths, names = set(), set()
    for token in re.findall(r"`([^`\n]+)`", section):
        token = token.strip().removesuffix("()")
        if token.startswith("/"):  # a URL's path (/v1, /ws): the API's, not a file
            continue
        if "/" in token or token.endswith(CODE_SUFFIXES):
            paths.add(token)
        elif IDENTIFIER.match(token):
            names.add(token)
    return paths, names


def missing(paths: set[str], names: set[str], code: str) -> list[str]:
    """What of ``paths`` and ``names`` is not in the repository: a path relative to the root, a bare file name
    anywhere under chat/ or tests/, a name as a word of the code (a dotted name by its last part)."""
    gone = []
    for path in paths:
        first = path.split()[0].rstrip("'s,:")
        if "/" in first:
            ok = (ROOT / first).exists() or (ROOT / "chat" / "engine" / first).exists()
        else:
            ok = any(True for _ in (ROOT / "chat").rglob(first)) or (ROOT / "tests" / first).exists()
        if not ok:
            gone.append(path)
    for name in names:
        if not re.search(rf"\b{re.escape(name.rsplit('.', 1)[-1])}\b", code):
            gone.append(name)
    return sorted(gone)


def test_the_where_to_add_recipes_cite_what_exists():
    text = (ROOT / "docs" / "development.md").read_text()
    section = text.split("## Where to add", 1)[1].split("\n## ", 1)[0]
    for recipe in ("### A WebSocket message type", "### A storage backend", "### A sampling filter",
                   "A GGUF block type", "A CPU kernel", "A model architecture"):
        assert recipe in section, f"docs/development.md has no recipe for {recipe}"
    paths, names = cited(section)
    assert len(paths) > 20 and len(names) > 40, "the recipes cite too little for the check to mean anything"
    assert missing(paths, names, code_text()) == []


def test_the_recipe_check_catches_what_is_gone():
    code = "def real_name(): pass"
    assert missing({"chat/engine/nowhere.py"}, {"real_name", "module.real_name", "gone_name"}, code) == [
        "chat/engine/nowhere.py", "gone_name"]
