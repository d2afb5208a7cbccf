"""What a learner meets on opening each notebook in JupyterLab, checked in a real browser.

A dev tool, not a test: pytest does not collect it (its name does not start with ``test_``) and
the course does not need a browser. It needs Chromium and its driver (Debian: ``apt-get install
chromium chromium-driver``) and selenium in the venv (``.venv/bin/pip install selenium``; not in
requirements.txt). From the repository root::

    .venv/bin/python tests/browser_check.py [NOTEBOOK ...] [--out DIR] [--port 8899]

It starts this venv's JupyterLab on 127.0.0.1 with no token, autosave off and a throwaway settings
and workspace folder (nothing is written to the notebooks or to ~/.jupyter), opens each notebook
(all of them by default; names relative to notebooks/) in a fresh workspace, waits until its kernel
is idle, screenshots it to ``DIR/<notebook>.png`` (default /tmp/browser-shots/), prints ``clean``
or ``UNSAVED`` for each, stops JupyterLab and exits 1 if opening marked any notebook unsaved (its
tab's ``jp-mod-dirty``: JupyterLab rewrote something, e.g. a kernelspec that is not the one its
kernel reports, see ``kernelspec()``).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def kernelspec() -> dict:
    """The notebook metadata JupyterLab writes for this venv's python3 kernel: its kernel.json's
    name and display_name, with the language."""
    spec = json.loads((Path(sys.prefix) / "share/jupyter/kernels/python3/kernel.json").read_text())
    return {"display_name": spec["display_name"], "language": spec["language"], "name": "python3"}


def start_lab(port: int, home: Path) -> subprocess.Popen:
    for plugin, value in (("docmanager-extension/plugin", '{"autosave": false}'),
                          ("apputils-extension/notification", '{"fetchNews": "false"}')):
        settings = home / "settings" / "@jupyterlab" / f"{plugin}.jupyterlab-settings"
        settings.parent.mkdir(parents=True, exist_ok=True)
        settings.write_text(value)  # autosave off; no news pop-up over the screenshot
    env = {**os.environ, "JUPYTERLAB_SETTINGS_DIR": str(home / "settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(home / "workspaces")}
    root = ["--allow-root"] if os.geteuid() == 0 else []
    lab = subprocess.Popen([sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}",
                            "--ServerApp.ip=127.0.0.1", "--ServerApp.token=",
                            "--ServerApp.password=", "--ServerApp.disable_check_xsrf=True",
                            f"--ServerApp.root_dir={NOTEBOOKS}", *root],
                           env=env, stdout=subprocess.DEVNULL, stderr=open(home / "lab.log", "w"))
    for _ in range(120):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status", timeout=2)
            return lab
        except OSError:
            if lab.poll() is not None:
                sys.exit(f"JupyterLab exited: see {home / 'lab.log'}")
            time.sleep(0.5)
    lab.terminate()
    sys.exit(f"JupyterLab did not answer on 127.0.0.1:{port} in 60 s: see {home / 'lab.log'}")


def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1400,1000"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)


def sessions(port: int, method: str = "GET", sid: str = "") -> list:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/api/sessions/{sid}", method=method)
    with urllib.request.urlopen(request, timeout=10) as answer:
        return json.loads(answer.read() or "[]")


def open_notebook(driver, port: int, name: str, timeout: float = 90) -> bool:
    """Open ``name`` in a fresh workspace and wait until its kernel is idle and a moment more (the
    metadata is rewritten as the kernel connects); True where its tab is marked unsaved. Its
    kernel is shut down after."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as seen
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(f"http://127.0.0.1:{port}/lab/tree/{name}?reset")
    WebDriverWait(driver, timeout).until(
        seen.presence_of_element_located((By.CSS_SELECTOR, ".jp-NotebookPanel .jp-Cell")))
    deadline = time.monotonic() + timeout
    while not [s for s in sessions(port) if s["path"] == name
               and s["kernel"]["execution_state"] == "idle"]:
        if time.monotonic() > deadline:
            sys.exit(f"{name}: no idle kernel after {timeout:.0f} s")
        time.sleep(1)
    time.sleep(3)
    tab = driver.find_element(By.CSS_SELECTOR, ".lm-DockPanel-tabBar .lm-TabBar-tab.lm-mod-current")
    return "jp-mod-dirty" in tab.get_attribute("class").split()


def shown_at(driver, text: str) -> bool:
    """Scroll the first cell whose text holds ``text`` to the top of the window; False if none.
    JupyterLab renders cells lazily: it scrolls down the notebook until one appears."""
    from selenium.webdriver.common.by import By

    for _ in range(200):
        for cell in driver.find_elements(By.CSS_SELECTOR, ".jp-NotebookPanel .jp-Cell"):
            if text in cell.text:
                driver.execute_script("arguments[0].scrollIntoView(true);", cell)
                time.sleep(2)
                return True
        driver.execute_script("document.querySelector('.jp-WindowedPanel-outer, "
                              ".jp-NotebookPanel-notebook').scrollBy(0, 800);")
        time.sleep(0.3)
    return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("notebooks", nargs="*")
    parser.add_argument("--out", type=Path, default=Path("/tmp/browser-shots"))
    parser.add_argument("--port", type=int, default=8899)
    parser.add_argument("--at", action="append", default=[], metavar="TEXT",
                        help="also screenshot the first cell whose text holds TEXT (repeatable)")
    args = parser.parse_args()
    names = args.notebooks or [str(p.relative_to(NOTEBOOKS)) for p in
                               sorted(NOTEBOOKS.glob("*.ipynb")) +
                               sorted(NOTEBOOKS.glob("deep-dives/*.ipynb"))]
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"kernelspec this JupyterLab writes: {json.dumps(kernelspec())}")
    unsaved = []
    with tempfile.TemporaryDirectory(prefix="browser-check-") as home:
        lab = start_lab(args.port, Path(home))
        driver = None
        try:
            driver = browser()
            for name in names:
                dirty = open_notebook(driver, args.port, name)
                shot = args.out / (Path(name).stem + ".png")
                driver.save_screenshot(str(shot))
                for k, text in enumerate(args.at):
                    if shown_at(driver, text):
                        driver.save_screenshot(str(args.out / f"{Path(name).stem}-at{k}.png"))
                for session in sessions(args.port):  # one kernel at a time
                    sessions(args.port, "DELETE", session["id"])
                print(f"{'UNSAVED' if dirty else 'clean':8} {name}  ({shot})")
                unsaved += [name] * dirty
        finally:
            if driver is not None:
                driver.quit()
            lab.terminate()
            lab.wait(timeout=30)
    return 1 if unsaved else 0


if __name__ == "__main__":
    sys.exit(main())
