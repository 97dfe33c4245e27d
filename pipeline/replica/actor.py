"""One-actor replicas, and the factory that decides what a replica is.

An :class:`ActorReplica` is one Ray actor holding one model copy and one :class:`logitspec.Engine`: a
:class:`StreamingEngineWorker` (the job's default: a threaded actor whose concurrent tasks share one engine
session, :mod:`pipeline.replica.streaming`) or an :class:`EngineWorker` (one task at a time, each decoded to
its end). With ``--tp N`` a replica is instead a :class:`pipeline.replica.tp.TPReplica`: N
actors that together hold one model. Both offer the calls of :class:`pipeline.replica.resources.Replica`, so
the scheduler, the writer and the fault handling do not depend on which one runs.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import ray

from ..spec import GenerationSpec
from . import faults
from .actor_env import actor_runtime_env
from .budget import ReplicaBudget
from .resources import Replica, ReplicaResources, process_memory, resident_bytes

if TYPE_CHECKING:
    from .worker import RowGenerator

log = logging.getLogger("pipeline.replica.actor")


def set_up_job(spec: GenerationSpec, device: str, reference_refs: dict) -> tuple[RowGenerator, dict]:
    """The job's generator in this process: the whole model, the shared reference indexes, one engine."""
    from logitspec import Engine
    from logitspec.models import load_model

    from .startup import set_up

    def load(dtype):
        return load_model(spec.model, dtype=dtype, device=device, trust_remote_code=spec.trust_remote_code)

    return set_up(spec, device, reference_refs, load=load,
                  make_engine=lambda m, t, cfg, history: Engine(m, t, cfg, history=history,
                                                                 runner=faults.runner_for(m, cfg)))


LOADING_NAMESPACE = "logitspec-loading"  # Ray's internal key-value store: actor id -> "loading" marks


def mark_loading(actor_id: str | None) -> None:
    """Say (in Ray's key-value store) that this actor's process runs: it was placed and loads the model."""
    with contextlib.suppress(Exception):  # best effort: only the start-up warning reads it
        from ray.experimental import internal_kv

        internal_kv._internal_kv_put(actor_id, b"1", namespace=LOADING_NAMESPACE)


def is_loading(actor_id: str, forget: bool = False) -> bool | None:
    """Whether the actor marked itself loading (None: the store cannot tell); ``forget`` drops the mark."""
    try:
        from ray.experimental import internal_kv

        if forget:
            internal_kv._internal_kv_del(actor_id, namespace=LOADING_NAMESPACE)
            return None
        return bool(internal_kv._internal_kv_exists(actor_id, namespace=LOADING_NAMESPACE))
    except Exception:  # noqa: BLE001
        return None


class EngineWorker:
    """The actor: sets up one generator in its process, then turns batches of rows into output rows
    with it. What it generates with is its ``setup`` (the job's by default; the evaluation sweep passes
    :func:`pipeline.sweep.replica.set_up_sweep`), so every replica is this actor."""

    def __init__(self, spec, threads: int, use_gpu: bool, reference_refs: dict, setup: Callable = set_up_job):
        """``setup(spec, device, reference_refs) -> (generator, info)``; ``generator(rows, history)``
        returns ``(output rows, batch stats)``."""
        t0 = time.perf_counter()
        mark_loading(ray.get_runtime_context().get_actor_id())  # placed: no start-up warning about resources
        import torch

        torch.set_num_threads(threads)
        t_import = time.perf_counter()
        device = "cuda" if use_gpu and torch.cuda.is_available() else "cpu"
        faults.at_load()  # test-only: a process killed while loading (pipeline.replica.faults)
        self.generator, info = setup(spec, device, reference_refs)
        self._info = {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                      "import_s": t_import - t0, **info, "init_s": time.perf_counter() - t0}
        self.budget = ReplicaBudget(getattr(spec, "method", None), self._info.get("device"))
        self._budget_lock = threading.Lock()

    def info(self) -> dict:
        return {**self._info, "memory": process_memory()}

    def generate(self, rows: list, history: list[list[int]] | None = None) -> tuple[list, dict]:
        """``history``: other replicas' answers (``--share-history``), for the generator's history."""
        faults.at_batch(rows)  # test-only: a row that kills its process (pipeline.replica.faults)
        out, stats = self.generator(rows, history)
        stats["pid"], stats["rss_bytes"] = os.getpid(), resident_bytes()
        self._note_budget(out, stats)
        return out, stats

    def _note_budget(self, out: list, stats: dict) -> None:
        """Tally what the draft budget did on this replica so far (``stats["budget"]``) and log it in
        one line: after the first task, then at most every minute (the last one is the latest)."""
        gen = self.generator
        engine = getattr(gen, "engine", None) or getattr(getattr(gen, "generator", None), "engine", None)
        with self._budget_lock:
            self.budget.add(out, stats.get("engine"), engine)
            if not self.budget.decode_steps:
                return
            stats["budget"] = self.budget.stats()
            if self.budget.due():  # the actor's stderr, which Ray forwards to the driver's log
                print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} pipeline.replica.budget INFO replica pid "
                      f"{os.getpid()}, draft budget: {self.budget.sentence()}", file=sys.stderr, flush=True)


