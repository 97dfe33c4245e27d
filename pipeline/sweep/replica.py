"""The sweep's replicas: the job's actor holding one model and one engine per configuration of the grid.

:func:`make_engines` is the one place that builds the engines of a replica; they share one prefix
cache (``--prefix-cache-gb``), so each row is prefilled once for all configurations.
"""
from __future__ import annotations

import time

from ..replica.actor import ActorReplica
from ..replica.resources import ReplicaResources
from .config import EvalConfig
from .generator import SweepGenerator


def make_engines(model, tokenizer, cfg: EvalConfig) -> dict:
    """``{config name: Engine}``, every engine over the same ``model`` (its weights are loaded once)."""
    from logitspec import Engine
    from logitspec.worker.prefix_cache import PrefixCache

    # what every engine gets: one prefix cache, so a row is prefilled once for all configurations
    cache_bytes = int(cfg.prefix_cache_gb * 2**30)
    shared: dict = {"prefix_cache": PrefixCache(cache_bytes)} if cache_bytes > 0 else {}
    engines = {}
    for c in cfg.configs:
        chunk = {"prefill_chunk": c.prefill_chunk} if c.prefill_chunk else {}
        engines[c.name] = Engine(model, tokenizer, c.spec_config(cfg.max_batch_size), **chunk, **shared)
    return engines


def set_up_sweep(cfg: EvalConfig, device: str, reference_refs: dict) -> tuple[SweepGenerator, dict]:
    """The sweep's generator in a replica's process (the ``setup`` of the job's
    :class:`~pipeline.replica.actor.EngineWorker`): the model loaded once, an engine per configuration
    of the grid, each warmed up. The sweep uses no reference indexes (``reference_refs`` is empty)."""
    import torch

    from logitspec.models import load_model

    from ..replica.startup import model_memory, torch_dtype, warm_up

    t0 = time.perf_counter()
    dtype = torch_dtype(cfg.dtype, device)
    model, tokenizer = load_model(cfg.model, dtype=dtype, device=device,
                                  trust_remote_code=cfg.trust_remote_code)
    t_load = time.perf_counter()
    engines = make_engines(model, tokenizer, cfg)
    if cfg.warmup:
        for engine in engines.values():
            warm_up(engine, tokenizer)
    info = {"device": device, "dtype": str(dtype).replace("torch.", ""), "threads": torch.get_num_threads(),
            "model_load_s": t_load - t0, "warmup_s": time.perf_counter() - t_load, **model_memory(model)}
    return SweepGenerator(engines, {c.name: c for c in cfg.configs}), info


def make_eval_replica_factory(cfg: EvalConfig, resources: ReplicaResources):
    """``factory(name) -> Replica`` for the scheduler: the job's one-actor replica, set up by
    :func:`set_up_sweep`."""

    def factory(name: str) -> ActorReplica:
        return ActorReplica(name, cfg, resources, {}, setup=set_up_sweep)

    return factory
