"""The committed GPU references, rewritten from a GPU check's output:
``python tests/references.py OUTDIR [--to FOLDER] [--recheck]``, a maintainer's tool
beside the GPU check.

What the notebooks read from ``figures/h200/``: the figures the check saves (``gpu_longest``,
``gpu_timeline``, ``gpu_graph_memory``, each a JSON with its label and a PNG), the bench's
(``bench.json``, ``bench.md``, ``bench_time``, ``bench_bytes``, ``bench_floor``), the check's
``PASS`` / ``FAIL`` lines as printed (``gpu_check.log``: notebook 05 reads its decode line;
``--recheck`` writes ``gpu_check_recheck.log``, a second run's), and ``gpu_sdpa.json``, the sdpa
check's rows (what a length never seen costs each kernel). Only what the run produced is copied;
the rest is left as it was and named. ``README.md`` is prose written after reading a run: never
rewritten here. Then re-execute the notebooks (on any machine) and they show the new run.
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's course/

from course.plots import FIGURES  # noqa: E402

__all__ = ["build"]

DEFAULT = FIGURES / "h200"
CHECK_FIGURES = ("gpu_longest", "gpu_timeline", "gpu_graph_memory")
BENCH = ("bench.json", "bench.md", "bench_time.json", "bench_time.png", "bench_bytes.json",
         "bench_bytes.png", "bench_floor.json", "bench_floor.png")


def build(out: Path, to: Path = DEFAULT, recheck: bool = False) -> dict[str, list[str]]:
    """Copy the references from the check's ``out`` into ``to``; ``{"written", "missing"}``."""
    out, to = Path(out), Path(to)
    report = json.loads((out / "gpu_check.json").read_text())
    if report["dry_run"]:
        raise ValueError(f"{out} is a dry run: nothing in it ran on a GPU")
    if report.get("rehearsal") and to.resolve() == DEFAULT.resolve():
        raise ValueError(f"{out} is a rehearsal on a fake {report['rehearsal']}: its numbers are "
                         f"no card's, and never go into {DEFAULT}")
    to.mkdir(parents=True, exist_ok=True)
    log = "gpu_check_recheck.log" if recheck else "gpu_check.log"
    (to / log).write_text("".join(f"{c['status']:4s}  {c['check']:12s} {c['line']}\n"
                                  for c in report["checks"]))
    written, missing = [log], []
    sdpa = next((c for c in report["checks"] if c["check"] == "sdpa"), None)
    if sdpa is not None and sdpa["status"] != "SKIP":
        stored = {"label": report["label"], "data": sdpa["data"]}
        (to / "gpu_sdpa.json").write_text(json.dumps(stored, indent=1) + "\n")
        written.append("gpu_sdpa.json")
    names = [(out, f"{stem}.{ext}") for stem in CHECK_FIGURES for ext in ("json", "png")]
    for folder, name in [*names, *((out / "bench", name) for name in BENCH)]:
        if (folder / name).is_file():
            shutil.copyfile(folder / name, to / name)
            written.append(name)
        else:
            missing.append(name)
    return {"written": written, "missing": missing}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python tests/references.py", description=__doc__)
    p.add_argument("outdir", type=Path, help="the GPU check's output (default build/gpu-check)")
    p.add_argument("--to", type=Path, default=DEFAULT, help=f"default: {DEFAULT}")
    p.add_argument("--recheck", action="store_true", help="a second run: gpu_check_recheck.log")
    a = p.parse_args(argv)
    try:
        done = build(a.outdir, a.to, a.recheck)
    except (ValueError, FileNotFoundError) as e:
        print(e, file=sys.stderr)
        return 2
    print(f"{a.to}: wrote {', '.join(done['written'])}"
          + (f"; not in this run, left as they were: {', '.join(done['missing'])}"
             if done["missing"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
