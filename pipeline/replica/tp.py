"""Tensor-parallel replicas (``--tp N``): one model sharded over N Ray actors that decode in lockstep.

A :class:`TPReplica` is N :class:`TPRank` actors in one STRICT_PACK placement group (one node), one
``torch.distributed`` group (gloo on CPU, NCCL on GPUs), each holding its DeepSpeed AutoTP shard and running
the same :class:`logitspec.Engine` on the same rows (SPMD, :mod:`logitspec.engine.tensor_parallel`). The
driver sends
every batch to every rank; only rank 0's answer is returned. It offers the calls of
:class:`pipeline.replica.resources.Replica`, as :class:`pipeline.replica.actor.ActorReplica` does, so the
scheduler, the writer and the fault handling (requeue, replace, exactly-once) are unchanged. Each rank sets
itself up with :func:`pipeline.replica.startup.set_up`, as a one-actor replica does.

Failure model: a group is all or nothing. A rank that dies makes its peers exit (their
:class:`~logitspec.engine.peer_watchdog.PeerWatchdog`; otherwise they would spin forever in the shm
all-reduce),
so rank 0's pending calls fail with ``RayActorError`` and the scheduler kills the group and redoes its
batches on a new one. An exception inside one rank's engine would leave its peers waiting in a
collective, so a rank whose engine raises exits too; ranks whose outputs differ raise
:class:`~logitspec.engine.tensor_parallel.RanksDiverged` together.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ..errors import ConfigError
from ..spec import GenerationSpec
from .actor_env import actor_runtime_env
from .resources import ReplicaResources, process_memory

log = logging.getLogger("pipeline.replica.tp")


class TPRank:
    """One rank's actor. ``__init__`` is light; :meth:`setup` joins the group and loads the shard."""

    def __init__(self):
        self.rank = None
        self.generator = None
        self.watchdog = None
        self._info: dict = {}

    def hello(self) -> dict:
        """Where this rank runs (before anything is loaded): pid, node, GPUs, a free port."""
        from logitspec.engine.tensor_parallel import free_port

        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()], "port": free_port()}

    def setup(self, rank: int, world: int, spec: GenerationSpec, threads: int, use_gpu: bool,
              reference_refs: dict, *hellos: dict) -> dict:
        """Join the group and load this rank's shard; rank 0 returns the group's info (every rank's)."""
        try:
            return self._setup(rank, world, spec, threads, use_gpu, reference_refs, hellos)
        except BaseException:
            # Peers may wait in a collective for this rank forever: leave, shortly after the error
            # has gone back to the caller, so their watchdogs end them too.
            log.exception("rank %d failed to start", rank)
            threading.Timer(2.0, os._exit, args=(71,)).start()
            raise

    def _setup(self, rank, world, spec, threads, use_gpu, reference_refs, hellos) -> dict:
        t0 = time.perf_counter()
        nodes = {h["node_id"] for h in hellos}
        if len(nodes) != 1:  # STRICT_PACK guarantees it; the watchdog and the shm all-reduce need it
            raise RuntimeError(f"tensor-parallel ranks are spread over {len(nodes)} nodes")
        from logitspec.engine.peer_watchdog import PeerWatchdog

        self.rank = rank
        self.watchdog = PeerWatchdog([h["pid"] for h in hellos])
        device, backend = "cpu", None
        if use_gpu:
            # Every rank sees the group's GPUs (NCCL's peer-to-peer paths need to see them) and uses
            # its own. Ranks sharing one GPU (fractional --gpus-per-actor, e.g. a TP check on a
            # 1-GPU machine) must use gloo: NCCL refuses two ranks on one device.
            ids = [h["gpu_ids"][0] if h["gpu_ids"] else None for h in hellos]
            if None in ids:
                raise RuntimeError(f"GPU ranks without a GPU: {ids}")
            visible = list(dict.fromkeys(ids))
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(visible)
            device = f"cuda:{visible.index(ids[rank])}"
            backend = "nccl" if len(visible) == len(ids) else "gloo"
        import torch

        from logitspec.engine.tensor_parallel import init_rank, load_tp_model, make_engine

        from .startup import set_up

        t_import = time.perf_counter()
        init_rank(rank, world, hellos[0]["port"], device=device, backend=backend, threads=threads)
        t_group = time.perf_counter()
        loaded = {}

        def load(dtype):
            model, tokenizer, loaded["consensus"] = load_tp_model(
                spec.model, world, dtype=dtype, device=device, trust_remote_code=spec.trust_remote_code)
            return model, tokenizer

        self.generator, setup = set_up(
            spec, device, reference_refs, load=load,
            make_engine=lambda *a: _FailStop(make_engine(*a, consensus=loaded["consensus"]), rank))
        info = {"rank": rank, "pid": os.getpid(), "node_id": hellos[rank]["node_id"],
                "import_s": t_import - t0,
                "group_init_s": t_group - t_import, **setup, "init_s": time.perf_counter() - t0,
                "memory": process_memory()}
        self._info = {k: v for k, v in info.items() if k != "memory"}
        infos: list = [None] * world
        torch.distributed.all_gather_object(infos, info)
        return {**infos[0], "tp": world, "pids": [i["pid"] for i in infos], "ranks": infos,
                "model_load_s": max(i["model_load_s"] for i in infos)}

    def generate(self, rows: list, history: list[list[int]] | None = None) -> tuple[list | None, dict]:
        """Every rank decodes the batch (after adding ``history``, the same on every rank); rank 0
        returns the rows, the others only their digest."""
        from logitspec.engine.tensor_parallel import check_agreement, decisions_digest

        out, stats = self.generator(rows, history)
        stats["pid"] = os.getpid()
        # raises on every rank alike
        stats["digests"] = check_agreement(decisions_digest(r.as_dict() for r in out))
        return (out, stats) if self.rank == 0 else (None, stats)

    def info(self) -> dict:
        return {**self._info, "memory": process_memory()}


