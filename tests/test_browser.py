"""The notebooks as a researcher meets them: `ds4lab lab` in headless Chromium.

One server and one browser for the session. Every notebook is opened by a double-click in the
file browser, run with Run All Cells, checked for clean output (no error, no stderr, widgets
rendered, nothing in the log console, a figure), one widget of each widget-bearing notebook is
moved and the output it drives must change and still show drawn figures; a screenshot of each
lands in reports/browser/. The helpers are checked on notebooks that fail on purpose. Needs
Debian's chromium (`bash setup.sh` installs it); without it these tests fail. A developer
without it deselects them with `-m "not browser"`.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from pathlib import Path

import pytest
from jupyterlab_browser import (
    CONTROLS,
    assert_widget_drives_output,
    bring_into_view,
    choose_option,
    chromium_executable,
    lab_environment,
    launch_browser,
    move_slider,
    open_notebook,
    output_problems,
    run_all_cells,
    save_screenshot,
    shipped_notebooks,
    start_lab,
    stop_lab,
)

pytestmark = pytest.mark.browser

REPORTS = Path(__file__).resolve().parent.parent / "reports" / "browser"
NOTEBOOKS = [notebook.stem for notebook in shipped_notebooks()]
RUN_TIMEOUT_MS = 300_000

# The widget moved in each widget-bearing notebook, given the cell that holds the controls.
WIDGET_MOVES = {
    "02_attention_and_indexer": lambda cell: move_slider(cell.locator(".widget-slider", has_text="head")),
    "04_cache_policy": lambda cell: choose_option(cell.locator(".widget-dropdown", has_text="policy"), "lru"),
}

HEADER = """# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---
"""

# A slider that draws its value, the same with the value ignored, one whose redraw keeps only
# the title and the top border (as notebook 04's panel once did), one whose callback also
# prints outside the output it drives (that goes to the log console), and a notebook that
# writes to stderr and then raises.
SLIDER_NOTEBOOK = HEADER + """
# %%
import ipywidgets as widgets
import matplotlib.pyplot as plt


def draw(n):
    fig, ax = plt.subplots(figsize=(4, 2))
    {draw}
    plt.show()


slider = widgets.IntSlider(3, 2, 10)
{observe}
widgets.interactive(draw, n=slider)
"""
BLANK_AFTER_A_MOVE = """ax.set_title(f"n = {n}")
    if n == 3:
        ax.plot(range(n))
    else:
        ax.set_xticks([]), ax.set_yticks([])
        for side in ("left", "right", "bottom"):
            ax.spines[side].set_visible(False)"""
FIXTURES = {
    "widget_drives_output.py": SLIDER_NOTEBOOK.format(draw="ax.plot(range(n))", observe=""),
    "widget_ignored.py": SLIDER_NOTEBOOK.format(draw="ax.plot(range(3))", observe=""),
    "widget_draws_blank.py": SLIDER_NOTEBOOK.format(draw=BLANK_AFTER_A_MOVE, observe=""),
    "widget_logs.py": SLIDER_NOTEBOOK.format(
        draw="ax.plot(range(n))", observe='slider.observe(lambda change: print("n is", change["new"]), "value")'),
    "fails.py": HEADER + """
# %%
import sys

print("a warning nobody asked for", file=sys.stderr)

