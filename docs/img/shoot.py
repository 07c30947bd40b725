"""The README's two screenshots, from a demo store (`phasescope demo` wrote it):

- diagnose-80.png: `phasescope diagnose` run in an 80-column tmux pane (its colors as the terminal shows them,
  `tmux capture-pane -e`), drawn by rich's SVG export and Chromium;
- overview.png: the dashboard's Overview page of the same store in headless Chromium (playwright).

    python docs/img/shoot.py phasescope.duckdb          # writes docs/img/*.png (needs tmux and chromium)
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run"]


def diagnose_in_tmux(db: str, columns: int = 80) -> str:
    """What `phasescope diagnose DB` shows in a `columns`-wide tmux pane, with its ANSI colors."""
    session = f"ps-shot-{os.getpid()}"
    cmd = f"{shutil.which('phasescope') or sys.executable + ' -m phasescope.cli'} diagnose {db}; tmux wait -S {session}"
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", str(columns), "-y", "80", "bash", "-c",
                    cmd + "; sleep 60"], check=True, env=dict(os.environ, TERM="xterm-256color"))
    try:
        subprocess.run(["tmux", "wait", session], check=True, timeout=300)
        out = subprocess.run(["tmux", "capture-pane", "-e", "-p", "-t", session], check=True, capture_output=True,
                             text=True).stdout
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
    return out.rstrip("\n") + "\n"


def svg_of(ansi: str, columns: int = 80) -> str:
    from rich.console import Console
    from rich.text import Text

    console = Console(record=True, width=columns, force_terminal=True, color_system="truecolor", file=open(os.devnull, "w"))
    console.print(Text.from_ansi(ansi))
    return console.export_svg(title="phasescope diagnose (80 columns)")


def shoot_svg(browser, svg: str, path: pathlib.Path) -> None:
    with tempfile.NamedTemporaryFile("w", suffix=".svg", delete=False) as f:
        f.write(svg)
    page = browser.new_page(viewport={"width": 1000, "height": 800}, device_scale_factor=1)
    page.goto(f"file://{f.name}")
    page.locator("svg").screenshot(path=str(path))
    os.unlink(f.name)


def shoot_overview(browser, db: str, path: pathlib.Path) -> None:
    app = subprocess.Popen([sys.executable, "-m", "phasescope.cli", "dashboard", db, "--port", "0"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        port = None
        while port is None:
            line = app.stdout.readline()
            if not line:
                raise SystemExit("the dashboard exited before it listened")
            m = re.search(r"URL: http://127\.0\.0\.1:(\d+)", line)
            port = int(m.group(1)) if m else None
        page = browser.new_page(viewport={"width": 1400, "height": 1100})
        page.goto(f"http://127.0.0.1:{port}/?page=overview", wait_until="domcontentloaded", timeout=60_000)
        page.get_by_role("heading", name="Overview").wait_for(timeout=120_000)
        page.get_by_text("Findings (").first.wait_for(timeout=120_000)
        for _ in range(600):  # settled: no script running
            if page.locator('[data-testid="stStatusWidgetRunningIcon"]').count() == 0:
                break
            time.sleep(0.2)
        time.sleep(1.0)
        page.screenshot(path=str(path))
    finally:
        app.terminate()
        app.wait(30)


def main() -> None:
    db = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else "phasescope.duckdb")
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    ansi = diagnose_in_tmux(db)
    print(f"diagnose at 80 columns: {len(ansi.splitlines())} lines")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, headless=True, args=ARGS)
        try:
            shoot_svg(browser, svg_of(ansi), HERE / "diagnose-80.png")
            shoot_overview(browser, db, HERE / "overview.png")
        finally:
            browser.close()
    print("wrote", HERE / "diagnose-80.png", HERE / "overview.png")


if __name__ == "__main__":
    main()