class _FailStop:
    """The engine of one rank, made fail-stop: an exception inside a forward may be one-sided (e.g.
    out of memory on one rank) and would leave the peers in a collective, so the rank exits instead
    and the group is replaced (the scheduler redoes its rows; a row that keeps killing groups ends
    as an error row)."""

    def __init__(self, engine, rank: int):
        self._engine = engine
        self._rank = rank

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def _fail_stop(self, call, *args, **kwargs):
        try:
            return call(*args, **kwargs)
        except BaseException:
            log.exception("rank %d: engine failed mid-batch; ending the group", self._rank)
            os._exit(72)

    def run(self, *args, **kwargs):
        return self._fail_stop(self._engine.run, *args, **kwargs)

    def generate(self, *args, **kwargs):
        return self._fail_stop(self._engine.generate, *args, **kwargs)


@ray.remote(num_cpus=0)
def _group_ready(refs: list) -> dict:
    """Rank 0's info once every rank is up; else the most telling error (a rank's own exception rather
    than a peer's "actor died", which the watchdog causes)."""
    errors, infos = [], []
    for ref in refs:
        try:
            infos.append(ray.get(ref))
        except Exception as e:  # noqa: BLE001
            errors.append(e)
    if errors:
        from ray.exceptions import RayActorError

        raise next((e for e in errors if not isinstance(e, RayActorError)), errors[0])
    return infos[0]


@ray.remote(num_cpus=0)
def _group_info(refs: list) -> dict:
    infos = ray.get(refs)
    return {**infos[0], "tp": len(infos), "pids": [i.get("pid") for i in infos], "ranks": infos}


