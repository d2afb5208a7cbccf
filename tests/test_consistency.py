"""One quantity, one number: every notebook that prints a quantity the course quotes in more than
one place prints the same value for it, and, where that is cheap, the value of its one source
(``kvlib.budget.plan_budget``; the H200 reference's JSON in ``figures/h200/``). Read from the
committed notebooks' outputs (JSON, no model runs), so it holds after each re-execution; a notebook
that stops printing a quantity fails too, so that the test never passes by finding nothing."""

import json
import re
from functools import cache
from pathlib import Path

import pytest
import torch

from kvlib.budget import plan_budget, plan_kv
from kvlib.config import GIB, MIB, load_config

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
H200 = ROOT / "figures" / "h200"
N, PCT = r"(\d[\d,]*)", r"(\d+\.\d)%"  # an integer as printed (32,579); a percentage (3.1%)
SHORT = r"cat {cat} tokens, short of prealloc by {lost} tokens, {pct} of prealloc's {pre}"
UNDER_CAP = "longest context under the cap: " + SHORT  # the H200 reference's two caches
ON_SIM = "longest context on the simulated card: " + SHORT
ANY = r"[\d,.]+%?"


def short(**one) -> str:
    """The ``short_of`` line with one field captured, the others matched."""
    return SHORT.format(**{k: one.get(k, ANY) for k in ("cat", "lost", "pct", "pre")})


def reference():
    return json.loads((H200 / "gpu_longest.json").read_text())["data"]


def plan(cache_kind: str = "prealloc", kv: str | None = None) -> str:
    config = load_config("qwen3-4b")
    if kv is not None:
        return f"{plan_kv(config, torch.bfloat16, 12 * GIB, kv).max_context:,}"
    return f"{plan_budget(config, torch.bfloat16, 12 * GIB, cache=cache_kind).max_context:,}"


def ref_source(key: str) -> str:
    d = reference()
    pre, cat = d["prealloc"], d["cat"]
    fit = [t["peak_reserved"] - t["peak_allocated"] for t in d["tries"]["prealloc"] if t["fits"]]
    timeline = json.loads((H200 / "gpu_timeline.json").read_text())["data"]["rows"]
    decode = [r["reserved"] - r["allocated"] for rows in timeline.values() for r in rows]
    return {"prealloc": f"{pre:,}", "cat": f"{cat:,}", "lost": f"{pre - cat:,}",
            "pct": f"{(pre - cat) / pre:.1%}"[:-1], "plan": f"{d['arithmetic']:,}",
            "reached": f"{pre / d['arithmetic']:.1%}"[:-1],
            "fit_gap": f"{min(fit) / MIB:.0f}–{max(fit) / MIB:.0f}",
            "cat_gap": f"{max(r['reserved'] - r['allocated'] for r in d['cat_trace']) / MIB:,.0f}",
            "decode_gap": f"{min(decode) / MIB:.0f}–{max(decode) / MIB:.0f}"}[key]


