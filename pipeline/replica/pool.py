"""Ray and a pool of replicas: join (or start) Ray, size the replicas' resources, and drive them with
the :class:`~pipeline.replica.scheduler.Scheduler` until every batch is done; used by the job and the sweep.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import pathlib
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from .resources import resident_bytes

log = logging.getLogger("pipeline.replica.pool")

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
FINAL_INFO_TIMEOUT_S = 30.0  # how long the end of a job waits for the replicas' last memory report


@dataclass
class RunRecord:
    """What running the replicas leaves for the summary."""

    ray_info: dict | None = None
    stats: Any = None  # pipeline.replica.scheduler.SchedulerStats, once the scheduler exists
    # each replica alive at the end: its info then ({"name", "missing": why} if it did not answer)
    final: list = field(default_factory=list)
    batch_steps: int = 0  # the replicas' decoding forwards, summed over the tasks they returned
    active_sum: float = 0.0  # ... and the rows those forwards decoded
    out_of_memory: int = 0  # batches that ran out of memory in a replica and were split and redone there
    shared_history: dict | None = None  # SharedHistory.stats with --share-history (answers in and out)
    # resident bytes through the run: each replica process's after each task it returned (by pid), and
    # the driver's as each task came back
    rss: dict = field(default_factory=dict)
    driver_rss: list = field(default_factory=list)

    def add_memory(self, pid: int | None, rss: int | None) -> None:
        """A task's replica resident bytes (``pid``'s after it) and the driver's now."""
        if pid is not None and rss is not None:
            self.rss.setdefault(pid, []).append(rss)
        driver = resident_bytes()
        if driver is not None:
            self.driver_rss.append(driver)

    def add_engine(self, engine: dict) -> None:
        """Count a task's engine stats (``batch_steps``, ``mean_active``, ``out_of_memory``)."""
        self.out_of_memory += engine.get("out_of_memory") or 0
        steps = engine.get("batch_steps") or 0
        self.batch_steps += steps
        self.active_sum += engine.get("active_sum", steps * (engine.get("mean_active") or 0.0))


