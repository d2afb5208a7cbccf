"""The reading budget (tests/reading.py): every notebook within 30 minutes and 12 hedges,
the whole course, deep dives included, within 300 minutes."""

import json
import re

import pytest
import reading

ROWS = [reading.load(p) for p in reading.notebooks()]


@pytest.mark.parametrize("row", ROWS, ids=[r["notebook"] for r in ROWS])
def test_each_notebook_reads_within_its_budget(row):
    assert row["minutes"] <= reading.NOTEBOOK_MINUTES, row
    assert row["hedges"] <= reading.HEDGES, row


def test_the_course_reads_in_an_afternoon():
    total = sum(r["minutes"] for r in ROWS)
    assert total <= reading.COURSE_MINUTES, f"{total:.0f} minutes"


def test_the_counter_counts_what_a_reader_reads(tmp_path):
    # 140 words of markdown, 200 of output and 25 code lines: one minute each.
    cell = {"cell_type": "code", "source": "x = 1\n\n" * 25, "metadata": {},
            "outputs": [{"output_type": "stream", "name": "stdout", "text": "w " * 200},
                        {"output_type": "display_data", "data": {"text/plain": "<Figure>"}}]}
    md = {"cell_type": "markdown", "source": "word " * 139 + "verdict", "metadata": {}}
    path = tmp_path / "nb.ipynb"
    path.write_text(json.dumps({"cells": [md, cell]}))
    row = reading.load(path)
    assert (row["md_words"], row["code_lines"], row["output_words"]) == (140, 25, 200)
    assert row["minutes"] == 3.0 and row["hedges"] == 1


def test_the_readme_gives_each_notebooks_reading_time():
    # The README's notebook table ends each row with "N min": the counter's figure, rounded.
    readme = (reading.ROOT.parent / "README.md").read_text()
    listed = dict(re.findall(r"\]\(notebooks/(?:deep-dives/)?([^)/]+\.ipynb)\) \|.*\| (\d+) min \|",
                             readme))
    assert set(listed) == {r["notebook"] for r in ROWS}
    for r in ROWS:
        assert abs(int(listed[r["notebook"]]) - r["minutes"]) <= 1, (r, listed[r["notebook"]])
