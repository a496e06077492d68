"""Driving `ds4lab lab` from headless Chromium (Playwright on Debian's chromium): start and stop
the server, open a notebook by double-clicking it, run every cell, read what the outputs show,
move a widget and check that the output it drives changes and still shows a drawn figure.
Every wait has a timeout.

`python tests/jupyterlab_browser.py reports/lab.png` takes the README's screenshot: JupyterLab
on the shipped notebooks only, notebook 02 run and its head slider moved.
"""

from __future__ import annotations

import base64
import io
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

# Debian's chromium on a closed network: without the background-networking flags it stalls on
# connections that are refused.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]

# Interactive ipywidgets controls (a progress bar is a widget too, but not one to move).
CONTROLS = ".widget-slider, .widget-dropdown, .widget-checkbox, .widget-text, .widget-button, .widget-toggle-buttons"

# What an output shows when it failed: an exception or stderr (JupyterLab renders both as
# stderr), a widget that never rendered, an output no renderer took.
_ERROR_OUTPUTS = '[data-mime-type="application/vnd.jupyter.stderr"]'
_WIDGET_FAILURES = ("Loading widget...", "Error displaying widget", "No renderer could be found")

_ACTIVE_NOTEBOOK = ".jp-NotebookPanel:not(.lm-mod-hidden)"

# Outputs no cell took (a display or print from a widget callback outside any Output widget,
# say) go to JupyterLab's log console; its status bar item counts them for the active notebook.
_LOG_STATUS = ".jp-LogConsoleStatusItem:not(.lm-mod-hidden) [title]"

# A redrawn figure is "drawn" when at least this share of its pixels differs from its
# background, and at least this fraction of the share the figure before the move had (a
# redraw that keeps only a title and a border has ~0.2% against ~20%).
MIN_INK = 0.01
KEPT_INK = 0.25


def shipped_notebooks() -> list[Path]:
    """ds4lab's notebooks (`notebooks/NN_topic.py`), in order."""
    from ds4lab.notebooks import NOTEBOOK_DIR

    return sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.py"))


def chromium_executable() -> str | None:
    """$DS4LAB_CHROMIUM, else Debian's /usr/bin/chromium, else `chromium` on PATH."""
    for candidate in (os.environ.get("DS4LAB_CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium")):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


def launch_browser(playwright, executable: str, profile: str):
    """Headless `executable` (Debian's chromium, never a downloaded one) with the fresh profile
    folder `profile`, a 1280 x 900 viewport and 60 s default timeouts; the browser context."""
    context = playwright.chromium.launch_persistent_context(
        profile, executable_path=executable, headless=True, args=CHROMIUM_FLAGS,
        viewport={"width": 1280, "height": 900})
    context.set_default_timeout(60_000)
    return context


