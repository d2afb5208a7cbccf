"""The README's module tables name every module of kvlib/ and course/, and nothing else."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _table_modules(heading: str) -> set[str]:
    """The ``.py`` names in the first column of the table after ``heading``'s line."""
    text = (ROOT / "README.md").read_text()
    rows = text[text.index(heading):].split("\n\n| module |", 1)[1].split("\n\n", 1)[0]
    names = set()
    for row in rows.splitlines():
        first = row.split("|")[1] if row.startswith("|") else ""
        names |= set(re.findall(r"`([a-z_0-9]+\.py)`", first))
        if "..." in first:  # nb00.py ... nb09.py
            a, b = (int(n) for n in re.findall(r"nb(\d\d)\.py", first))
            names |= {f"nb{i:02d}.py" for i in range(a, b + 1)}
    return names


@pytest.mark.parametrize("folder, heading", [("kvlib", "## `kvlib`"),
                                             ("course", "in `course/`")])
def test_the_readme_table_matches_the_files(folder, heading):
    files = {p.name for p in (ROOT / folder).glob("*.py") if p.name != "__init__.py"}
    assert _table_modules(heading) == files
