"""One job per output directory: ``<output>/_job.lock``, held with ``flock`` while a job runs.

The kernel drops the lock when its process ends however it ends (SIGKILL included), so a crashed
job never blocks the rerun; the file's text (pid, host, start time) names the holder for a second
job, which refuses to start.
"""
from __future__ import annotations

import fcntl
import json
import os
import pathlib
import socket
import time

from ..errors import ConfigError

LOCK_FILE = "_job.lock"


class OutputLock:
    """The held lock of one output directory (``release()`` or process exit frees it)."""

    def __init__(self, root: pathlib.Path):
        root.mkdir(parents=True, exist_ok=True)
        self.path = root / LOCK_FILE
        self._fh = open(self.path, "a+")  # noqa: SIM115 - held for the job's lifetime
        try:
            fcntl.flock(self._fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._fh.seek(0)
            holder = self._fh.read().strip() or "unknown"
            self._fh.close()
            raise ConfigError(f"another job is writing to {root} (lock {self.path}: {holder}); wait for it "
                              f"or stop it, or choose another --output") from None
        self._fh.seek(0)
        self._fh.truncate()
        self._fh.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                   "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}) + "\n")
        self._fh.flush()

    def release(self) -> None:
        if not self._fh.closed:
            fcntl.flock(self._fh.fileno(), fcntl.LOCK_UN)
            self._fh.close()