def lab_environment(root: Path) -> dict[str, str]:
    """The environment of a `ds4lab lab` under test: a private cache, JupyterLab settings
    (autosave off: nothing is written back) and workspace under `root`, and no DS4LAB_MODEL
    (the notebooks use their built-in tiny model)."""
    settings = root / "settings" / "@jupyterlab" / "docmanager-extension"
    settings.mkdir(parents=True)
    (settings / "plugin.jupyterlab-settings").write_text('{"autosave": false}', encoding="utf-8")
    env = {**os.environ, "DS4LAB_CACHE": str(root / "cache"), "JUPYTERLAB_SETTINGS_DIR": str(root / "settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(root / "workspaces")}
    env.pop("DS4LAB_MODEL", None)
    return env


@dataclass
class LabServer:
    """A running `ds4lab lab`: its process, URL and token."""

    process: subprocess.Popen
    base_url: str
    token: str
    port: int

    def request(self, path: str, token: str | None = None) -> tuple[int, str]:
        """GET `path` (redirects not followed) with `token` in the Authorization header, if given:
        (status, location header or body start)."""

        class NoRedirect(urllib.request.HTTPRedirectHandler):
            def redirect_request(self, *args, **kwargs):
                return None

        headers = {"Authorization": f"token {token}"} if token else {}
        opener = urllib.request.build_opener(NoRedirect)
        try:
            with opener.open(urllib.request.Request(self.base_url + path, headers=headers), timeout=10) as response:
                return response.status, response.read(2000).decode("utf-8", "replace")
        except urllib.error.HTTPError as exc:
            return exc.code, exc.headers.get("Location") or exc.read(2000).decode("utf-8", "replace")

    def shut_down_kernels(self) -> None:
        """Every running kernel, through the REST API (the page's notebook stays dirty and open)."""
        _, body = self.request("/api/kernels", self.token)
        for kernel in json.loads(body):
            request = urllib.request.Request(f"{self.base_url}/api/kernels/{kernel['id']}", method="DELETE",
                                             headers={"Authorization": f"token {self.token}"})
            urllib.request.urlopen(request, timeout=30).close()


def start_lab(directory: Path, env: dict[str, str], log: Path, *options: str, timeout: float = 180) -> LabServer:
    """`ds4lab lab --dir DIRECTORY [OPTIONS]` on a free port; returns once it printed its URL
    (stderr to `log`)."""
    process = subprocess.Popen([sys.executable, "-m", "ds4lab.cli", "lab", "--dir", str(directory), *options], env=env,
                               stdout=subprocess.PIPE, stderr=log.open("wb"), text=True, start_new_session=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True).start()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1).strip()
            except queue.Empty:
                if process.poll() is not None:
                    break
                continue
            match = re.fullmatch(r"(http://127\.0\.0\.1:(\d+))/lab\?token=(\S+)", line)
            if match:
                return LabServer(process, match[1], match[3], int(match[2]))
    except BaseException:
        stop_lab(process)
        raise
    stop_lab(process)
    raise RuntimeError(f"ds4lab lab printed no URL within {timeout:.0f} s (status {process.returncode}); "
                       f"its log:\n{log.read_text(errors='replace')[-3000:]}")


def stop_lab(process: subprocess.Popen, timeout: float = 60) -> None:
    """SIGTERM to `ds4lab lab` (it stops the server, which stops its kernels); SIGKILL after
    `timeout` s."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def open_notebook(page, server: LabServer, name: str, timeout_ms: int = 120_000):
    """Load JupyterLab (a fresh workspace), double-click `name` in the file browser and wait
    for its kernel to be ready; the notebook panel."""
    page.goto(f"{server.base_url}/lab?reset&token={server.token}", timeout=timeout_ms)
    page.locator(".jp-DirListing-item", has=page.locator(".jp-DirListing-itemText", has_text=name)).dblclick(
        timeout=timeout_ms)
    panel = page.locator(_ACTIVE_NOTEBOOK)
    panel.locator(".jp-Cell").first.wait_for(timeout=timeout_ms)
    page.locator(f'.jp-StatusBar-TextItem[title="Change kernel for {name}"]', has_text="| Idle").wait_for(
        timeout=timeout_ms)
    return panel


def run_all_cells(page, timeout_ms: int) -> None:
    """Run → Run All Cells, then wait until every code cell shows an execution count, or until
    none is queued or running and one shows an error (Run All stops there). A dialog (a kernel
    to choose, say) fails at once with its text."""
    page.locator(".lm-MenuBar-item", has_text="Run").click()
    page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
    page.wait_for_function(f"""() => {{
        if (document.querySelector('.jp-Dialog')) return true;
        const notebook = document.querySelector('{_ACTIVE_NOTEBOOK}');
        const prompts = [...notebook.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt')].map(p => p.textContent);
        if (prompts.some(p => p.includes('*'))) return false;
        return prompts.every(p => /\\[\\d+\\]/.test(p))
            || notebook.querySelector('.jp-OutputArea-output{_ERROR_OUTPUTS}') !== null;
    }}""", timeout=timeout_ms, polling=500)
    dialog = page.locator(".jp-Dialog")
    if dialog.count():
        raise AssertionError(f"JupyterLab asks: {' '.join(dialog.first.inner_text().split())}")


def log_entries(page) -> int:
    """How many entries JupyterLab's log console holds for the active notebook (its status bar
    item is hidden while there are none)."""
    titles = page.locator(_LOG_STATUS).evaluate_all("nodes => nodes.map(node => node.title)")
    return sum(int(match[1]) for title in titles if (match := re.search(r"(\d+) log entries", title)))


def output_problems(panel) -> list[str]:
    """What the notebook's outputs show that a reader should not see: errors, stderr, widgets
    that did not render, outputs that went to the log console. Empty when clean."""
    problems = [f"error/stderr output: {text.strip()[:500]}"
                for text in panel.locator(f".jp-OutputArea-output{_ERROR_OUTPUTS}").all_text_contents()]
    text = "\n".join(panel.locator(".jp-OutputArea-output").all_text_contents())
    problems += [f"an output reads {failure!r}" for failure in _WIDGET_FAILURES if failure in text]
    logged = log_entries(panel.page)
    if logged:
        problems.append(f"{logged} output(s) no cell took went to the log console (View > Show Log Console)")
    return problems


def move_slider(slider) -> None:
    """One step right on an ipywidgets slider, by keyboard on its handle; checks the readout moved."""
    readout = slider.locator(".widget-readout")
    before = readout.inner_text()
    slider.locator(".noUi-handle").focus()
    slider.page.keyboard.press("ArrowRight")
    deadline = time.monotonic() + 10
    while readout.inner_text() == before:
        if time.monotonic() > deadline:
            raise AssertionError(f"the slider did not move (readout stays {before!r})")
        time.sleep(0.1)


def choose_option(dropdown, label: str) -> None:
    """Pick `label` in an ipywidgets dropdown."""
    dropdown.locator("select").select_option(label=label)


def shown(output) -> list[str]:
    """What an output area shows: per output its text and its images' data."""
    return output.evaluate("""area => [...area.querySelectorAll('.jp-OutputArea-output')].map(
        o => o.textContent + [...o.querySelectorAll('img')].map(image => ' ' + image.src).join(''))""")


def figures(output) -> list[bytes]:
    """The PNG data of the images an output area shows (JupyterLab shows image/png as a data URL)."""
    sources = output.evaluate("area => [...area.querySelectorAll('.jp-OutputArea-output img')].map(i => i.src)")
    pngs = []
    for source in sources:
        kind, _, data = source.partition(",")
        if kind != "data:image/png;base64":
            raise AssertionError(f"an output image is not an inline PNG: {source[:80]!r}")
        pngs.append(base64.b64decode(data, validate=True))
    return pngs


def ink(png: bytes) -> float:
    """The share of a PNG's pixels that differ from its most common colour (its background) by
    more than 16 of 255 in some channel: 0 for a blank image."""
    pixels = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.int32).reshape(-1, 3)
    packed = pixels[:, 0] << 16 | pixels[:, 1] << 8 | pixels[:, 2]
    colours, counts = np.unique(packed, return_counts=True)
    background = pixels[np.argmax(packed == colours[counts.argmax()])]
    return float((np.abs(pixels - background).max(axis=1) > 16).mean())