class StreamingEngineWorker(EngineWorker):
    """The actor with its tasks run concurrently (a threaded actor) through one engine session, so
    rows of the next task take the slots the current one frees
    (:class:`pipeline.replica.streaming.StreamingRows`)."""

    concurrent = True  # tasks in flight run together: a death is every one's (pipeline.replica.scheduler)

    def __init__(self, spec, threads: int, use_gpu: bool, reference_refs: dict, setup: Callable = set_up_job):
        from concurrent.futures import ThreadPoolExecutor

        from .streaming import StreamingRows

        # every torch call of the replica (load, warm-up, decoding) on one thread: Ray runs a threaded
        # actor's calls on several threads, and torch's OpenMP pools of several threads compete for
        # the cores (pipeline/streaming.py)
        self._torch_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._on_engine_thread(super().__init__, spec, threads, use_gpu, reference_refs, setup)
        self.generator = StreamingRows(self.generator, run=self._on_engine_thread)

    def _on_engine_thread(self, fn, *args):
        return self._torch_thread.submit(fn, *args).result()


# concurrent calls of a StreamingEngineWorker: the scheduler's tasks in flight (its depth, 2) and info()
STREAM_CONCURRENCY = 4


class ActorReplica:
    """A replica made of one actor (:class:`StreamingEngineWorker` or :class:`EngineWorker`)."""

    def __init__(self, name: str, spec, resources: ReplicaResources, reference_refs: dict,
                 worker: type = EngineWorker, setup: Callable | None = None):
        """``worker``: the actor class (:class:`EngineWorker` or :class:`StreamingEngineWorker`; one whose
        ``concurrent`` is true runs as a threaded actor); ``setup``: what it generates with (None: the
        job's :func:`set_up_job`; the sweep's :func:`pipeline.sweep.replica.set_up_sweep`)."""
        self.name = name
        self.concurrent = getattr(worker, "concurrent", False)
        cls = ray.remote(worker).options(
            max_concurrency=STREAM_CONCURRENCY if self.concurrent else 1,
            num_cpus=resources.num_cpus, num_gpus=resources.num_gpus,
            max_restarts=0, max_task_retries=0,  # the scheduler replaces dead replicas and redoes their rows
            runtime_env=actor_runtime_env(),
        )
        self.actor = cls.remote(spec, resources.threads, resources.num_gpus > 0,
                                {k: (v,) for k, v in reference_refs.items()},
                                **({"setup": setup} if setup else {}))
        self._ready = self.actor.info.remote()

    def ready(self) -> ray.ObjectRef:
        return self._ready

    def submit(self, rows: list, history: list[list[int]] | None = None) -> ray.ObjectRef:
        """``history``: other replicas' answers for this one's history (``--share-history``)."""
        return self.actor.generate.remote(rows, history)

    def info(self) -> ray.ObjectRef:
        return self.actor.info.remote()

    def loading(self) -> bool | None:
        """Whether the actor's process runs (placed, loading the model); False: still waiting to be placed."""
        return is_loading(self.actor._actor_id.hex())

    def kill(self) -> None:
        with contextlib.suppress(Exception):  # already gone
            ray.kill(self.actor, no_restart=True)
        is_loading(self.actor._actor_id.hex(), forget=True)


def make_replica_factory(spec: GenerationSpec, resources: ReplicaResources, reference_refs: dict, tp: int = 1,
                         stream: bool = True):
    """``factory(name) -> Replica``; the one place that decides what a replica is (``--tp`` plugs in
    here; ``stream``: one-actor replicas keep one engine session across tasks, else task by task)."""
    if tp > 1:
        from .tp import make_tp_replica_factory

        return make_tp_replica_factory(spec, resources, reference_refs, tp)
    worker = StreamingEngineWorker if stream else EngineWorker

    def factory(name: str) -> Replica:
        return ActorReplica(name, spec, resources, reference_refs, worker=worker)

    return factory
