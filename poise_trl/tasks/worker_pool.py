"""Grading in persistent worker processes that can be killed: a verifier stuck in one C-level operation
cannot be interrupted inside a thread, but its process can.

A `WorkerPool` serves one grading function (`module:function`, called as `function(item, timeout_seconds)`);
an overrunning item gets the `overrun` result and its worker is replaced. Workers are fresh interpreters
(`python -c`): multiprocessing's spawn would re-run a caller's main script that has no `__main__` guard.
"""

from __future__ import annotations

import atexit
import importlib
import os
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection

PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def serve(target: str, warm_up: list) -> None:
    """Worker loop (`python -c`, see `Worker`): grade the `warm_up` items first, so that first-use
    initialisation (sympy's, up to 2 s on a busy machine) is not on a grade's clock; then receive
    `(items, timeout_seconds)` on stdin and send back one result per item on the original stdout."""
    requests = Connection(os.dup(0), writable=False)
    replies = Connection(os.dup(1), readable=False)
    os.dup2(2, 1)  # a stray print from a library must not corrupt the replies
    module, _, function = target.partition(":")
    grade = getattr(importlib.import_module(module), function)
    for item, timeout_seconds in warm_up:
        grade(item, timeout_seconds)
    replies.send("ready")
    while True:
        try:
            items, timeout_seconds = requests.recv()
        except (EOFError, OSError):
            return
        for item in items:
            replies.send(grade(item, timeout_seconds))


class Worker:
    """One grading process serving `target`."""

    START_TIMEOUT_S = 120.0  # a cold start imports sympy and math-verify: seconds on a busy machine

    def __init__(self, target: str, warm_up: list):
        python_path = os.pathsep.join(filter(None, [PACKAGE_PARENT, os.environ.get("PYTHONPATH")]))
        self.process = subprocess.Popen(
            [sys.executable, "-c", f"from {__name__} import serve; serve({target!r}, {warm_up!r})"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": python_path},
            start_new_session=True,  # Ctrl-C in the terminal is for the trainer, which then ends us
        )
        self.requests = Connection(os.dup(self.process.stdin.fileno()), readable=False)
        self.replies = Connection(os.dup(self.process.stdout.fileno()), writable=False)
        self.process.stdin.close()
        self.process.stdout.close()
        self.ready = False
        self.owner = os.getpid()
        _LIVE_WORKERS.add(self)

    def wait_ready(self) -> None:
        if not self.ready:
            if not self.replies.poll(self.START_TIMEOUT_S) or self.replies.recv() != "ready":
                raise OSError("the grading worker did not start")
            self.ready = True

    def kill(self) -> None:
        _LIVE_WORKERS.discard(self)
        self.process.kill()
        self.process.wait()
        self.requests.close()
        self.replies.close()


# An idle worker exits when our end of its pipe closes; a busy one (a stuck grade) must be killed, or it
# would grind on after we exit.
_LIVE_WORKERS: weakref.WeakSet[Worker] = weakref.WeakSet()


@atexit.register
def _kill_workers() -> None:
    for worker in list(_LIVE_WORKERS):
        if worker.owner == os.getpid():  # a forked child exiting must not kill its parent's workers
            worker.kill()


class WorkerPool:
    """Idle workers of one grading function; a caller takes (or starts) one: threads never wait on each other.

    One spare is kept starting, so a killed worker's replacement is ready at once. `warm_up` items must be
    plain literals: they are written into the worker's command line.
    """

    def __init__(self, target: str, warm_up: Sequence = ()):
        self.target = target
        self.warm_up = list(warm_up)
        self._lock = threading.Lock()
        self._idle: list[Worker] = []
        self._spare: Worker | None = None
        self._pid = os.getpid()
        self._failed = False  # a worker could not start here: don't pay for trying again at every grade

    def _start(self) -> Worker:
        return Worker(self.target, self.warm_up)

    def acquire(self) -> Worker:
        with self._lock:
            if self._pid != os.getpid():  # forked: the inherited workers belong to the parent
                self._idle, self._spare, self._pid = [], None, os.getpid()
            if self._failed:
                raise OSError("no grading worker in this process")
            worker = None
            while self._idle and worker is None:
                worker = self._idle.pop()
                if worker.process.poll() is not None:  # died on its own
                    worker.kill()
                    worker = None
            if worker is None:
                try:
                    worker, self._spare = self._spare or self._start(), self._start()
                except OSError:
                    self._failed = True
                    raise
        try:
            worker.wait_ready()
        except (OSError, EOFError):
            worker.kill()
            self._failed = True
            raise OSError("the grading worker did not start") from None
        return worker

    def release(self, worker: Worker) -> None:
        with self._lock:
            if self._pid == os.getpid():
                self._idle.append(worker)


def grade_in_workers(pool: WorkerPool, items: Sequence, timeout_seconds: float, overrun, here: Callable) -> list:
    """One result per item, graded by `pool`'s function in one round trip to a worker; `overrun` for an item
    that took longer than `timeout_seconds` (its worker killed); `here(item)` in this process for the items
    left when no worker can start."""
    results: list = []
    pending = list(items)
    while pending:
        try:
            worker = pool.acquire()
        except OSError:
            return results + [here(item) for item in pending]
        done = 0
        try:
            worker.requests.send((pending, timeout_seconds))
            for _ in pending:
                if not worker.replies.poll(timeout_seconds):
                    raise TimeoutError
                results.append(worker.replies.recv())
                done += 1
        except (TimeoutError, EOFError, OSError):  # stuck (or dead): the item in hand gets `overrun`
            worker.kill()
            results.append(overrun)
            pending = pending[done + 1 :]
            continue
        pool.release(worker)
        pending = []
    return results
