"""How a graph runner's steps are built (:class:`StepBuilds`, a part of
:class:`~logitspec.worker.gpu.graph_runner.GraphRunner`): every bucket's step at start-up, each compiled
(with ``compile``), captured in a CUDA graph (on CUDA) and checked against the uncompiled step at its
first real call; each failure falls back to a plainer form of the same step, logged once and counted,
never a crash: a compiled step that fails or differs runs uncompiled, a step that fails to capture runs
without a graph, and a flex attention step without a kernel attends with SDPA. Not on a tensor-parallel
rank (``fall_back`` false): NCCL needs every rank of a group to capture a collective alike, and a failure
mid-forward leaves one rank's collectives out of step with its peers', so there the error ends the
group (the job replaces it) instead of one rank running otherwise."""
from __future__ import annotations

import logging
import time

import torch

from logitspec.worker.gpu.step import StepBuffers, bucket

log = logging.getLogger("logitspec.worker.gpu")


class StepBuilds:
    """The step-building half of :class:`~logitspec.worker.gpu.graph_runner.GraphRunner` (its buffers,
    steps, counters and settings are the runner's)."""

    def _step_for(self, buf: StepBuffers, key: tuple):
        step = self._steps.get(key)
        if step is None:
            step = self._build(buf, key)
            self._steps[key] = step
            self.counters["graphs"] += 1
            self.counters["built_after_start"] += self.started and buf.T <= self.node_buckets[-1]
        return step

    def _build(self, buf: StepBuffers, key: tuple):
        """The step of ``buf``'s bucket: compiled (with ``compile``) and captured (on CUDA) where it
        can be; a bucket whose flex attention step cannot be captured attends with SDPA instead
        (:meth:`_without_flex`); a step beyond the node buckets, or one that fails to capture, runs
        without a graph (logged once)."""
        fn = lambda: self._forward(buf, key)  # noqa: E731
        if buf.T > self.node_buckets[-1]:
            return fn
        if self.fuser is not None:
            fn = self._fused(fn, key)
        step, failure = self._captured(fn, key)
        if failure is not None:
            if self._without_flex(buf, failure):
                return self._build(buf, key)
            self.counters["uncaptured"] += 1
        return step

    def _without_flex(self, buf: StepBuffers, error: BaseException | None) -> bool:
        """After ``error`` from a flex attention step of ``buf``'s bucket: the bucket attends with SDPA
        over the whole slot from now on (its step is built again), logged once; False where the
        bucket does not use flex attention (nothing to fall back to)."""
        if (buf.R, buf.T) not in self._flex:
            return False
        del self._flex[(buf.R, buf.T)]
        for key in [k for k in self._steps if k[:2] == (buf.R, buf.T)]:  # plain and decided steps alike
            del self._steps[key]
        self.counters["flex_fallbacks"] += 1
        first = (str(error).strip().splitlines() or [""])[0]
        self._warn_once("flex", f"flex attention could not run the step {(buf.R, buf.T)} "
                                f"({type(error).__name__}: {first}); such steps attend with SDPA over the "
                                f"whole slot")
        return True

    def capture_all(self, rows: int, nodes: int) -> dict:
        """Build (on CUDA: capture) every step a configuration of up to ``rows`` rows and ``nodes``
        nodes per row (root included) can take, before any request: each (row bucket, node bucket)
        pair up to the buckets that hold them. Keyed on (rows, nodes) only with flex attention (its
        blocks end each row's keys on the device); with SDPA the key length is part of the key, and
        those steps are built on first use. Logs and returns the count, seconds and the device bytes
        the graphs took; from then on, a step built counts in ``counters["built_after_start"]``."""
        t0 = time.perf_counter()
        cuda = self.device.type == "cuda"
        before = torch.cuda.memory_reserved(self.device) if cuda else 0
        # as the steps run (the session's): no autograd state recorded in a capture or a compile
        with torch.inference_mode():
            built = self._build_all(rows, nodes)
        self.kv.reset()  # the captures' warm-up calls wrote pad nodes into the slots
        self.started = True
        self.start_up = {"graphs": built, "seconds": round(time.perf_counter() - t0, 3),
                         "bytes": (torch.cuda.memory_reserved(self.device) - before) if cuda else None,
                         "attention": self.attention}
        what = "captured" if self.capture else "built (uncaptured)"
        log.info("graph runner: %s %d step(s) for up to %d rows x %d nodes in %.1f s%s; %s", what, built,
                 rows, nodes, self.start_up["seconds"],
                 f", {self.start_up['bytes'] / 2**20:.0f} MiB" if cuda else "",
                 "no step is built after this" if self.attention == "flex" else
                 "SDPA steps are keyed on the key length too and built on first use")
        return self.start_up

    def _build_all(self, rows: int, nodes: int) -> int:
        """Build every (row bucket, node bucket) step for up to ``rows`` x ``nodes`` (flex attention
        only: SDPA's are keyed on the key length too); how many were new."""
        built = 0
        if self.attention == "flex":
            R_max = bucket(min(rows, self.max_rows), self.row_buckets)
            T_max = bucket(min(nodes, self.node_buckets[-1]), self.node_buckets)
            keys = [(R, T) for R in self.row_buckets if R <= R_max for T in self.node_buckets if T <= T_max]
            t0 = time.perf_counter()
            kinds = (False, True) if self.decide_top is not None else (False,)  # plain, decided
            for i, (R, T) in enumerate(keys):
                if i and time.perf_counter() - t0 > self.startup_s:  # the rest: built when first used
                    log.warning("graph runner: start-up time (%.0f s) spent after %d of %d bucket(s); the "
                                "others (from %d rows x %d nodes on) are built when a step first needs them",
                                self.startup_s, i, len(keys), R, T)
                    break
                n = self.counters["graphs"]
                for decide in kinds:
                    self._step_for(self._buffers_for(R, T), (R, T, self.kv.max_len, decide))
                built += self.counters["graphs"] - n
                if self.fuser is not None:  # a compile per bucket: minutes for a large model
                    log.info("graph runner: compiled step %d of %d (%d rows x %d nodes), %.0f s so far",
                             i + 1, len(keys), R, T, time.perf_counter() - t0)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        return built

    def _fused(self, fn, key: tuple):
        """``fn`` compiled (:class:`.fused.StepCompiler`), now: its compile is part of building the
        step, and its first real step is checked against ``fn`` (:meth:`_checked`); off CUDA graphs,
        the compiled function with its recompiles counted; ``fn`` itself (logged once) where the
        compile fails."""
        try:
            compiled, made = self.fuser.compile(fn)
        except Exception as e:  # noqa: BLE001 - this shape runs uncompiled, never a crash
            first = (str(e).strip().splitlines() or [""])[0]  # dynamo's explanations run to dozens of lines
            self._uncompiled(key, f"compiling it failed ({type(e).__name__}: {first})")
            return fn
        self.counters["compiles"] += made
        self._unchecked.add(key)
        if self.capture:
            return compiled

        def counted():
            self.counters["compiles"] += self.fuser.run(compiled)
        return counted

    def _checked(self, key: tuple, buf: StepBuffers, step):
        """The step to run for ``key``'s first real inputs: ``step`` if its output equals the
        uncompiled step's on them (:meth:`.fused.StepCompiler.check`), else the uncompiled step (its
        graph captured now on CUDA), logged once."""
        self._unchecked.discard(key)
        fn = lambda: self._forward(buf, key)  # noqa: E731
        try:
            self.fuser.check(fn, step, buf.hidden, buf.decision if key[3] else None)
            return step
        except Exception as e:  # noqa: BLE001 - a compiler's mistake costs speed, never tokens
            self._uncompiled(key, f"{type(e).__name__}: {e}")
        step, failure = self._captured(fn, key)
        self.counters["uncaptured"] += failure is not None
        self._steps[key] = step
        return step

    def _captured(self, fn, key: tuple) -> tuple:
        """(``fn``'s CUDA graph replay where the runner captures, else ``fn``; None), or (``fn`` itself,
        the capture's error) where the capture fails, logged once: that shape runs without a graph,
        never a crash."""
        if not self.capture:
            return fn, None
        try:
            replay = self.graphs.capture(fn)
            self.counters["captures"] += 1
            return replay, None
        except Exception as e:  # noqa: BLE001
            if not self.fall_back:
                raise
            self._warn_once("capture", f"capturing the step {key} in a CUDA graph failed "
                                       f"({type(e).__name__}: {e}); steps that fail to capture run "
                                       f"without a graph")
            return fn, e

    def _uncompiled(self, key: tuple, why: str) -> None:
        self.counters["uncompiled"] += 1
        self._warn_once("compile", f"the compiled step {key} is not used: {why}; such steps run uncompiled")

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning("%s (logged once)", message)
