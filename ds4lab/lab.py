"""`ds4lab lab`: JupyterLab on loopback, token required, in the notebooks folder.

The server runs as a child process with its own JupyterLab defaults (in a temporary config
folder named by JUPYTER_CONFIG_PATH, so a user's own settings still apply on top): the
notebooks' `.py` files (jupytext percent format) open as notebooks on a plain click, and
JupyterLab does not fetch news or updates (the machine may have no network). The kernels
inherit `DS4LAB_MODEL`, which the notebooks read for their model; without it each notebook
uses its built-in tiny synthetic model.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from .errors import Ds4labError

HOST = "127.0.0.1"

# JupyterLab setting defaults (labconfig/default_setting_overrides.json), by plugin id.
LAB_SETTINGS = {
    "@jupyterlab/docmanager-extension:plugin": {"defaultViewers": {"python": "Jupytext Notebook"}},
    "@jupyterlab/apputils-extension:notification": {"checkForUpdates": False, "fetchNews": "false"},
}


class LabError(Ds4labError):
    """The JupyterLab server did not start (its exit status or the wait is in the message)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def lab_url(port: int, token: str) -> str:
    return f"http://{HOST}:{port}/lab?token={token}"


def server_command(directory: Path, port: int) -> list[str]:
    """The JupyterLab command line: loopback only, this port or none, no browser opened (and
    root allowed where we run as root, as in containers: the token still guards it)."""
    as_root = ["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []
    return [sys.executable, "-m", "jupyterlab", "--no-browser", f"--ServerApp.ip={HOST}", f"--ServerApp.port={port}",
            "--ServerApp.port_retries=0", f"--ServerApp.root_dir={directory}", *as_root]


def _write_settings(config_dir: Path) -> None:
    labconfig = config_dir / "labconfig"
    labconfig.mkdir()
    (labconfig / "default_setting_overrides.json").write_text(json.dumps(LAB_SETTINGS, indent=1), encoding="utf-8")


def _wait_ready(process: subprocess.Popen, port: int, token: str, timeout: float) -> None:
    """Until the server answers an authenticated /api/status, the process exits, or `timeout` s."""
    deadline = time.monotonic() + timeout
    request = urllib.request.Request(f"http://{HOST}:{port}/api/status", headers={"Authorization": f"token {token}"})
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise LabError(f"JupyterLab exited with status {process.returncode} before serving on port {port}")
        try:
            with urllib.request.urlopen(request, timeout=2):
                return
        except (urllib.error.URLError, OSError):
            time.sleep(0.25)
    raise LabError(f"JupyterLab did not answer on {HOST}:{port} within {timeout:.0f} s")


def _stop(process: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM (the server shuts its kernels down), then SIGKILL after `timeout` s."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def serve(model: str | os.PathLike[str] | None = None, port: int = 0, directory: str | os.PathLike[str] | None = None,
          ready_timeout: float = 120) -> int:
    """Run JupyterLab until interrupted (Ctrl-C or SIGTERM); print its URL once it answers.

    `model`: the GGUF the notebooks use (as DS4LAB_MODEL; default: $DS4LAB_MODEL if set,
    else each notebook's built-in tiny synthetic model).
    `port`: 0 for a free one. `directory`: the folder served (default ds4lab's notebooks).
    Returns the server's exit status (0 when stopped by a signal).
    """
    from .notebooks import NOTEBOOK_DIR

    folder = Path(directory or NOTEBOOK_DIR).resolve()
    if not folder.is_dir():
        raise LabError(f"{folder}: not a folder")
    model = model or os.environ.get("DS4LAB_MODEL")
    model_path = Path(model).resolve() if model else None
    if model_path is not None and not model_path.is_file():
        raise LabError(f"{model_path}: no such model file")
    port = port or free_port()
    token = secrets.token_urlsafe(32)
    signal.signal(signal.SIGTERM, signal.default_int_handler)    # SIGTERM stops the server as Ctrl-C does
    with tempfile.TemporaryDirectory(prefix="ds4lab-lab-") as config_dir:
        _write_settings(Path(config_dir))
        config_path = os.pathsep.join(p for p in (config_dir, os.environ.get("JUPYTER_CONFIG_PATH")) if p)
        env = {**os.environ, "JUPYTER_TOKEN": token, "JUPYTER_CONFIG_PATH": config_path}
        if model_path is not None:
            env["DS4LAB_MODEL"] = str(model_path)
        # Its own session: a terminal's Ctrl-C reaches only this process, which then stops the server.
        process = subprocess.Popen(server_command(folder, port), env=env, start_new_session=True)
        try:
            _wait_ready(process, port, token, ready_timeout)
            print(f"ds4lab lab: {folder}, model {model_path or 'built-in tiny (synthetic)'}", flush=True)
            print(lab_url(port, token), flush=True)
            return process.wait()
        except KeyboardInterrupt:
            return 0
        finally:
            _stop(process)
