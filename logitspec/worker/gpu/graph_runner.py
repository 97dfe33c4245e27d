"""The graph runner: the target's decode and tree steps over static slots, one CUDA graph per shape
bucket, behind the same seam as :class:`~logitspec.worker.eager_runner.EagerRunner`.

A step over B rows of at most n nodes runs as the bucket (R, T) = (the smallest row bucket >= B,
the smallest node bucket >= n): rows and nodes are padded with pad nodes (:mod:`.step`). Its inputs
are written into the bucket's static buffers with one ``copy_`` each; the forward (masks built from
the buffers, the decoder over the slot storage, the hidden states copied into a static output) is
captured once per (R, T) (and, for SDPA, per key-length bucket: the keys read are the slots'
first ``key_len`` columns, rounded up to ``key_block``) on first use and replayed after. The
output layer runs after the replay on the real nodes only (:meth:`~logitspec.worker.head.Head.output`),
but for greedy steps of a runner with ``decide_top`` (the engine's on CUDA): there the output layer over
every node, the argmax and the acceptance are part of the step (a second graph per bucket), and what
leaves it is the decision, [R, 2 + top + T] int64.

On CPU (``capture=False``, the default there) the same function runs eagerly: the tests run every
line of the static path except the capture itself. Prefill runs outside the graphs: a prompt's
causal chunks through the engine's attention (:mod:`logitspec.worker.attention`), written into its slot
(:meth:`GraphRunner.prefill_slot`), or through the eager path into a
:class:`~logitspec.worker.kv_cache.BatchKV` whose rows :meth:`SlotKV.add_rows` copies in (the session's way).
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from logitspec.device import is_out_of_memory, to_device
from logitspec.sample.acceptance import greedy_decision
from logitspec.worker.eager_runner import EagerRunner, ForwardResult
from logitspec.worker.gpu.building import StepBuilds
from logitspec.worker.gpu.cuda_graphs import GraphPool
from logitspec.worker.gpu.fused import StepCompiler, sdpa_context
from logitspec.worker.gpu.slots import SlotKV
from logitspec.worker.gpu.step import (
    NAME,
    NODE_BUCKETS,
    ROW_BUCKETS,
    FlexMasks,
    StepBuffers,
    bucket,
    sdpa_mask_for,
)
from logitspec.worker.head import NodeLogits, OutputMode
from logitspec.worker.kv_cache import kv_shape
from logitspec.worker.masks import PackedStep, StepRow, pack

log = logging.getLogger("logitspec.worker.gpu")

ATTENTIONS = ("sdpa", "flex")
# the engine's graph runners attend with flex attention: each row's keys end on the device (its block
# lists), so a step's graph is keyed on (rows, nodes) alone and every one is captured at start-up
ENGINE_ATTENTION = "flex"
# the most seconds start-up spends building (compiling, capturing) steps: the buckets past it, the largest
# (rows, then nodes, ascending), are built when first used, counted in counters["built_after_start"]
STARTUP_S = 600.0
# nodes whose logits a decided step holds at once ([256, V]: 64 MiB at a 128k bfloat16 vocabulary, not
# the [R * T, V] of every node: 1-8 GiB at 64-256 rows of 64 nodes)
DECISION_CHUNK = 256


class GraphRunner(StepBuilds):
    """A :class:`~logitspec.worker.runner.ModelRunner` over static slots: ``new_batch`` gives the runner's
    :class:`SlotKV`, whose steps take the bucketed static path; prompts prefill through the eager
    :class:`~logitspec.worker.eager_runner.EagerRunner` (``new_row``, ``prefill_rows``, ``extend``) into
    :class:`~logitspec.worker.kv_cache.BatchKV` rows that the session adds to the batch (copied into slots).
    A ``BatchKV`` handed to :meth:`step` or :meth:`__call__` goes to the eager path (the cost
    calibration's forwards)."""

    def __init__(self, model, max_rows: int = 64, max_len: int = 4096, *, attention: str = "sdpa",
                 capture: bool | None = None, compile=False, sdpa_backend: str | None = None,
                 row_buckets=ROW_BUCKETS, node_buckets=NODE_BUCKETS, key_block: int = 256,
                 flex_block: int = 128, warmup: int = 3, sharded_head: bool = False,
                 decide_top: int | None = None, startup_s: float = STARTUP_S):
        """``max_rows`` slots of ``max_len`` columns (a row's committed tokens plus its step's padded
        nodes). ``attention``: "sdpa" (additive mask over the bucket's key length) or "flex" (block
        mask over each row's own length). ``capture``: CUDA graphs (default: on CUDA). ``compile``:
        each step's device work compiled by inductor (:mod:`.fused`) before it is captured (True, or
        the :class:`~.fused.StepCompiler` to use).
        ``sdpa_backend``: the one SDPA kernel the steps may use (:data:`.fused.SDPA_BACKENDS`; None:
        torch's choice). ``sharded_head``: a tensor-parallel rank's (its output layer a collective
        module, :class:`~logitspec.worker.head.Head`; its slots sized at the first write, by the heads
        the rank holds): its steps are captured with their collectives on CUDA (unverified on GPUs),
        never compiled, every one built at start-up (no ``startup_s``), none falling back alone.
        ``decide_top``: greedy steps are decided inside the step (the output layer over every node,
        the argmax, the accepted path and the last node's ``decide_top`` best tokens:
        :func:`~logitspec.sample.acceptance.greedy_decision`), each bucket built a second time for them;
        None: the output layer and acceptance run after the step. ``startup_s``: the most seconds
        :meth:`capture_all` spends building steps; buckets left then are built when first used."""
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
        self.fuser = compile if isinstance(compile, StepCompiler) else (StepCompiler() if compile else None)
        self.sdpa_backend = sdpa_backend
        self._sdpa = sdpa_context(sdpa_backend)
        self.eager = EagerRunner(model, sharded_head=sharded_head)
        if not self.eager.head.fast:
            raise ValueError("GraphRunner needs the model's decoder and output layer apart (Head.fast)")
        self.model, self.head = model, self.eager.head
        self.device, self.dtype = self.eager.device, self.eager.dtype
        self.windows, self.layer_kinds = self.eager.windows, self.eager.layer_kinds
        self.vocab_size = self.eager.vocab_size
        self.attention = attention
        self.capture = self.device.type == "cuda" if capture is None else capture
        if self.capture and self.device.type != "cuda":
            raise ValueError("capture needs a CUDA device")
        if sharded_head and self.fuser:
            raise ValueError("a tensor-parallel rank's graph runner runs uncompiled (compile=False)")
        cfg = model.config.get_text_config(decoder=True)
        heads = int(cfg.num_attention_heads)
        self.groups = heads // int(getattr(cfg, "num_key_value_heads", None) or heads)
        self.hidden_size = int(cfg.hidden_size)
        self.row_buckets = tuple(b for b in row_buckets if b < max_rows) + (max_rows,)
        self.node_buckets = tuple(node_buckets)
        self.key_block, self.flex_block, self.warmup = key_block, flex_block, warmup
        self.max_rows = max_rows
        if decide_top is not None and decide_top < 0:
            raise ValueError(f"decide_top must be >= 0, got {decide_top}")
        # a rank's own clock must not decide which steps it builds at start-up: building one runs its
        # collectives (warm-up calls), so every rank of a group builds every step there
        self.decide_top, self.startup_s = decide_top, float("inf") if sharded_head else startup_s
        self.fall_back = not sharded_head  # a rank of a group never runs a step otherwise alone (.building)
        self.max_context = min(self.eager.max_context, max_len - self.node_buckets[-1])
        # the eager path's attention is unchanged: graph_attention delegates to it outside the steps
        model.set_attn_implementation(NAME)
        layers, kv_heads, head_dim = kv_shape(model)
        self.kv = SlotKV(layers, max_rows, max_len, self.device)
        if not sharded_head:  # now, not at the first write: a step built (captured, compiled) before
            # any prompt must not hold the storage's allocation (a rank's heads: known at the first write)
            self.kv.allocate(kv_heads, head_dim, self.dtype)
        self._buffers: dict[tuple[int, int], StepBuffers] = {}
        self._flex: dict[tuple[int, int], FlexMasks] = {}
        # (R, T, key_len, decided) -> a graph's replay, or the function
        self._steps: dict[tuple, object] = {}
        self.graphs = GraphPool(self.device, warmup)  # one memory pool for every step's graph
        self._unchecked: set[tuple] = set()  # compiled steps not yet checked on real inputs
        self.counters = {"graphs": 0, "captures": 0, "replays": 0, "allocations": 0, "uncaptured": 0,
                         "built_after_start": 0, "compiles": 0, "uncompiled": 0, "flex_fallbacks": 0,
                         "decided": 0}
        self.started = False  # capture_all ran: a step built after it counts in built_after_start
        self.start_up: dict = {}  # what capture_all built: graphs, seconds, bytes
        self._warned: set[str] = set()

    # ------------------------------------------------------------------ the seam (runner.ModelRunner)
    # its batch cache is one fixed storage that new_batch empties: nothing (a cost measurement) may
    # take it while a session holds rows (Engine.open measures the auto budget's curve before)
    static_storage = True

    @property
    def kind(self) -> str:
        """What its steps are (a stored cost curve's key:
        :func:`~logitspec.worker.calibrate.runner_fingerprint`)."""
        block = f"key_block={self.key_block}" if self.attention == "sdpa" else f"flex_block={self.flex_block}"
        extra = (":compiled" if self.fuser else "") + (f":sdpa={self.sdpa_backend}" if self.sdpa_backend
                                                         else "")
        extra += f":decide={self.decide_top}" if self.decide_top is not None else ""
        return f"graph:{self.attention}:{'cuda-graphs' if self.capture else 'uncaptured'}:{block}{extra}"

    def new_batch(self, max_rows: int = 0) -> SlotKV:
        """The runner's slot storage, emptied (one per runner: its graphs hold its addresses)."""
        if max_rows > self.kv.slots:
            raise ValueError(f"{max_rows} rows exceed the runner's {self.kv.slots} slots")
        self.kv.reset()
        return self.kv

    new_kv = new_batch

    def new_row(self, reserve: int = 0):
        return self.eager.new_row(reserve)

    def read_columns(self, cached: float) -> float:
        return self.eager.read_columns(cached)

    def prefill(self, tokens, chunk: int, mode: OutputMode = OutputMode.EXACT):
        return self.eager.prefill(tokens, chunk, mode)

    def prefill_rows(self, prompts, mode: OutputMode = OutputMode.EXACT):
        return self.eager.prefill_rows(prompts, mode)

    def extend(self, row, tokens, mode: OutputMode = OutputMode.EXACT):
        return self.eager.extend(row, tokens, mode)

    def step(self, rows: list[StepRow], kv, mode: OutputMode) -> ForwardResult:
        """One decoding step: every node of every row, output-layer results (``mode``) for all."""
        return self(rows, kv, True, mode)

    def __call__(self, rows: list[StepRow], kv, all_logits: bool, mode: OutputMode = OutputMode.EXACT,
                 pick: list[np.ndarray] | None = None, segments=None, prefill: bool = False) -> ForwardResult:
        """One step over ``rows`` (row b against ``kv`` row b's committed columns); arguments and
        result as :meth:`EagerRunner.__call__`. ``kv`` a :class:`SlotKV`: the bucketed static
        path (``pick``, ``segments``, ``prefill`` are the eager path's); else the eager path."""
        if not isinstance(kv, SlotKV):
            return self.eager(rows, kv, all_logits, mode, pick, segments, prefill)
        if kv is not self.kv:
            raise ValueError("a SlotKV of another runner")
        if pick is not None or segments or prefill:
            raise ValueError("the static path runs decode and tree steps; prefill through prefill_slot")
        if len(rows) != kv.rows:
            raise ValueError(f"{len(rows)} step rows for {kv.rows} cache rows")
        t0 = time.perf_counter()
        sizes = [len(r.tokens) for r in rows]
        buf, key_len = self._fill(rows, kv)
        T = buf.T
        first = [b * T + (0 if all_logits else n - 1) for b, n in enumerate(sizes)]
        counts = sizes if all_logits else [1] * len(rows)
        # [N]: the nodes' flat positions in the [R, T] batch
        select = np.concatenate([np.arange(f, f + n) for f, n in zip(first, counts)])
        starts = np.cumsum([0] + counts[:-1])
        both = to_device(np.concatenate([select, starts]).astype(np.int64), self.device)
        select_d, starts_d = both[:len(select)], both[len(select):]
        pack_s = time.perf_counter() - t0
        decide = self.decide_top is not None and mode is OutputMode.GREEDY
        key = (buf.R, buf.T, key_len, decide)
        for retry in (False, True):
            step = self._step_for(buf, key)
            if key in self._unchecked:
                step = self._checked(key, buf, step)
            try:
                step()
                break
            except Exception as e:  # flex attention without a kernel for this shape: SDPA, never a crash
                # (out of memory is the caller's to handle: SDPA over the whole slot would need more)
                if retry or not self.fall_back or is_out_of_memory(e) or not self._without_flex(buf, e):
                    raise
        self.counters["replays"] += 1
        self.head.after_forward(buf.ids, buf.pos, buf.hidden)  # outside the graph: a replay runs no hooks
        B = len(rows)
        packed = PackedStep(buf.ids[:B], buf.pos[:B], buf.depths[:B], buf.parents[:B], buf.anc[:B], None,
                            sizes, {})
        spans = [(int(a), int(a) + n) for a, n in zip(starts, counts)]
        if not decide:
            nodes = self.head.output(buf.hidden.index_select(0, select_d), mode)
            return ForwardResult(nodes, packed, select_d, starts_d, spans, pack_s)
        self.counters["decided"] += 1
        decision, ready = buf.decision[:B], None
        if buf.decision_host is not None:  # to pinned memory now: reading it waits for this step alone,
            buf.decision_host.copy_(buf.decision, non_blocking=True)  # not for work queued after it
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
            decision = buf.decision_host[:B]
        # the nodes' logits only if asked (before the bucket runs again): acceptance reads the decision
        return ForwardResult(lambda: self.head.output(buf.hidden.index_select(0, select_d), mode), packed,
                             select_d, starts_d, spans, pack_s, decision, self.decide_top, ready)

    def prepare(self, rows: list[StepRow], kv: SlotKV):
        """Fill the bucket's buffers for ``rows`` and return the step's device work as a function
        of no arguments (what a capture records) and its output, the hidden states [R * T, hidden]
        (rows padded to R, nodes to T; row b's node i at b * T + i). For compilers and tests."""
        buf, key_len = self._fill(rows, kv)
        return (lambda: self._forward(buf, (buf.R, buf.T, key_len, False))), buf.hidden

    def _fill(self, rows: list[StepRow], kv: SlotKV) -> tuple[StepBuffers, int]:
        R = bucket(len(rows), self.row_buckets)
        n = max(len(r.tokens) for r in rows)
        if n > self.node_buckets[-1]:  # beyond the buckets: this exact shape, run without a graph
            T = n
            self._warn_once("oversize", f"a step of {n} nodes per row is beyond the largest node bucket "
                                        f"({self.node_buckets[-1]}): such steps run without a CUDA graph")
        else:
            T = bucket(n, self.node_buckets)
        need = max(kv.lengths) + T
        if need > kv.max_len:
            raise ValueError(f"a row needs {need} columns (nodes padded to {T}); slots hold {kv.max_len}")
        key_len = kv.max_len  # flex: the block lists end each row
        if self.attention == "sdpa":
            key_len = min(-(-need // self.key_block) * self.key_block, kv.max_len)
        buf = self._buffers_for(R, T)
        buf.fill(rows, kv.lengths)
        return buf, key_len

    # ------------------------------------------------------------------ prefill into a slot
    def prefill_slot(self, tokens, chunk: int = 512, mode: OutputMode = OutputMode.EXACT) -> NodeLogits:
        """Prefill ``tokens`` into the next free slot (a new last row of :attr:`kv`) in causal chunks
        of ``chunk`` tokens, outside the graphs; the output layer's result for the last token [1, V]."""
        kv = self.kv
        if kv.rows >= kv.slots:
            raise ValueError(f"all {kv.slots} slots are taken")
        slot = kv.rows
        kv.lengths.append(0)
        try:
            for start in range(0, len(tokens), chunk):
                part = list(tokens[start:start + chunk])
                kv.for_prefill(slot, start, len(part))
                p = pack([StepRow.chain(start, part)], start, self.windows, self.dtype, self.device)
                out = self.head.decoder(input_ids=p.ids, position_ids=p.pos, attention_mask=p.mask,
                                        cache=kv.hf, use_cache=True, prefill=True, causal=True)
                self.head.after_forward(p.ids, p.pos, out.last_hidden_state)
                kv.lengths[slot] = start + len(part)
        except Exception:
            kv.lengths.pop()
            raise
        finally:
            kv.end_step()
        return self.head.output(out.last_hidden_state[0, -1:], mode)

    # ------------------------------------------------------------------ buckets and graphs
    def _buffers_for(self, R: int, T: int) -> StepBuffers:
        buf = self._buffers.get((R, T))
        if buf is None:
            buf = StepBuffers(R, T, self.device)
            buf.hidden = torch.zeros(R * T, self.hidden_size, dtype=self.dtype, device=self.device)
            if self.decide_top is not None:  # [R, 2 + top + T]: greedy_decision's columns
                buf.decision = torch.zeros(R, 2 + self.decide_top + T, dtype=torch.int64, device=self.device)
                if self.device.type == "cuda":  # its host copy (pinned: copied without a wait)
                    buf.decision_host = torch.empty(buf.decision.shape, dtype=torch.int64, pin_memory=True)
            self._buffers[(R, T)] = buf
            self.counters["allocations"] += 1
            if self.attention == "flex":
                self._flex[(R, T)] = FlexMasks(buf, self.kv.max_len, self.windows, self.flex_block)
                self.counters["allocations"] += 1
        return buf

    def _forward(self, buf: StepBuffers, key: tuple) -> None:
        """The step ``key`` (rows, nodes, key length, decided)'s device work, reading only the buffers
        and the slots: masks, the decoder, the hidden states into ``buf.hidden``; for a decided step,
        the output layer over every node and its greedy decision into ``buf.decision``."""
        key_len, decide = key[2], key[3]
        self.kv.for_step(buf.R, buf.write_cols(), key_len)
        flex = self._flex.get((buf.R, buf.T))
        if flex is not None:
            masks = flex.update()
        else:
            masks = {kind: sdpa_mask_for(buf, key_len, w, self.groups, self.dtype)
                     for kind, w in self.windows.items()}
        mask = next(iter(masks.values())) if len(masks) == 1 else masks
        with self._sdpa():
            out = self.head.decoder(input_ids=buf.ids, position_ids=buf.pos, attention_mask=mask,
                                    cache=self.kv.hf, use_cache=True, graph_step=True)
        buf.hidden.copy_(out.last_hidden_state.reshape(buf.R * buf.T, -1))
        self.kv.end_step()  # drop the write columns: no tensor made in a capture outlives it
        if decide:  # the output layer over every node, DECISION_CHUNK nodes' logits at a time
            h = buf.hidden  # [R * T, hidden]
            choice = torch.cat([self.head.top(part, 1)[:, 0] for part in h.split(DECISION_CHUNK)])
            packed = PackedStep(buf.ids, buf.pos, buf.depths, buf.parents, buf.anc, None, [], {})
            top = self.decide_top
            buf.decision.copy_(greedy_decision(choice.view(buf.R, buf.T), packed, top,
                                               lambda at: self.head.top(h.index_select(0, at), top)))

    @property
    def buckets(self) -> list[tuple]:
        """The step shapes built so far: (rows, nodes, key length)."""
        return sorted({key[:3] for key in self._steps})

