"""What a model replica is: the unit the scheduler sends batches of rows to.

Today a replica is one Ray actor holding one model copy and one :class:`logitspec.Engine`
(:class:`ActorReplica`). A tensor-parallel replica (``--tp N``, later) is a group of N actors that
together hold one model; it only has to offer the same four calls (:class:`Replica`): the scheduler,
the writer and the fault handling do not change.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Protocol

import ray

from .config import GenerationSpec

log = logging.getLogger("pipeline.replica")


@dataclass(frozen=True)
class ReplicaResources:
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    threads: int = 1  # torch intra-op threads in the replica's process(es)


class Replica(Protocol):
    """One model replica (one actor today; a tensor-parallel group later)."""

    name: str

    def ready(self) -> "ray.ObjectRef":
        """Resolves to an info dict (pids, load times, memory) once the replica can take rows; fails if it dies."""

    def submit(self, rows: list[dict]) -> "ray.ObjectRef":
        """Resolves to ``(output rows, batch stats)``; raises ``RayActorError`` if the replica dies."""

    def kill(self) -> None:
        """Stop the replica's process(es) now."""


def _rss() -> dict:
    """Resident memory of this process split into anonymous (private) and shared-memory pages."""
    out = {}
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                k, _, v = line.partition(":")
                if k in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                    out[k] = int(v.split()[0]) * 1024
    except OSError:  # not Linux
        import psutil

        out["VmRSS"] = psutil.Process().memory_info().rss
    return out


class EngineWorker:
    """The actor: loads the model once, attaches the shared reference indexes, generates batches."""

    def __init__(self, spec: GenerationSpec, threads: int, use_gpu: bool, reference_refs: dict):
        t0 = time.perf_counter()
        import torch

        from logitspec import Engine
        from logitspec.index import CorpusIndex
        from logitspec.models import load_model

        from .reference import split_meta
        from .worker import RowGenerator

        torch.set_num_threads(threads)
        t_import = time.perf_counter()
        device = "cuda" if use_gpu and torch.cuda.is_available() else "cpu"
        dtype = {"auto": torch.bfloat16 if device == "cuda" else torch.float32, "float32": torch.float32,
                 "bfloat16": torch.bfloat16, "float16": torch.float16}[spec.dtype]
        model, tokenizer = load_model(spec.model, dtype=dtype, device=device)
        t_load = time.perf_counter()
        references, zero_copy = {}, True
        for name, (ref,) in reference_refs.items():  # wrapped in a 1-tuple so Ray does not resolve it for us
            arrays, _ = split_meta(ray.get(ref))
            # zero-copy: the arrays are read-only views of the node's object store, not private copies
            zero_copy &= all(not a.flags.writeable and not a.flags.owndata for a in arrays.values())
            references[name] = CorpusIndex.from_arrays(arrays)
        t_refs = time.perf_counter()
        engine = Engine(model, tokenizer, spec.spec_config())
        if spec.warmup:  # first forwards allocate; keep that out of the measured generation time
            ids = engine.encode("Hello, world.") if tokenizer is not None else [1, 2, 3]
            engine.generate([ids], max_new_tokens=2)
        t_warm = time.perf_counter()
        self.run = RowGenerator(engine, spec, references)
        params = list(model.parameters()) + list(model.buffers())
        self._info = {
            "pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(), "device": device,
            "dtype": str(dtype).replace("torch.", ""), "threads": torch.get_num_threads(),
            "import_s": t_import - t0, "model_load_s": t_load - t_import, "reference_attach_s": t_refs - t_load,
            "warmup_s": t_warm - t_refs, "init_s": t_warm - t0,
            "model_bytes": int(sum(p.numel() * p.element_size() for p in params)),
            "reference_zero_copy": zero_copy if references else None,
            "reference_names": sorted(references),
        }

    def info(self) -> dict:
        return {**self._info, "memory": _rss()}

    def generate(self, rows: list[dict]) -> tuple[list[dict], dict]:
        out, stats = self.run(rows)
        stats["pid"] = os.getpid()
        return out, stats


class ActorReplica:
    """A replica made of one :class:`EngineWorker` actor."""

    def __init__(self, name: str, spec: GenerationSpec, resources: ReplicaResources, reference_refs: dict):
        self.name = name
        cls = ray.remote(EngineWorker).options(
            num_cpus=resources.num_cpus, num_gpus=resources.num_gpus,
            max_restarts=0, max_task_retries=0,  # the scheduler replaces dead replicas and redoes their rows
        )
        self.actor = cls.remote(spec, resources.threads, resources.num_gpus > 0,
                                {k: (v,) for k, v in reference_refs.items()})
        self._ready = self.actor.info.remote()

    def ready(self) -> "ray.ObjectRef":
        return self._ready

    def submit(self, rows: list[dict]) -> "ray.ObjectRef":
        return self.actor.generate.remote(rows)

    def info(self) -> "ray.ObjectRef":
        return self.actor.info.remote()

    def kill(self) -> None:
        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass


def make_replica_factory(spec: GenerationSpec, resources: ReplicaResources, reference_refs: dict, tp: int = 1):
    """``factory(name) -> Replica``; the one place that decides what a replica is (``--tp`` plugs in here)."""
    if tp > 1:
        from .tp import make_tp_replica_factory

        return make_tp_replica_factory(spec, resources, reference_refs, tp)

    def factory(name: str) -> Replica:
        return ActorReplica(name, spec, resources, reference_refs)

    return factory
