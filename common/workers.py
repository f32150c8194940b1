"""One service as N worker processes on one port: the parent binds the socket and supervises, each worker is the
whole service (``run_server``) on that shared socket, and the kernel hands each new connection to one of them.

As gunicorn and uvicorn's own supervisor do it (pre-fork over a shared socket, workers spawned, not forked, so
that none inherits the parent's threads), with what a SpecPrefill gateway needs on top:
  the workers start one after another, each once the one before it is serving: each calibrates its cost models
  on an engine nothing else is timing, as a single gateway does, and the models load one at a time;
  ``/metrics`` is the sum over the workers (prometheus_client's multiprocess mode, in a folder of this run's);
  SIGTERM drains every worker (each finishes what it has in flight: ``common.server``) and the parent exits 0
  when every worker did; a worker that dies while serving is replaced, one that fails to start stops them all.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import Any

from common.options import ServerOptions

logger = logging.getLogger("specprefill")
METRICS_DIR_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client reads it when first imported
START_TIMEOUT_S = 600.0  # a worker that has not started serving by then failed to start
_SPAWN = multiprocessing.get_context("spawn")


def shared_metrics_dir() -> str | None:
    """The folder the workers' metrics are summed from, in a worker of a multi-worker service; else None."""
    return os.environ.get(METRICS_DIR_VARIABLE) or None


def run_workers(
    build: Callable[[Any], Any],
    options: ServerOptions,
    count: int,
    *,
    service: str,
    max_body_bytes: int,
) -> int:
    """Serves ``build(options)`` (a module-level function: each worker calls it) as ``count`` workers on
    ``options.host``/``options.port``; returns the exit status once they have stopped."""
    sock = _bound(options.host, options.port)
    with _metrics_folder():
        supervisor = _Supervisor(build, options, sock, service, max_body_bytes)
        try:
            return supervisor.run(count)
        finally:
            sock.close()


def _bound(host: str, port: int) -> socket.socket:
    """The socket every worker accepts on, listening (IPv6 where ``host`` is an IPv6 address)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=2048)


@contextlib.contextmanager
def _metrics_folder() -> Iterator[str]:
    folder = tempfile.mkdtemp(prefix="specprefill-metrics-")
    previous = os.environ.get(METRICS_DIR_VARIABLE)
    os.environ[METRICS_DIR_VARIABLE] = folder  # the workers inherit it
    try:
        yield folder
    finally:
        if previous is None:
            os.environ.pop(METRICS_DIR_VARIABLE, None)
        else:
            os.environ[METRICS_DIR_VARIABLE] = previous
        shutil.rmtree(folder, ignore_errors=True)


class _Worker:
    def __init__(self, process: BaseProcess, ready: Connection) -> None:
        self.process = process
        self.ready = ready
        self.serving = False


class _Supervisor:
    def __init__(
        self, build: Callable[[Any], Any], options: ServerOptions, sock: socket.socket, service: str, max_body: int
    ) -> None:
        self.build, self.options, self.sock, self.service, self.max_body = build, options, sock, service, max_body
        self.workers: list[_Worker] = []
        self.signals: list[int] = []
        self.failed = False  # a worker did not start

    def run(self, count: int) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._signalled)
        logger.warning("starting %d workers on %s:%d", count, *self.sock.getsockname()[:2])
        for _ in range(count):
            self.workers.append(self._start())
            if not self._until_serving(self.workers[-1]):
                return self._stop()
        logger.warning("%d workers serving (pids %s)", count, ", ".join(str(w.process.pid) for w in self.workers))
        while not self.signals:
            time.sleep(0.2)
            for index, worker in enumerate(self.workers):
                if worker.process.is_alive() or self.signals:
                    continue
                logger.error(
                    "worker %d (pid %s) died (status %s): starting another",
                    index,
                    worker.process.pid,
                    worker.process.exitcode,
                )
                _forget(worker.process.pid)
                self.workers[index] = self._start()
                if not self._until_serving(self.workers[index]):
                    return self._stop()
                logger.warning("worker %d serving again (pid %s)", index, self.workers[index].process.pid)
        return self._stop()

    def _signalled(self, sig: int, frame: FrameType | None) -> None:
        self.signals.append(sig)
        if len(self.signals) > 1:  # a second signal: each worker stops at once (as one server does)
            self._forward(signal.SIGTERM)

    def _start(self) -> _Worker:
        ours, theirs = _SPAWN.Pipe(duplex=False)
        process = _SPAWN.Process(
            target=_serve_one,
            args=(self.build, self.options, self.sock, theirs, self.service, self.max_body),
            daemon=False,
        )
        process.start()
        theirs.close()
        return _Worker(process, ours)

    def _until_serving(self, worker: _Worker) -> bool:
        """Waits for the worker's word that it is serving; False where it ended first or the parent was told
        to stop."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and not self.signals:
            if worker.ready.poll(0.2):
                with contextlib.suppress(EOFError, OSError):
                    worker.ready.recv()
                    worker.serving = True
                    return True
            if not worker.process.is_alive():
                break
        if not self.signals:
            logger.error("a worker did not start (status %s): stopping", worker.process.exitcode)
            self.failed = True
        return False

    def _forward(self, sig: int) -> None:
        for worker in self.workers:
            if worker.process.is_alive() and worker.process.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker.process.pid, sig)

    def _stop(self) -> int:
        """SIGTERM to every worker (each drains), then waits for them: 0 where each one serving exited 0 (one
        still starting when told to stop ends by the signal) and none failed to start."""
        self._forward(signal.SIGTERM)
        deadline = time.monotonic() + self.options.drain_timeout + 15
        for worker in self.workers:
            worker.process.join(max(0.0, deadline - time.monotonic()))
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()
        statuses = [w.process.exitcode for w in self.workers if w.serving]
        if any(s != 0 for s in statuses):
            logger.error("workers exited with %s", statuses)
        return 1 if self.failed or any(s != 0 for s in statuses) else 0


def _forget(pid: int | None) -> None:
    """A dead worker's live gauges leave the sum."""
    folder = shared_metrics_dir()
    if folder is None or pid is None:
        return
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid, folder)  # type: ignore[no-untyped-call]


def _on_parent_death(sig: int) -> None:
    """Linux's ``PR_SET_PDEATHSIG``: ``sig`` to this process when its parent ends (a no-op elsewhere)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG


def _serve_one(
    build: Callable[[Any], Any],
    options: ServerOptions,
    sock: socket.socket,
    ready: Connection,
    service: str,
    max_body_bytes: int,
) -> None:
    """One worker: the service on the shared socket, telling the parent once it serves. In a process group of
    its own (a terminal's Ctrl-C reaches the parent alone, which tells each worker once), and stopped by a
    SIGTERM should the parent die."""
    from common.server import run_server

    os.setpgrp()
    _on_parent_death(signal.SIGTERM)

    def serving() -> None:
        ready.send(os.getpid())
        ready.close()

    run_server(
        build(options), options, service=service, max_body_bytes=max_body_bytes, sockets=[sock], on_serving=serving
    )
