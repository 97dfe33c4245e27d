"""Ends this process as soon as a peer process of its tensor-parallel group dies (:class:`PeerWatchdog`)."""
from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Callable, Iterable

log = logging.getLogger("logitspec.engine.tensor_parallel")


class PeerWatchdog:
    """Ends this process as soon as any peer process dies.

    A rank whose peer died would otherwise wait forever: DeepSpeed's CPU shm all-reduce spins on
    shared flags with no timeout. Exiting turns "one rank died" into "the group died", which is what
    the scheduler knows how to handle. Peers must be on this host (a tensor-parallel group is packed
    onto one node). Uses pidfds where the kernel has them (no pid-reuse race), else polls.
    """

    def __init__(self, pids: Iterable[int], on_death: Callable[[int], None] | None = None,
                 poll_s: float = 0.5):
        self.pids = [int(p) for p in pids if int(p) != os.getpid()]
        self.on_death = on_death or _exit_now
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._fds: dict[int, int] = {}
        for p in self.pids:
            try:
                self._fds[p] = os.pidfd_open(p)
            except (AttributeError, OSError):  # no pidfd support, or already gone (seen by _alive)
                pass
        self._thread = threading.Thread(target=self._run, name="tp-peer-watchdog", daemon=True)
        self._thread.start()

    def _alive(self, pid: int) -> bool:
        fd = self._fds.get(pid)
        if fd is not None:
            import select

            r, _, _ = select.select([fd], [], [], 0)
            return not r  # a pidfd turns readable when its process exits
        try:
            with open(f"/proc/{pid}/stat") as fh:
                return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except (OSError, IndexError):
            return False

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            for p in self.pids:
                if not self._alive(p):
                    self.on_death(p)
                    return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.poll_s + 1)
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()


def _exit_now(pid: int) -> None:
    log.error("tensor-parallel peer process %d died; ending this rank (pid %d) too", pid, os.getpid())
    for h in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            h.flush()
    os._exit(70)