def connect_ray(cfg) -> dict:
    """Join ``--address`` / ``$RAY_ADDRESS`` (set under ``ray job submit``), else start a local Ray."""
    import ray

    if ray.is_initialized():
        return {"started_here": False, "reused_session": True}
    if not sys.stderr.isatty():  # actors' lines forwarded into a log file: no ANSI colour in their prefix
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    address = cfg.address or os.environ.get("RAY_ADDRESS")
    if address:
        try:
            ray.init(address=address, logging_level=logging.WARNING)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise ConfigError(f"cannot join the Ray cluster at {address!r}: {e}") from None
        return {"started_here": False, "address": address}
    # Local Ray: its workers inherit this environment; make this checkout importable in them even
    # when the project is not pip-installed.
    paths = [str(REPO_ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    # Ray runs workers at nice 15 by default, below every other process of a shared machine, though
    # the actors do all of this job's work. A local Ray is ours: nice 0 (unless set by the user).
    os.environ.setdefault("RAY_worker_niceness", "0")
    with quiet_token_auth_notice():
        ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False,
                 logging_level=logging.WARNING)
    return {"started_here": True, "address": "local"}


TOKEN_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"


@contextlib.contextmanager
def quiet_token_auth_notice():
    """Drop Ray's (2.5x) "Token authentication is enabled for this Ray cluster" WARNING, which a new local
    cluster logs on every run when ``RAY_AUTH_MODE`` is unset (Ray turns token auth on; nothing to do
    about it here). Only that message: any other warning still shows. (Setting ``RAY_AUTH_MODE=token``
    instead would also silence it, but Ray reads the mode when it is imported: setting it later broke the
    cluster's start here.)"""
    def drop(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled")

    logger = logging.getLogger(TOKEN_AUTH_LOGGER)
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def replica_resources(cfg, started_here: bool):
    import ray

    from .resources import ReplicaResources

    total = ray.cluster_resources()
    cpus = cfg.cpus_per_actor
    if cpus is None:
        # a local Ray is ours: share its CPUs among the actors; on a cluster one CPU per actor
        cpus = max(total.get("CPU", 1.0) / (cfg.actors * cfg.tp), 0.01) if started_here else 1.0
        cpus = math.floor(cpus * 100) / 100
    threads = cfg.threads_per_actor or max(1, int(cpus))  # the CPUs Ray reserves for the actor
    if cfg.gpus_per_actor > total.get("GPU", 0.0):
        raise ConfigError(f"--gpus-per-actor {cfg.gpus_per_actor} but the Ray cluster has "
                          f"{total.get('GPU', 0.0):g} GPU(s)")
    if cpus > total.get("CPU", 0.0):
        raise ConfigError(f"--cpus-per-actor {cpus} but the Ray cluster has {total.get('CPU', 0.0):g} CPU(s)")
    if cfg.tp > 1:  # every replica's N shards must fit on one node
        from .tp import check_fits

        check_fits(cfg.actors, cfg.tp, cpus, cfg.gpus_per_actor)
    return ReplicaResources(num_cpus=cpus, num_gpus=cfg.gpus_per_actor, threads=threads)


@contextlib.contextmanager
def stop_on_signals(sched):
    """SIGINT/SIGTERM ask the scheduler to stop after its current (1 s) wait, so the job kills its
    actors and writes a summary. Raising from the handler instead can leave the driver stuck inside
    ``ray.wait`` (seen with Ray 2.60 on Ctrl-C). A second signal exits at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        if sched.stop_requested:
            os._exit(128 + signum)
        sched.stop_requested = f"stopped by {signal.Signals(signum).name}"
        log.warning("%s: stopping after the current wait (again to exit at once); rerun to resume",
                    signal.Signals(signum).name)

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def drive_replicas(factory: Callable, actors: int, batches, sink, record: RunRecord,
                   on_event: Callable | None,
                   **scheduler_options) -> None:
    """Run a :class:`~pipeline.replica.scheduler.Scheduler` over ``batches`` with ``actors`` replicas from
    ``factory``, results and failures going to ``sink`` (``result``, ``failed``, ``tick``); stops
    cleanly on SIGINT/SIGTERM, records the scheduler's stats and the replicas' final infos in
    ``record``, and kills every replica it made, also on failure."""
    from .scheduler import Scheduler

    made: list = []

    def tracking_factory(name):
        made.append(factory(name))
        return made[-1]

    sched = Scheduler(tracking_factory, actors, batches, sink.result, sink.failed, on_event=on_event,
                      on_tick=sink.tick, **scheduler_options)
    record.stats = sched.stats
    try:
        with stop_on_signals(sched):
            sched.run()
        record.final = final_infos(sched.slots)
    finally:
        for rep in made:
            rep.kill()


def final_infos(slots: dict, timeout_s: float = FINAL_INFO_TIMEOUT_S) -> list[dict]:
    """The info (memory now) of every replica that is ready, asked after the last row was written.

    Best effort: it describes the run, it decides nothing. A replica that died after its last batch,
    or that does not answer within ``timeout_s``, is reported as ``{"name", "pid", "node_id", "missing":
    why}`` instead of failing a job whose rows are all written."""
    import ray

    asked = []
    for name, slot in slots.items():
        if slot.ready:
            try:
                asked.append((name, slot, slot.replica.info()))
            except Exception as e:  # noqa: BLE001 - a replica whose handle is gone
                asked.append((name, slot, e))
    pending = [ref for _, _, ref in asked if not isinstance(ref, BaseException)]
    if pending:
        ray.wait(pending, num_returns=len(pending), timeout=timeout_s)
    out = []
    for name, slot, ref in asked:
        try:
            if isinstance(ref, BaseException):
                raise ref
            out.append({**ray.get(ref, timeout=0), "name": name})
        except Exception as e:  # noqa: BLE001 - dead (RayActorError), or no answer in time (GetTimeoutError)
            why = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            log.warning("%s: no memory report at the end (%s); the summary lists it as not measured", name,
                        why)
            out.append({"name": name, "pid": slot.info.get("pid"), "node_id": slot.info.get("node_id"),
                        "missing": why})
    return out