# name -> ({notebook: [patterns, each with one group: the value]}, the source or None, optional)
# where a notebook is optional (its owner may rephrase the line), it is checked only if it prints
QUANTITIES = {
    "plan, prealloc (weights + KV + workspace)": ({
        "00": [r"max_context=" + N, r"the plan: " + N],
        "03": [r"both caches run to " + N + " tokens"],
        "06": [r"prealloc: longest context " + N + " tokens", r"prealloc: plan " + N + ","],
        "08": [r"KV as bf16: [\d,]+ B per token -> the plan's longest context " + N],
        "deep": [r"qwen3-4b: GQA [\d,]+ [\d.]+ GiB " + N + " tokens"],
    }, lambda: plan("prealloc"), {"05": [r"holds max_seq = " + N + " slots"],
                                  "07": [r"GiB of weights, " + N + " tokens of KV"]}),
    "plan, cat": ({
        "02": [r"cat's plan on 12 GiB: " + N + " tokens"],
        "06": [r"cat: longest context " + N + " tokens", r"cat: plan " + N + ","],
    }, lambda: plan("cat"), {}),
    "plan, int8 KV": ({
        "08": [r"KV as int8: [\d,]+ B per token -> the plan's longest context " + N],
        "deep": [r"qwen3-4b: int8 codes \+ scales [\d,]+ [\d.]+ GiB [\d,]+ \(memory: " + N + r"\)"],
    }, lambda: plan(kv="int8"), {}),
    "plan, int4 KV": ({
        "08": [r"KV as int4: [\d,]+ B per token -> the plan's longest context " + N],
        "deep": [r"qwen3-4b: int4 codes \+ scales [\d,]+ [\d.]+ GiB [\d,]+ \(memory: " + N + r"\)"],
    }, lambda: plan(kv="int4"), {}),
    "simulated card, prealloc's longest context": ({
        "00": [r"simulated 12 GiB card · Qwen3-4B bf16: longest context " + N],
        "03": ["longest context on the simulated card: " + short(pre=N)],
        "06": [r"prealloc: plan [\d,]+, simulated " + N],
    }, None, {}),
    "simulated card, cat's longest context": ({
        "02": [r"cat's longest context " + N + r" tokens \(every prompt up to it fits\)"],
        "03": ["longest context on the simulated card: " + short(cat=N)],
        "06": [r"cat: plan [\d,]+, simulated " + N],
    }, None, {}),
    "H200 reference, prealloc's longest context": ({
        "00": [r"prealloc reached " + N + " tokens, [\\d.]+% of that run's plan"],
        "02": ["longest context under the cap: " + short(pre=N)],
        "03": ["longest context under the cap: " + short(pre=N)],
        "06": ["longest context under the cap: " + short(pre=N),
               r"prealloc reached " + N + " tokens, [\\d.]+% of that run's plan"],
    }, lambda: ref_source("prealloc"), {}),
    "H200 reference, cat's longest context": (
        {nb: ["longest context under the cap: " + short(cat=N)] for nb in ("02", "03", "06")},
        lambda: ref_source("cat"), {}),
    "H200 reference, cat's loss in tokens": (
        {nb: ["longest context under the cap: " + short(lost=N)] for nb in ("02", "03", "06")},
        lambda: ref_source("lost"), {}),
    "H200 reference, cat's loss in % of prealloc's": (
        {nb: ["longest context under the cap: " + short(pct=PCT)] for nb in ("02", "03", "06")},
        lambda: ref_source("pct"), {}),
    "H200 reference, that run's own plan": (
        {nb: [r"of that run's plan \(" + N + ";"] for nb in ("00", "06")},
        lambda: ref_source("plan"), {}),
    "H200 reference, prealloc in % of that run's plan": (
        {nb: [r"prealloc reached [\d,]+ tokens, " + PCT + " of that run's plan"]
         for nb in ("00", "06")}, lambda: ref_source("reached"), {}),
    "H200 reference, reserved above allocated: prealloc's trial runs": (
        {nb: [r"in those runs: prealloc (\d+–\d+) MiB at the peak"] for nb in ("02", "03")},
        lambda: ref_source("fit_gap"), {}),
    "H200 reference, reserved above allocated: cat's prefill chunks": (
        {nb: [r"cat up to " + N + " MiB after a prefill chunk"] for nb in ("02", "03")},
        lambda: ref_source("cat_gap"), {}),
    "H200 reference, reserved above allocated: the timeline run's decode steps": (
        {"00": [r"reserved stayed (\d+–\d+) MiB above allocated at every step"]},
        lambda: ref_source("decode_gap"), {}),
}


def path(nb: str) -> Path:
    if nb == "deep":
        return NOTEBOOKS / "deep-dives" / "fewer-bytes-by-design.ipynb"
    return next(NOTEBOOKS.glob(f"{nb}-*.ipynb"))


@cache
def cells(nb: str) -> list[dict]:
    return json.loads(path(nb).read_text())["cells"]