def assert_figures_drawn(output, before: list[float]) -> None:
    """The figures `output` shows are drawn: there are some if there were (`before`: their
    ink), none is almost uniform (`MIN_INK`) or far fainter than the faintest before
    (`KEPT_INK`)."""
    now = [ink(png) for png in figures(output)]
    if before and not now:
        raise AssertionError(f"the output showed {len(before)} figure(s) before the widget moved and none after")
    need = max(MIN_INK, KEPT_INK * min(before, default=0.0))
    if now and min(now) < need:
        was = f"{min(before):.2%} before the move" if before else "no figure before the move"
        raise AssertionError(f"a figure was redrawn (almost) blank: {min(now):.2%} of its pixels drawn ({was}; "
                             f"{need:.2%} needed)")


def assert_widget_drives_output(output, move: Callable[[], None], timeout: float = 60, settle: float = 1.0) -> None:
    """`move()` a widget; the `output` it drives must then show something else, and keep
    showing it for `settle` s (a redraw of the same thing passes through other states), with
    its figures drawn (`assert_figures_drawn`)."""
    before = shown(output)
    inked = [ink(png) for png in figures(output)]
    move()
    deadline = time.monotonic() + timeout
    showing, since = before, time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.25)
        now = shown(output)
        if now != showing:
            showing, since = now, time.monotonic()
        elif showing != before and time.monotonic() - since >= settle:
            assert_figures_drawn(output, inked)
            return
    raise AssertionError(f"moving the widget did not change the output it drives within {timeout:.0f} s")