# %%
raise RuntimeError("on purpose")
""",
}


@pytest.fixture(scope="session")
def lab(tmp_path_factory):
    """`ds4lab lab` serving copies of the notebooks and the fixtures, with a private cache,
    settings (autosave off: nothing is written back) and workspace; stopped at the end."""
    root = tmp_path_factory.mktemp("lab")
    served = root / "notebooks"
    served.mkdir()
    for notebook in shipped_notebooks():
        shutil.copy(notebook, served)
    for name, text in FIXTURES.items():
        (served / name).write_text(text, encoding="utf-8")
    server = start_lab(served, lab_environment(root), root / "lab.log")
    try:
        yield server
    finally:
        stop_lab(server.process)


@pytest.fixture(scope="session")
def browser():
    """One headless Chromium (Debian's, never a downloaded one) with a fresh profile."""
    executable = chromium_executable()
    if executable is None:
        pytest.fail("chromium not found (/usr/bin/chromium, or DS4LAB_CHROMIUM): `bash setup.sh` installs it on "
                    "Debian; without it, deselect these tests with -m 'not browser'", pytrace=False)
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("the playwright package is missing: pip install -e '.[dev]'", pytrace=False)
    with sync_playwright() as playwright, tempfile.TemporaryDirectory(prefix="ds4lab-chromium-") as profile:
        context = launch_browser(playwright, executable, profile)
        try:
            yield context
        finally:
            context.close()


@pytest.fixture
def page(browser, lab):
    """A fresh tab; its kernels are shut down and the tab closed (unsaved) afterwards."""
    tab = browser.new_page()
    try:
        yield tab
    finally:
        lab.shut_down_kernels()
        tab.close()


def _listening_addresses(port: int) -> set[str]:
    """Local addresses (hex, as /proc spells them) of the sockets listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:
                found.add(address)
    return found


def test_server_binds_loopback_and_requires_its_token(lab):
    assert _listening_addresses(lab.port) == {"0100007F"}        # 127.0.0.1 only, no IPv6 or wildcard socket
    assert lab.request("/api/contents", lab.token)[0] == 200
    for token in (None, "not-the-token"):
        status, answer = lab.request("/api/contents", token)
        assert status == 403 and "01_tour" not in answer
    status, location = lab.request("/lab")
    assert status == 302 and location.startswith("/login")
    status, _ = lab.request(f"/files/{NOTEBOOKS[0]}.py")
    assert status in (302, 403)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_in_the_browser(name, page, lab):
    panel = open_notebook(page, lab, f"{name}.py")
    assert panel.locator(".jp-CodeCell").count() > 1               # a notebook, not a text editor
    run_all_cells(page, RUN_TIMEOUT_MS)
    assert output_problems(panel) == []
    assert panel.locator(".jp-OutputArea-output img").count() > 0  # at least one figure
    control_cells = panel.locator(".jp-CodeCell").filter(has=page.locator(CONTROLS))
    if control_cells.count():
        assert name in WIDGET_MOVES, f"{name} has widgets: add the one to move to WIDGET_MOVES"
        cell = control_cells.last
        bring_into_view(cell)
        assert_widget_drives_output(cell.locator(".widget-output"), lambda: WIDGET_MOVES[name](cell))
        assert output_problems(panel) == []
    else:
        assert name not in WIDGET_MOVES, f"{name} has no widget to move"
        bring_into_view(panel.locator(".jp-OutputArea-output img").first)
    save_screenshot(page, REPORTS / f"{name}.png")


@pytest.mark.parametrize(("name", "failure"), [("widget_drives_output.py", None),
                                             ("widget_ignored.py", "did not change the output"),
                                             ("widget_draws_blank.py", r"redrawn \(almost\) blank")])
def test_widget_check_fails_when_the_widget_draws_nothing(name, failure, page, lab):
    panel = open_notebook(page, lab, name)
    run_all_cells(page, RUN_TIMEOUT_MS)
    assert output_problems(panel) == []
    cell = panel.locator(".jp-CodeCell").last
    output, slider = cell.locator(".widget-output"), cell.locator(".widget-slider")
    if failure is None:
        assert_widget_drives_output(output, lambda: move_slider(slider), timeout=15)
    else:
        with pytest.raises(AssertionError, match=failure):
            assert_widget_drives_output(output, lambda: move_slider(slider), timeout=15)


def test_output_check_reports_what_a_widget_logs(page, lab):
    panel = open_notebook(page, lab, "widget_logs.py")
    run_all_cells(page, RUN_TIMEOUT_MS)
    assert output_problems(panel) == []
    cell = panel.locator(".jp-CodeCell").last
    assert_widget_drives_output(cell.locator(".widget-output"), lambda: move_slider(cell.locator(".widget-slider")),
                                timeout=15)
    assert output_problems(panel) == ["1 output(s) no cell took went to the log console (View > Show Log Console)"]


def test_output_check_reports_errors_and_stderr(page, lab):
    panel = open_notebook(page, lab, "fails.py")
    run_all_cells(page, RUN_TIMEOUT_MS)
    problems = output_problems(panel)
    assert len(problems) == 2
    assert "a warning nobody asked for" in problems[0] and "RuntimeError: on purpose" in problems[1]


def test_lab_gives_the_kernels_its_model_and_stops_with_its_server(tmp_path):
    """`--model` reaches the server's environment (kernels inherit it); SIGTERM to `ds4lab
    lab` leaves nothing listening."""
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    env = {**os.environ, "DS4LAB_CACHE": str(tmp_path / "cache"), "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "s"),
           "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "w")}
    server = start_lab(tmp_path, env, tmp_path / "lab.log", "--model", str(model))
    try:
        children = Path(f"/proc/{server.process.pid}/task/{server.process.pid}/children").read_text().split()
        environ = Path(f"/proc/{children[0]}/environ").read_bytes().split(b"\0")
        assert f"DS4LAB_MODEL={model}".encode() in environ
    finally:
        stop_lab(server.process)
    assert server.process.returncode == 0
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", server.port)) != 0
