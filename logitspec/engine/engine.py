"""The engine: one model replica decoding many prompts, as a session over a model runner and a policy.

:class:`Engine` builds the three roles from a model, a tokenizer and a :class:`SpecConfig`: the *model
runner* (:class:`~logitspec.worker.runner.ModelRunner`; the one ``SpecConfig.runner`` names: CUDA graphs on
CUDA, the eager :class:`~logitspec.worker.eager_runner.EagerRunner` elsewhere) runs the target and owns the
KV storage and the output layer; the *speculation policy*
(:class:`~logitspec.spec_decode.policy.SpeculationPolicy`) drafts and sizes trees; a *session*
(:class:`~logitspec.engine.session.Session`, from :meth:`Engine.open`) owns the batch of sequences and their
per-request settings, and runs the step loop (draft -> target forward -> accept -> commit -> emit) through
the other two. The engine encodes prompts and offers ``open``, ``run`` and ``generate``; the policy's
learning persists across its sessions (as in a long-running job).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from logitspec.config import SpecConfig
from logitspec.engine.request import Request, per_prompt_requests
from logitspec.engine.sequence import GenerationResult
from logitspec.engine.session import FILL_CHUNK, Session, SessionParts
from logitspec.engine.stops import eos_ids as model_eos_ids
from logitspec.spec_decode.budget import CostCurve
from logitspec.spec_decode.interface import Drafter
from logitspec.spec_decode.ngram_index import NgramSource
from logitspec.spec_decode.policy import AcceptOverride, SpeculationPolicy, StepObserver
from logitspec.versions import check_versions
from logitspec.worker import calibrate
from logitspec.worker.gpu import runner_for
from logitspec.worker.prefix_cache import PrefixCache
from logitspec.worker.runner import ModelRunner

__all__ = ["Engine", "EngineRun", "GenerationResult"]


@dataclass
class EngineRun:
    """What one :meth:`Engine.run` call produced."""

    results: list[GenerationResult]  # prompt-major: prompt 0's samples 0..n-1, then prompt 1's, ...
    # wall_s, tokens, tokens_per_s, batch_steps, mean_active, ... (see docs/engine.md)
    stats: dict[str, float]


class Engine:
    """Speculative (or plain) decoding of many prompts with one model replica."""

    def __init__(self, model, tokenizer=None, config: SpecConfig | None = None, *, prefill_chunk: int = 512,
                 fill_chunk: int | None = None, fast_head: bool = True, cost_curve: CostCurve | None = None,
                 sample_on_host: bool | None = None, prefix_cache: PrefixCache | None = None,
                 screened_sampling: bool = True, history: NgramSource | None = None,
                 runner: ModelRunner | None = None, agree_on: Callable[[dict], dict] = dict,
                 drafter: Drafter | None = None, accept_override: AcceptOverride | None = None,
                 step_observer: StepObserver | None = None, eos_ids: frozenset[int] | None = None,
                 overlap: bool | None = None):
        """``prefill_chunk``: prompt tokens per prefill forward (while other rows decode, one chunk's
        worth per decoding step). ``fill_chunk``: prompt tokens per forward of short prompts
        prefilled together while no row decodes (a batch filling up; default the larger of
        ``prefill_chunk`` and ``FILL_CHUNK``). ``prefix_cache``: prefilled prompts kept for reuse, shareable
        between engines over this model. ``cost_curve``: forward time per new-token count for
        ``budget="auto"``; by default loaded from ``logitspec calibrate``'s store or measured quickly
        on first use. ``sample_on_host``: walk sampled trees on the host, computing distributions
        only at visited nodes (default: on CPU); False samples every node where the logits are and
        waits for the device once a step. ``screened_sampling``: the host walk draws from the greedy
        screen's half-precision scores, float32 logits only where its bound cannot decide
        (:mod:`logitspec.sample.screened`); False draws from full float32 rows (the same distribution, other
        draws for a seed; slower). ``history``: a :class:`~logitspec.spec_decode.history.HistorySource` fed
        with
        every finished row's answer and consulted after the row's own context and its reference.
        ``runner``: the model runner (default: the one ``config.runner`` names,
        :func:`~logitspec.worker.gpu.runner_for`: for "auto" the CUDA-graph
        :class:`~logitspec.worker.gpu.GraphRunner` on CUDA, the eager
        :class:`~logitspec.worker.eager_runner.EagerRunner` elsewhere). ``agree_on``: how a
        tensor-parallel group agrees on host-timed values
        (:class:`~logitspec.spec_decode.policy.SpeculationPolicy`). ``drafter``, ``accept_override``,
        ``step_observer``: handed to the policy (a drafter in place of the method's, the node each row
        accepts instead of the rule's, a callback after each step; benchmark tools record and replay
        acceptance through them). ``eos_ids``: token ids that end a sequence (default the model's).
        ``overlap``: while rows decode, prefill the next prompts between queueing a step's forward and
        reading its result, so that a device's step and the host's prefill work overlap; a slot freed
        by a step is then refilled a step later (default: on CUDA; on CPU nothing runs in parallel)."""
        if prefill_chunk < 1 or (fill_chunk is not None and fill_chunk < 1):
            raise ValueError(f"prefill_chunk and fill_chunk must be >= 1, got {prefill_chunk}, {fill_chunk}")
        check_versions()  # an untested transformers can ignore the cache argument without a word
        self.model, self.tokenizer = model, tokenizer
        self.config = config or SpecConfig()
        if runner is None:
            runner = runner_for(model, self.config, fast_head=fast_head)
        self.runner = runner
        if prefix_cache is not None:
            prefix_cache.bind(model)
        self.max_context = self.runner.max_context
        self.policy = SpeculationPolicy(self.config, max_context=self.max_context,
                                        read_columns=self.runner.read_columns, cost_curve=cost_curve,
                                        measure_curve=self._measure_curve, agree_on=agree_on,
                                        drafter=drafter, accept_override=accept_override,
                                        step_observer=step_observer,
                                        remeasure_curve=None if cost_curve is not None or getattr(
                                            self.runner, "static_storage", False) else self._remeasure_curve)
        if hasattr(self.runner, "capture_all") and not self.runner.started:
            # every step shape this configuration can take, before any request (the graph runner)
            self.runner.capture_all(self.config.max_batch_size, self.policy.drafter.base_budget() + 1)
        on_host = self.runner.device.type == "cpu" if sample_on_host is None else sample_on_host
        stop_ids = model_eos_ids(model, tokenizer) if eos_ids is None else eos_ids
        self.parts = SessionParts(
            runner=self.runner, policy=self.policy, config=self.config, encode=self.encode,
            tokenizer=tokenizer, eos_ids=frozenset(stop_ids), prefill_chunk=prefill_chunk,
            fill_chunk=max(prefill_chunk, FILL_CHUNK) if fill_chunk is None else fill_chunk,
            prefix_cache=prefix_cache, history=history, sample_on_host=on_host,
            screened_sampling=screened_sampling,
            overlap=self.runner.device.type == "cuda" if overlap is None else overlap)

    def _measure_curve(self) -> CostCurve:
        """The cost curve on first need: the stored one, or measured now
        (:mod:`~logitspec.worker.calibrate`)."""
        return calibrate.load_or_measure(self.runner, self.config.max_batch_size)

    def _remeasure_curve(self) -> CostCurve:
        """The cost curve measured afresh (the stored one replaced): the policy found it stale."""
        return calibrate.load_or_measure(self.runner, self.config.max_batch_size, fresh=True)

    @property
    def history(self) -> Any:
        """The history draft source fed with finished answers (None without one)."""
        return self.parts.history

    @property
    def eos_ids(self) -> frozenset[int]:
        """Token ids that end a sequence."""
        return self.parts.eos_ids

    @property
    def prefill_chunk(self) -> int:
        return self.parts.prefill_chunk

    @property
    def fill_chunk(self) -> int:
        return self.parts.fill_chunk

    @property
    def prefix_cache(self) -> PrefixCache | None:
        return self.parts.prefix_cache

    # ------------------------------------------------------------------ input
    def encode(self, prompt, apply_chat_template: bool = False, *, fit_context: bool = True) -> list[int]:
        """Token ids of one prompt (a string, a list of chat messages, or token ids); ValueError if
        unusable, or (``fit_context``) as long as the model's context or longer."""
        if prompt is None:
            raise ValueError("prompt is None")
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], dict)):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as lists of token ids")
            if isinstance(prompt, str) and not prompt.strip():
                raise ValueError("empty prompt")
            if apply_chat_template or not isinstance(prompt, str):
                if not getattr(self.tokenizer, "chat_template", None):
                    raise ValueError("the tokenizer has no chat template")
                msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
                ids = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
                ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            else:
                ids = self.tokenizer(prompt).input_ids
        elif isinstance(prompt, (list, tuple, np.ndarray, torch.Tensor)):
            ids = [int(t) for t in (prompt.tolist() if hasattr(prompt, "tolist") else prompt)]
            vocab = self.model.config.get_text_config(decoder=True).vocab_size
            if any(not 0 <= t < vocab for t in ids):
                raise ValueError(f"token ids must be in [0, {vocab})")
        else:
            kind = type(prompt).__name__
            raise ValueError(f"a prompt must be a string, chat messages or token ids, not {kind}")
        if not ids:
            raise ValueError("empty prompt")
        if fit_context and len(ids) >= self.max_context:
            raise ValueError(f"prompt has {len(ids)} tokens; the model's context is {self.max_context}")
        return list(ids)

    # ------------------------------------------------------------------ api
    def generate(self, prompts: Sequence, request: Request | Sequence[Request] | None = None,
                 **kwargs) -> list[GenerationResult]:
        """Generate for every prompt; results in input order. Arguments as :meth:`run`."""
        return self.run(prompts, request, **kwargs).results

    def open(self, defaults: Request | None = None, *, apply_chat_template: bool = False,
             seed: int = 0) -> Session:
        """A :class:`~logitspec.engine.session.Session`: ``submit`` prompts at any time (each with its own
        :class:`~logitspec.engine.request.Request`, ``defaults`` where it has none), ``step`` to advance the
        batch and collect finished results. ``seed``: the session's base seed (a request without one
        is seeded ``seed`` + its request id)."""
        if self.policy.auto_budget and getattr(self.runner, "static_storage", False):
            self.policy.curve()  # measured through the runner's one storage before the session's rows take it
        return Session(self.parts, defaults or Request(), seed, apply_chat_template)

    @torch.inference_mode()
    def run(self, prompts: Sequence, request: Request | Sequence[Request] | None = None, *, reference=None,
            apply_chat_template: bool = False, **fields) -> EngineRun:
        """Generate every prompt's samples (one prefill each): results prompt-major, and the run's
        throughput figures.

        ``request``: the settings of every prompt, or one :class:`~logitspec.engine.request.Request` per
        prompt; ``fields`` (``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``, ``stop``, and
        ``seed`` and ``n``: an int or one per prompt) override them. Seeds: an int ``seed`` (also a
        single request's) is a base, prompt i uses ``seed + i``; sample j of a prompt seeded s uses
        :func:`~logitspec.engine.session.sample_seed` (s, j), which is s for j = 0. A sequence's samples
        depend only on its own seed and settings, never on which others share its batch.
        ``reference``: a shared n-gram source (e.g. a :class:`CorpusIndex`) consulted after the
        sequence's own context, or one per prompt.
        """
        t_start = time.perf_counter()
        prompts = list(prompts)
        requests, base = per_prompt_requests(len(prompts), request, fields)
        refs = reference if isinstance(reference, (list, tuple)) else [reference] * len(prompts)
        if len(refs) != len(prompts):
            raise ValueError("seed, reference and n lists must have one entry per prompt")
        session = self.open(requests[0] if requests else None, seed=base,
                            apply_chat_template=apply_chat_template)
        for p, q, r in zip(prompts, requests, refs):  # all errors before any forward
            session.submit(p, q, reference=r)
        results = sorted(session.drain(), key=lambda r: (r.request_id, r.sample_index))
        wall = time.perf_counter() - t_start
        ntok = sum(len(r.token_ids) for r in results)
        stats = {"wall_s": wall, "tokens": ntok, "tokens_per_s": ntok / wall if wall else 0.0,
                 **session.stats,
                 "max_step_gap_s": max((r.stats["max_step_gap_s"] for r in results), default=0.0)}
        if self.prefix_cache is not None:
            stats.update({f"prefix_{k}": v for k, v in self.prefix_cache.stats.items()})
        stats.update(self.policy.stats())
        return EngineRun(results, stats)