class TPReplica:
    """A replica made of ``tp`` :class:`TPRank` actors in one STRICT_PACK placement group."""

    def __init__(self, name: str, spec: GenerationSpec, resources: ReplicaResources, reference_refs: dict,
                 tp: int):
        if tp < 2:
            raise ValueError("a tensor-parallel replica needs tp >= 2")
        self.name = name
        self.concurrent = False  # its tasks run one after another
        self.tp = tp
        bundle = {"CPU": resources.num_cpus}
        if resources.num_gpus:
            bundle["GPU"] = resources.num_gpus
        self.pg = placement_group([dict(bundle) for _ in range(tp)], strategy="STRICT_PACK",
                                  name=f"{name}-tp")
        self.ranks = [
            ray.remote(TPRank).options(
                num_cpus=resources.num_cpus, num_gpus=resources.num_gpus,
                max_restarts=0, max_task_retries=0,  # the scheduler replaces the whole group
                runtime_env=actor_runtime_env(),
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
            ).remote()
            for i in range(tp)]
        hellos = [a.hello.remote() for a in self.ranks]  # top-level refs: resolved before setup runs
        refs = {k: (v,) for k, v in reference_refs.items()}
        setups = [a.setup.remote(i, tp, spec, resources.threads, resources.num_gpus > 0, refs, *hellos)
                  for i, a in enumerate(self.ranks)]
        self._ready = _group_ready.remote(setups)

    def ready(self) -> ray.ObjectRef:
        return self._ready

    def submit(self, rows: list, history: list[list[int]] | None = None) -> ray.ObjectRef:
        refs = [a.generate.remote(rows, history) for a in self.ranks]
        return refs[0]  # a peer's death ends rank 0 too (watchdog), so this ref fails with it

    def info(self) -> ray.ObjectRef:
        """Rank 0's info (``memory``: its own) with ``ranks``: every rank's, memory included."""
        return _group_info.remote([a.info.remote() for a in self.ranks])

    def kill(self) -> None:
        for a in self.ranks:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(a, no_restart=True)
        with contextlib.suppress(Exception):
            remove_placement_group(self.pg)


def check_fits(replicas: int, tp: int, cpus_per_rank: float, gpus_per_rank: float = 0.0,
               nodes: list[dict] | None = None) -> int:
    """Raise :class:`ConfigError` unless ``replicas`` groups of ``tp`` ranks fit the cluster now, each
    group on one node; returns how many groups fit. ``nodes``: ``ray.nodes()`` (default: ask Ray)."""
    nodes = [n for n in (ray.nodes() if nodes is None else nodes) if n.get("Alive", True)]
    fits, shapes = 0, []
    for n in nodes:
        res = n.get("Resources", {})
        cpu, gpu = res.get("CPU", 0.0), res.get("GPU", 0.0)
        shapes.append(f"{cpu:g} CPU" + (f" + {gpu:g} GPU" if gpu else ""))
        k = int(cpu // (tp * cpus_per_rank) + 1e-9) if cpus_per_rank > 0 else 1 << 30
        if gpus_per_rank > 0:
            k = min(k, int(gpu // (tp * gpus_per_rank) + 1e-9))
        fits += k
    if fits < replicas:
        need = f"{tp * cpus_per_rank:g} CPU" + (f" + {tp * gpus_per_rank:g} GPU" if gpus_per_rank else "")
        raise ConfigError(
            f"--actors {replicas} x --tp {tp} does not fit this cluster: each replica is {tp} actors on ONE "
            f"node ({need} there: {cpus_per_rank:g} CPU"
            + (f" + {gpus_per_rank:g} GPU" if gpus_per_rank else "")
            + f" per rank), and the nodes ({'; '.join(shapes) or 'none'}) hold {fits} such replica(s). "
            "Lower --actors or --tp, give each rank less (--cpus-per-actor), or add nodes.")
    return fits


def make_tp_replica_factory(spec: GenerationSpec, resources: ReplicaResources, reference_refs: dict, tp: int):
    """``factory(name) -> TPReplica`` (for :class:`pipeline.replica.scheduler.Scheduler`)."""

    def factory(name: str) -> TPReplica:
        return TPReplica(name, spec, resources, reference_refs, tp)

    return factory
