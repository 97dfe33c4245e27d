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
import time

import ray

from ..job.config import GenerationSpec
from . import faults
from .actor_env import actor_runtime_env
from .resources import Replica, ReplicaResources, process_memory

log = logging.getLogger("pipeline.replica.actor")


class EngineWorker:
    """The actor: loads the model once, attaches the shared reference indexes, generates batches."""

    def __init__(self, spec: GenerationSpec, threads: int, use_gpu: bool, reference_refs: dict):
        t0 = time.perf_counter()
        import torch

        from logitspec import Engine
        from logitspec.models import load_model

        from .startup import set_up

        torch.set_num_threads(threads)
        t_import = time.perf_counter()
        device = "cuda" if use_gpu and torch.cuda.is_available() else "cpu"
        def load(dtype):
            faults.at_load()  # test-only: a process killed while loading (pipeline.replica.faults)
            return load_model(spec.model, dtype=dtype, device=device, trust_remote_code=spec.trust_remote_code)

        self.generator, info = set_up(spec, device, reference_refs, load=load,
                                      make_engine=lambda m, t, cfg, history: Engine(m, t, cfg, history=history))
        self._info = {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                      "import_s": t_import - t0, **info, "init_s": time.perf_counter() - t0}

    def info(self) -> dict:
        return {**self._info, "memory": process_memory()}

    def generate(self, rows: list[dict], history: list[list[int]] | None = None) -> tuple[list[dict], dict]:
        """``history``: other replicas' answers (``--share-history``); a generator that takes none (the
        evaluation sweep's) is called without it."""
        faults.at_batch(rows)  # test-only: a row that kills its process (pipeline.replica.faults)
        out, stats = self.generator(rows) if history is None else self.generator(rows, history)
        stats["pid"] = os.getpid()
        return out, stats


class StreamingEngineWorker(EngineWorker):
    """The actor with its tasks run concurrently (a threaded actor) through one engine session, so
    rows of the next task take the slots the current one frees (:class:`pipeline.replica.streaming.StreamingRows`)."""

    concurrent = True  # tasks in flight run together: a death is every one's (pipeline.replica.scheduler)

    def __init__(self, spec: GenerationSpec, threads: int, use_gpu: bool, reference_refs: dict):
        from concurrent.futures import ThreadPoolExecutor

        from .streaming import StreamingRows

        # every torch call of the replica (load, warm-up, decoding) on one thread: Ray runs a threaded
        # actor's calls on several threads, and torch's OpenMP pools of several threads compete for
        # the cores (pipeline/streaming.py)
        self._torch_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._on_engine_thread(super().__init__, spec, threads, use_gpu, reference_refs)
        self.generator = StreamingRows(self.generator, run=self._on_engine_thread)

    def _on_engine_thread(self, fn, *args):
        return self._torch_thread.submit(fn, *args).result()


# concurrent calls of a StreamingEngineWorker: the scheduler's tasks in flight (its depth, 2) and info()
STREAM_CONCURRENCY = 4


class ActorReplica:
    """A replica made of one actor (:class:`StreamingEngineWorker` or :class:`EngineWorker`)."""

    def __init__(self, name: str, spec: GenerationSpec, resources: ReplicaResources, reference_refs: dict,
                 worker: type = EngineWorker):
        """``worker``: the actor class, built as ``worker(spec, threads, use_gpu, reference_refs)`` with
        ``info()`` and ``generate(rows)`` (the evaluation sweep's :class:`pipeline.sweep.replica.EvalWorker`);
        one whose ``concurrent`` is true runs as a threaded actor."""
        self.name = name
        self.concurrent = getattr(worker, "concurrent", False)
        cls = ray.remote(worker).options(
            max_concurrency=STREAM_CONCURRENCY if self.concurrent else 1,
            num_cpus=resources.num_cpus, num_gpus=resources.num_gpus,
            max_restarts=0, max_task_retries=0,  # the scheduler replaces dead replicas and redoes their rows
            runtime_env=actor_runtime_env(),
        )
        self.actor = cls.remote(spec, resources.threads, resources.num_gpus > 0,
                                {k: (v,) for k, v in reference_refs.items()})
        self._ready = self.actor.info.remote()

    def ready(self) -> ray.ObjectRef:
        return self._ready

    def submit(self, rows: list[dict], history: list[list[int]] | None = None) -> ray.ObjectRef:
        """``history``: other replicas' answers for this one's history (``--share-history``)."""
        return self.actor.generate.remote(rows, history)

    def info(self) -> ray.ObjectRef:
        return self.actor.info.remote()

    def kill(self) -> None:
        with contextlib.suppress(Exception):  # already gone
            ray.kill(self.actor, no_restart=True)


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
