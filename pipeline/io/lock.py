"""One job per output directory: ``<output>/_job.lock``, held with ``flock`` while a job runs.

The kernel drops the lock when its process ends however it ends (SIGKILL included), so a crashed
job never blocks the rerun; the file's text (pid, host, start time) names the holder for a second
job, which refuses to start. A job that ends (done, failed, stopped) removes the file; one that was
killed leaves it, and the next job takes it over (its holder is gone: the kernel released the lock),
saying so in a log line.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import pathlib
import socket
import time

from ..errors import ConfigError

LOCK_FILE = "_job.lock"
log = logging.getLogger("pipeline.io.lock")


class OutputLock:
    """The held lock of one output directory (``release()`` or process exit frees it)."""

    def __init__(self, root: pathlib.Path):
        root.mkdir(parents=True, exist_ok=True)
        self.path = root / LOCK_FILE
        for _ in range(10):  # the file a holder removed while we waited for it: lock the new one
            self._fh = open(self.path, "a+")  # noqa: SIM115 - held for the job's lifetime
            try:
                fcntl.flock(self._fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self._fh.seek(0)
                holder = self._fh.read().strip() or "unknown"
                self._fh.close()
                raise ConfigError(f"another job is writing to {root} (lock {self.path}: {holder}); wait for "
                                  f"it or stop it, or choose another --output") from None
            if _same_file(self._fh, self.path):
                break
            self._fh.close()
        self._fh.seek(0)
        stale = self._fh.read().strip()
        if stale:
            log.info("taking over %s, left by a job that no longer runs (%s)", self.path, stale)
        self._fh.seek(0)
        self._fh.truncate()
        self._fh.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                   "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}) + "\n")
        self._fh.flush()

    def release(self) -> None:
        """Remove the lock file, then unlock (a job waiting on the old file sees it gone and retries)."""
        if not self._fh.closed:
            try:
                if _same_file(self._fh, self.path):
                    self.path.unlink()
            except OSError:
                pass
            fcntl.flock(self._fh.fileno(), fcntl.LOCK_UN)
            self._fh.close()


def _same_file(fh, path: pathlib.Path) -> bool:
    """Whether ``path`` still names the open file ``fh`` (not removed or replaced since it was opened)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    own = os.fstat(fh.fileno())
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)
