"""The sweep's actor: one model, one engine per configuration of the grid.

:func:`make_engines` is the one place that builds the engines of a replica; they share one prefix
cache (``--prefix-cache-gb``), so each row is prefilled once for all configurations.
"""
from __future__ import annotations

import os
import time

import ray

from ..replica.actor import ActorReplica, EngineWorker
from ..replica.resources import ReplicaResources
from .config import EvalConfig
from .generator import SweepGenerator


def make_engines(model, tokenizer, cfg: EvalConfig) -> dict:
    """``{config name: Engine}``, every engine over the same ``model`` (its weights are loaded once)."""
    from logitspec import Engine
    from logitspec.prefix_cache import PrefixCache

    # what every engine gets: one prefix cache, so a row is prefilled once for all configurations
    cache_bytes = int(cfg.prefix_cache_gb * 2**30)
    shared: dict = {"prefix_cache": PrefixCache(cache_bytes)} if cache_bytes > 0 else {}
    engines = {}
    for c in cfg.configs:
        chunk = {"prefill_chunk": c.prefill_chunk} if c.prefill_chunk else {}
        engines[c.name] = Engine(model, tokenizer, c.spec_config(cfg.max_batch_size), **chunk, **shared)
    return engines


class EvalWorker(EngineWorker):
    """The actor: loads the model once, builds the engines, warms each up, generates batches of rows
    (``info`` and ``generate`` as the batch job's actor)."""

    def __init__(self, cfg: EvalConfig, threads: int, use_gpu: bool, reference_refs: dict):
        # EngineWorker's own __init__ builds one engine from a GenerationSpec; this one builds the grid's
        t0 = time.perf_counter()
        import torch

        from logitspec.models import load_model

        from ..replica.startup import model_memory, torch_dtype, warm_up

        torch.set_num_threads(threads)
        device = "cuda" if use_gpu and torch.cuda.is_available() else "cpu"
        dtype = torch_dtype(cfg.dtype, device)
        model, tokenizer = load_model(cfg.model, dtype=dtype, device=device, trust_remote_code=cfg.trust_remote_code)
        t_load = time.perf_counter()
        engines = make_engines(model, tokenizer, cfg)
        if cfg.warmup:
            for engine in engines.values():
                warm_up(engine, tokenizer)
        self.generator = SweepGenerator(engines, {c.name: c for c in cfg.configs})
        self._info = {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(), "device": device,
                      "dtype": str(dtype).replace("torch.", ""), "threads": torch.get_num_threads(),
                      "model_load_s": t_load - t0, "warmup_s": time.perf_counter() - t_load,
                      **model_memory(model), "init_s": time.perf_counter() - t0}


def make_eval_replica_factory(cfg: EvalConfig, resources: ReplicaResources):
    """``factory(name) -> Replica`` for the scheduler: one :class:`EvalWorker` actor per replica."""

    def factory(name: str) -> ActorReplica:
        return ActorReplica(name, cfg, resources, {}, worker=EvalWorker)

    return factory