@cache
def printed(nb: str) -> str:
    """Every output text of the notebook's code cells, whitespace collapsed: a printed line wraps
    at 100 characters, between words, with its continuation indented."""
    texts = [out.get("text") or out.get("data", {}).get("text/plain", "")
             for c in cells(nb) for out in c.get("outputs", [])]
    return re.sub(r"\s+", " ", " ".join("".join(t) for t in texts))


def values(patterns: dict[str, list[str]], required: bool = True) -> dict[str, list[str]]:
    found = {}
    for nb, pats in patterns.items():
        for pat in pats:
            hits = re.findall(pat, printed(nb))
            assert hits or not required, f"notebook {nb} prints no line matching {pat!r}"
            found.setdefault(nb, []).extend(hits)
    return {nb: v for nb, v in found.items() if v}


@pytest.mark.parametrize("name", list(QUANTITIES))
def test_one_quantity_one_number(name):
    required, source, optional = QUANTITIES[name]
    found = values(required) | values(optional, required=False)
    distinct = {v for vs in found.values() for v in vs}
    assert len(distinct) == 1, f"{name}: different values in the notebooks: {found}"
    if source is not None:
        assert distinct == {source()}, f"{name}: the notebooks print {found}, its source {source()}"


def test_the_simulated_card_holds_the_plan():
    """The plan promises what fits on the simulated card, at most 1% short of it."""
    for cache_kind, nb, pat in (("prealloc", "06", r"prealloc: plan [\d,]+, simulated " + N),
                                ("cat", "06", r"cat: plan [\d,]+, simulated " + N)):
        found = int(values({nb: [pat]})[nb][0].replace(",", ""))
        planned = int(plan(cache_kind).replace(",", ""))
        assert planned <= found < 1.01 * planned, (cache_kind, planned, found)


def test_every_shortfall_adds_up():
    """Each ``short_of`` line's tokens and percentage follow from its two contexts."""
    line = SHORT.format(cat=N, lost=N, pct=PCT, pre=N)
    seen = 0
    for nb in ("02", "03", "06"):
        for cat, lost, pct, pre in re.findall(line, printed(nb)):
            cat, lost, pre = (int(x.replace(",", "")) for x in (cat, lost, pre))
            assert lost == pre - cat and pct == f"{100 * lost / pre:.1f}", (nb, cat, lost, pct, pre)
            seen += 1
    assert seen >= 4, f"{seen} shortfall lines: 02, 03 (simulated card, H200) and 06 print 4"


def test_markdown_states_no_measured_number():
    """A measured number (the simulated card's, the H200 reference's) is printed where the
    learner meets it, never typed in a notebook's text (a plan's number, arithmetic, may be)."""
    def printed_values(kind: str) -> set[str]:
        return {v for name in QUANTITIES if name.startswith(kind)
                for vs in values(QUANTITIES[name][0], required=False).values() for v in vs}

    reference = [ref_source(k) for k in ("prealloc", "cat", "lost", "plan", "cat_gap", "fit_gap",
                                         "decode_gap")]
    reference += [ref_source(k) + "%" for k in ("pct", "reached")]
    gib = f"{int(ref_source('cat_gap').replace(',', '')) / 1024:.1f} GiB"  # cat's gap, in GiB
    numbers = printed_values("simulated") - printed_values("plan") | {*reference, gib}
    typed = [(p.relative_to(NOTEBOOKS).as_posix(), i, n)
             for p in [*NOTEBOOKS.glob("*.ipynb"), *NOTEBOOKS.glob("deep-dives/*.ipynb")]
             for i, c in enumerate(json.loads(p.read_text())["cells"])
             if c["cell_type"] == "markdown"
             for n in sorted(numbers) if re.search(rf"(?<![\d,.]){re.escape(n)}(?![\d,]|\.\d)",
                                                   "".join(c["source"]))]
    assert not typed, f"measured numbers typed in markdown (notebook, cell, number): {typed}"
