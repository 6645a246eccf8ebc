"""The README and docs/ stay short, linked and true to the benchmark outputs (fast, no jobs).

* the README is at most 250 lines and under 2,600 words;
* every figure of the README's recipe table is written, verbatim, in the results file its row
  links to (the SBC figure and the ratio on one line of it), and a row with one digit changed is
  reported (the check is checked);
* every relative link of README.md and docs/*.md points to an existing file (and, within
  Markdown files, to an existing heading);
* the two set-up commands are ``make demo`` and ``make test``, in one code block;
* no doc tells history ("before the fold", ...): the docs say what is.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
#: a row whose study has not finished yet carries this in its figure cells
#: the recipe table's header (its columns: what you have, what to pass, the SBC figure, dense,
#: the ratio, the results file)
HEADER = "| you have | pass | SBC | dense | ratio | measured in |"
#: history phrases no doc may contain (kept small and precise: ordinary English must pass)
HISTORY = ("before the fold", "before the momentum fold", "the default before",
           "releases ago", "used to be", "the former behaviour", "two releases",
           "the former drop-in", "the old drop-in", "before the fused encoder",
           "before the avx-512", "has it since", "the previous stop", "what changed in this round",
           "before the backend split", "after the backend split", "around the backend split",
           "rerun after the merge", "the previous commit", "before -> after", "after = now",
           "new in this version", "the previous validation")
#: a figure: 94.8 ± 0.2 %, 7.16, ×2,360, 338x, 592
FIGURE = re.compile(r"×?\d[\d,]*(?:\.\d+)?(?: ± \d[\d,]*(?:\.\d+)?)?(?: %|x\b)?")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def recipe_rows(text: str) -> List[List[str]]:
    """The recipe table's rows, each a list of its cells (stripped)."""
    lines = text.splitlines()
    start = [i for i, line in enumerate(lines) if line.strip() == HEADER]
    assert len(start) == 1, f"the README has no (or several) recipe tables headed {HEADER!r}"
    rows = []
    for line in lines[start[0] + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def figures(cell: str) -> List[str]:
    return [m.group(0) for m in FIGURE.finditer(cell)]


def _present(token: str, line: str) -> bool:
    """``token`` in ``line`` as a whole figure (not inside a longer number)."""
    return re.search(r"(?<![\d.,])" + re.escape(token) + r"(?![\d]|\.\d|,\d)", line) is not None


def check_row(row: List[str], read=lambda p: _text(p)) -> List[str]:
    """What is wrong with one recipe-table row (empty: nothing). Read ``read(path)`` for the
    linked results file."""
    if len(row) != 6:
        return [f"row {row!r} has {len(row)} cells, not 6"]
    links = LINK.findall(row[5])
    if len(links) != 1:
        return [f"row {row[0]!r} must link exactly one results file, got {links!r}"]
    path = (ROOT / links[0]).resolve()
    if not path.is_file():
        return [f"row {row[0]!r} links {links[0]}, which does not exist"]
    if not str(path).startswith(str(ROOT / "benchmarks" / "results")):
        return [f"row {row[0]!r} links {links[0]}, not a file under benchmarks/results/"]
    lines = read(path).splitlines()
    errors = []
    sbc, dense, ratio = figures(row[2]), figures(row[3]), figures(row[4])
    for name, found in (("SBC", sbc), ("dense", dense), ("ratio", ratio)):
        if not found:
            errors.append(f"row {row[0]!r}: no {name} figure in its cell")
    for token in dense:
        if not any(_present(token, line) for line in lines):
            errors.append(f"row {row[0]!r}: dense figure {token!r} is not in {links[0]}")
    for token in sbc + ratio:
        if not any(_present(token, line) for line in lines):
            errors.append(f"row {row[0]!r}: figure {token!r} is not in {links[0]}")
    if sbc and ratio and not any(all(_present(t, line) for t in sbc + ratio) for line in lines):
        errors.append(f"row {row[0]!r}: {sbc + ratio!r} are not on one line of {links[0]}")
    return errors


def test_readme_is_short():
    text = _text(README)
    lines, words = len(text.splitlines()), len(text.split())
    assert lines <= 250, f"README.md has {lines} lines (at most 250)"
    assert words < 2600, f"README.md has {words} words (fewer than 2,600)"


def test_recipe_table_answers_the_six_questions():
    rows = recipe_rows(_text(README))
    assert len(rows) <= 6
    firsts = " ".join(r[0] for r in rows)
    for question in ("SGD CNN", "AdamW transformer", "label-skewed", "more compression",
                     "DDP", "TensorFlow"):
        assert question in firsts, f"no recipe row answers {question!r}"


def test_recipe_figures_are_in_their_results_files():
    errors = [e for row in recipe_rows(_text(README)) for e in check_row(row)]
    assert not errors, "\n".join(errors)


def _mutate(token: str) -> str:
    """``token`` with its first digit changed."""
    i = next(i for i, c in enumerate(token) if c.isdigit())
    d = int(token[i])
    return token[:i] + str(d + 1 if d < 9 else 8) + token[i + 1:]


def test_a_changed_digit_is_reported():
    """The check itself: every figure of every measured row, changed in one digit, is caught."""
    rows = recipe_rows(_text(README))
    assert rows
    tried = 0
    for row in rows:
        for col in (2, 3, 4):
            for token in figures(row[col]):
                bad = list(row)
                bad[col] = row[col].replace(token, _mutate(token), 1)
                assert check_row(bad), f"{row[0]!r}: {token!r} -> {_mutate(token)!r} not reported"
                tried += 1
    assert tried >= 3 * len(rows)


def _anchors(md: Path) -> set:
    out, fence = set(), False
    for line in _text(md).splitlines():
        if line.startswith("```"):
            fence = not fence
        m = None if fence else re.match(r"^#{1,6} (.*)$", line)
        if m:
            out.add(re.sub(r"[^\w\s-]", "", m.group(1).lower()).strip().replace(" ", "-"))
    return out


def test_relative_links_resolve():
    errors = []
    for md in [README] + DOCS:
        for line in _text(md).splitlines():
            for target in LINK.findall(line):
                if re.match(r"^[a-z]+:", target):
                    continue  # http(s), mailto
                path, _, anchor = target.partition("#")
                dest = (md.parent / path).resolve() if path else md
                if not dest.exists():
                    errors.append(f"{md.relative_to(ROOT)}: {target} does not exist")
                elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                    errors.append(f"{md.relative_to(ROOT)}: {target}: no such heading")
    assert not errors, "\n".join(errors)


def test_the_two_commands():
    blocks = re.findall(r"```[a-z]*\n(.*?)```", _text(README), flags=re.S)
    for block in blocks:
        commands = [line.split("#")[0].strip() for line in block.splitlines()]
        if "make demo" in commands and "make test" in commands:
            return
    pytest.fail("README.md has no code block with the two commands `make demo` and `make test`")


@pytest.mark.parametrize("md", [README] + DOCS, ids=lambda p: p.name)
def test_no_history(md):
    text = " ".join(_text(md).lower().split())  # phrases may wrap across lines
    found = [p for p in HISTORY if p in text]
    assert not found, f"{md.relative_to(ROOT)} tells history: {found}"
