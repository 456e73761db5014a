"""The sandbox starts for a non-root user wherever the interpreter lives: a venv under /tmp (which the
sandbox's own /tmp would hide), under the user's home, under /opt, with a symlinked or a copied
interpreter (a copy outside /usr is how pyenv and conda installs look to the sandbox), on both isolation
paths."""

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from sandbox_users import TEST_UID, can_switch_user, run_as_user, stage

from poise_trl.core import sandbox

WORKING = [isolation for isolation in ("bwrap", "unshare") if sandbox.isolation_problem(isolation) is None]

_DRIVER = """
import json, sys
from poise_trl.core import sandbox
report = {}
for isolation in ("bwrap", "unshare"):
    try:
        execution = sandbox.run_program("import sys\\nprint(sys.executable)\\n", mode=isolation)
        check = lambda f: None if f(1) == 2 else 1 / 0
        verdict = sandbox.judge_many([("def f(x):\\n    return x + 1\\n", "f", check)], mode=isolation)[0]
        report[isolation] = [execution.stdout.strip(), verdict]
    except sandbox.SandboxUnavailable as refused:
        report[isolation] = str(refused)
print(json.dumps(report))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="makes folders under /home and /opt, switches user: root only")
@pytest.mark.skipif(not WORKING or can_switch_user() is not None, reason="no isolation, or no user switch")
@pytest.mark.parametrize(("parent", "copies"),
                         [("/tmp", False), ("/tmp", True), ("/home", True), ("/opt", False)])
def test_a_venv_anywhere_runs_sandboxed_for_a_non_root_user(parent, copies):
    place = Path(tempfile.mkdtemp(prefix="poise-interpreter-", dir=parent))
    staging = Path(tempfile.mkdtemp(prefix="poise-user-"))
    try:
        venv = place / "venv"
        copied = ["--copies"] if copies else []
        made = subprocess.run(["/usr/bin/python3", "-m", "venv", "--without-pip", *copied, str(venv)],
                              capture_output=True, text=True)
        if made.returncode != 0:
            pytest.skip(f"the system python3 cannot make a venv: {made.stderr.strip()[-200:]}")
        subprocess.run(["chown", "-R", f"{TEST_UID}:{TEST_UID}", str(place)], check=True)
        place.chmod(0o755)
        stage(staging)
        run = run_as_user(str(venv / "bin" / "python3"), _DRIVER, staging, home=place)
    finally:
        shutil.rmtree(place, ignore_errors=True)
        shutil.rmtree(staging, ignore_errors=True)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout.splitlines()[-1])
    for isolation in WORKING:
        assert report[isolation] == [str(venv / "bin" / "python3"), "passed"], report
