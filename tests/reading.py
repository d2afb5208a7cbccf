"""The reading load of each notebook, counted from its committed JSON.

A learner has an afternoon: every notebook should read in at most 30 minutes and the whole
course (deep dives included) in at most 300, at a reader's rates, not a skimmer's. Hedges count
the words that talk about the measuring rather than the cache; a notebook keeps at most 12.
``python tests/reading.py`` prints the table (a maintainer's tool: no notebook imports it);
``tests/test_reading.py`` holds the budget.
"""

import json
import re
import sys
from pathlib import Path

MD_WPM, OUTPUT_WPM, CODE_LPM = 140, 200, 25  # markdown words, output words, non-blank code lines
NOTEBOOK_MINUTES, COURSE_MINUTES, HEDGES = 30, 300, 12
HEDGE_WORDS = ("verdict", "disturb", "prediction", "borne out", "within the spread",
               "this run", "original design", "not measurable", "not explained", "hypothesis")
ROOT = Path(__file__).resolve().parents[1] / "notebooks"
COUNTS = ("md_words", "code_lines", "output_words", "hedges")


def _text(value):
    return "".join(value) if isinstance(value, list) else value


def _output_text(output):
    kind = output.get("output_type")
    if kind == "error":
        return "\n".join(output.get("traceback", []))
    if kind not in ("stream", "execute_result"):
        return ""  # a figure's "<Figure size ...>" is not read
    return _text(output.get("text", "") or output.get("data", {}).get("text/plain", ""))


def load(path):
    """One notebook's counts: words of markdown and output, code lines, hedges, minutes."""
    cells = json.loads(Path(path).read_text())["cells"]
    md = [_text(c["source"]) for c in cells if c["cell_type"] == "markdown"]
    code = [_text(c["source"]) for c in cells if c["cell_type"] == "code"]
    out = [_output_text(o) for c in cells if c["cell_type"] == "code" for o in c.get("outputs", [])]
    md_words = sum(len(s.split()) for s in md)
    code_lines = sum(1 for s in code for line in s.splitlines() if line.strip())
    out_words = sum(len(s.split()) for s in out)
    everything = "\n".join(md + code + out).lower()
    hedges = sum(len(re.findall(re.escape(w), everything)) for w in HEDGE_WORDS)
    minutes = md_words / MD_WPM + out_words / OUTPUT_WPM + code_lines / CODE_LPM
    return {"notebook": Path(path).name, "minutes": round(minutes, 1), "md_words": md_words,
            "code_lines": code_lines, "output_words": out_words, "hedges": hedges}


def notebooks(root=ROOT):
    """Every notebook of the course, the deep dives included, in reading order."""
    return sorted(root.glob("*.ipynb")) + sorted((root / "deep-dives").glob("*.ipynb"))


def table(root=ROOT):
    rows = [load(p) for p in notebooks(root)]
    total = {"notebook": "all"} | {k: sum(r[k] for r in rows) for k in ("minutes", *COUNTS)}
    head = "| notebook | minutes | " + " | ".join(k.replace("_", " ") for k in COUNTS) + " |"
    lines = [head, "|---" * 6 + "|"]
    lines += [f"| {r['notebook']} | {r['minutes']:.0f} | " + " | ".join(f"{r[k]:,}" for k in COUNTS)
              + " |" for r in rows + [total]]
    return rows, "\n".join(lines)


if __name__ == "__main__":
    print(table(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)[1])
