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