def bring_into_view(locator, timeout: float = 20) -> None:
    """Scroll until `locator` is on screen and painted: the notebook renders cells lazily, so
    the first scroll lands on estimated heights."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        locator.scroll_into_view_if_needed()
        time.sleep(0.5)
        if locator.evaluate("""node => {
                const box = node.getBoundingClientRect();
                return box.height > 0 && box.top >= 0 && box.top < window.innerHeight;
            }"""):
            return
    raise AssertionError(f"{locator} did not come into view within {timeout:.0f} s")


def save_screenshot(page, path: Path, timeout: float = 10) -> Path:
    """The page as PNG at `path`, written atomically, once two shots `timeout` s at most
    apart agree (large figures are painted in tiles)."""
    deadline = time.monotonic() + timeout
    shot, previous = page.screenshot(), None
    while shot != previous and time.monotonic() < deadline:
        time.sleep(0.5)
        shot, previous = page.screenshot(), shot
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_bytes(shot)
    partial.replace(path)
    return path


def readme_screenshot(path: Path, timeout_ms: int = 300_000) -> Path:
    """`ds4lab lab` on copies of the shipped notebooks only; notebook 02 opened, run, checked
    and its head slider moved; the page saved at `path` as a 128-colour PNG (~50 KB)."""
    from playwright.sync_api import sync_playwright

    executable = chromium_executable()
    if executable is None:
        raise SystemExit("chromium not found (/usr/bin/chromium, or DS4LAB_CHROMIUM): `bash setup.sh` installs it")
    with tempfile.TemporaryDirectory(prefix="ds4lab-screenshot-") as folder:
        root = Path(folder)
        served = root / "notebooks"
        served.mkdir()
        for notebook in shipped_notebooks():
            shutil.copy(notebook, served)
        server = start_lab(served, lab_environment(root), root / "lab.log")
        try:
            with sync_playwright() as playwright:
                context = launch_browser(playwright, executable, str(root / "profile"))
                try:
                    page = context.new_page()
                    panel = open_notebook(page, server, "02_attention_and_indexer.py", timeout_ms)
                    run_all_cells(page, timeout_ms)
                    cell = panel.locator(".jp-CodeCell").filter(has=page.locator(CONTROLS)).last
                    bring_into_view(cell)
                    assert_widget_drives_output(cell.locator(".widget-output"),
                                                lambda: move_slider(cell.locator(".widget-slider", has_text="head")))
                    problems = output_problems(panel)
                    if problems:
                        raise AssertionError("notebook 02 does not run clean: " + "; ".join(problems))
                    save_screenshot(page, path)
                finally:
                    context.close()
        finally:
            stop_lab(server.process)
    Image.open(path).convert("RGB").quantize(colors=128, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python tests/jupyterlab_browser.py OUT.png")
    print(readme_screenshot(Path(sys.argv[1])))
