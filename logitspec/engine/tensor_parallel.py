"""One rank of a tensor-parallel group: DeepSpeed AutoTP shards of one model, driven SPMD. No Ray here.

Every rank of a group runs the same :class:`logitspec.Engine` on the same prompts with the same seeds.
AutoTP all-reduces the partial sums of each sharded layer and every rank gathers the same best tokens
(or logits) from the output layer split by vocabulary (:mod:`logitspec.worker.vocab_parallel`), so every
rank takes the same drafting, verification and sampling decisions; beyond those collectives the ranks
exchange only a step's timings (:func:`rank0_times`) and checks: :class:`LogitsConsensus` during a
batch, :func:`check_agreement` after it. A peer's death ends the rank
(:class:`~logitspec.engine.peer_watchdog.PeerWatchdog`).

On CPU (docs/tensor_parallel.md): the backend is gloo (oneCCL is not on PyPI); DeepSpeed always routes its
inference all-reduce through a shared-memory op that initialises only when ``LOCAL_SIZE`` equals the
world size (without it the first forward segfaults), so :func:`rank_env` sets it; the op's first build
takes about a minute of g++ and is cached in ``TORCH_EXTENSIONS_DIR`` (default here:
``~/.cache/logitspec/torch_extensions``); and each rank must run one intra-op thread per core it owns
(2 ranks x 2 threads on 2 cores ran 10x slower).
"""
from __future__ import annotations

import contextlib
import gc
import hashlib
import logging
import os
import pathlib
import socket
import time
from datetime import timedelta
from typing import Any, Iterable

import torch

from logitspec.engine.step_clock import STEP_PARTS

log = logging.getLogger("logitspec.engine.tensor_parallel")

DEFAULT_TIMEOUT_S = 1800.0  # one collective may wait this long (a long prefill on a slow peer is fine)
_SHM_PREFIX = "deepspeed_allreduce_buffer"  # DeepSpeed's shm all-reduce segment names (ops/csrc/cpu/comm)
_HOST_GROUP = None  # init_rank's gloo group for host values beside an NCCL group (host_group)


# forwards per consensus check on a GPU: a check is a few checksum kernels and a small collective a
# forward; a divergence shows in every later forward's inputs and in the batch's digest anyway
CONSENSUS_EVERY = 8
# settings under which a NCCL collective synchronises with the host (blocking waits, torch's NaN check's
# read): a CUDA graph cannot capture such a step
CAPTURE_BREAKERS = ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT", "TORCH_NCCL_NAN_CHECK")


class RanksDiverged(RuntimeError):
    """The ranks of one group produced different results: their logits were not bitwise identical."""


# ---------------------------------------------------------------------------------------------- setup
def free_port() -> int:
    """A TCP port that was free a moment ago on this host (for ``MASTER_PORT``)."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def rank_env(rank: int, world_size: int, master_port: int, master_addr: str = "127.0.0.1",
             local_rank: int | None = None) -> dict[str, str]:
    """The environment one rank of a single-node group needs (what DeepSpeed's own launcher sets).

    ``LOCAL_SIZE`` = world size is what makes DeepSpeed's CPU shm all-reduce initialise; without it
    the first forward segfaults. DeepSpeed also names its shm segments after ``MASTER_ADDR`` and
    ``MASTER_PORT``, so two groups on one node need two ports. ``LOCAL_RANK`` is what DeepSpeed
    binds as the CUDA device index (default: the rank).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside a group of {world_size}")
    local = rank if local_rank is None else local_rank
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(local),
            "LOCAL_SIZE": str(world_size), "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)}


def extensions_dir() -> pathlib.Path:
    """Where DeepSpeed's compiled ops live: ``$TORCH_EXTENSIONS_DIR``, else the project cache (so the
    one-minute build happens once per machine, not once per process or temp dir); sets the variable."""
    from logitspec.paths import default_cache_dir

    path = pathlib.Path(os.environ.get("TORCH_EXTENSIONS_DIR") or default_cache_dir() / "torch_extensions")
    path.mkdir(parents=True, exist_ok=True)
    os.environ["TORCH_EXTENSIONS_DIR"] = str(path)
    return path


def init_rank(rank: int, world_size: int, master_port: int, *, device: str = "cpu",
              backend: str | None = None,
              threads: int = 1, master_addr: str = "127.0.0.1", timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Join the group: environment, threads, ``torch.distributed`` through DeepSpeed. Blocks until
    every rank has joined. ``device``: "cpu", "cuda" (GPU index = rank) or "cuda:K"."""
    local = None
    if device.startswith("cuda"):
        local = rank if device == "cuda" else torch.device(device).index
    os.environ.update(rank_env(rank, world_size, master_port, master_addr, local))
    extensions_dir()
    torch.set_num_threads(threads)
    if local is not None:
        torch.cuda.set_device(local)
    import deepspeed

    backend = backend or default_backend(device)
    breakers = [k for k in CAPTURE_BREAKERS if os.environ.get(k, "0") not in ("", "0")]
    if backend == "nccl" and breakers:
        log.warning("%s set: NCCL collectives then wait on the host, and a graph runner's steps "
                    "(--runner graph) cannot be captured", ", ".join(breakers))
    deepspeed.init_distributed(dist_backend=backend, timeout=timedelta(seconds=timeout_s), verbose=False,
                               rank=rank, world_size=world_size)
    global _HOST_GROUP
    _HOST_GROUP = torch.distributed.new_group(backend="gloo") if backend != "gloo" else None
    if backend == "gloo":
        # Every rank has mapped every peer's shm segment once all are past init: unlink ours now, so a
        # rank that is killed later leaves no 66 MB segment behind in /dev/shm (the mappings live on).
        torch.distributed.barrier()
        seg = pathlib.Path("/dev/shm") / f"{_SHM_PREFIX}_{os.getuid()}_{master_addr}_{master_port}_{rank}"
        with contextlib.suppress(OSError):
            seg.unlink()


def shard(model, tp_size: int, dtype: torch.dtype):
    """AutoTP-shard a loaded HF model across the group (collective: every rank calls it); returns the
    sharded HF model (moved to this rank's device). The replaced full-size layers are freed."""
    import deepspeed

    engine = deepspeed.init_inference(model, tensor_parallel={"tp_size": tp_size}, dtype=dtype,
                                      replace_with_kernel_inject=False)
    model = engine.module
    gc.collect()
    return model


def load_tp_model(spec: str, tp_size: int, *, dtype: torch.dtype = torch.float32, device: str = "cpu",
                  attn_implementation: str | None = "logitspec_sdpa", trust_remote_code: bool = False):
    """``(sharded model, tokenizer, consensus)`` on this rank; the group must be initialised
    (:func:`init_rank`). ``consensus``: the :class:`LogitsConsensus` its engines run (pass it to
    :func:`make_engine`; None when ``tp_size`` is 1). The output layer is split by vocabulary
    (:mod:`logitspec.worker.vocab_parallel`), not along the hidden size as AutoTP splits it.

    Loading: ``from_pretrained`` memory-maps safetensors files whose dtype matches, so the full
    weights are page cache shared by all ranks of a node; AutoTP then copies out this rank's slices
    and the private (anonymous) memory of a rank ends near ``replicated + sharded / tp`` (measured in
    docs/tensor_parallel.md). A dtype conversion at load (e.g. float32 file -> bfloat16) makes a
    private full copy per rank for the duration of the load.
    """
    from logitspec.models import load_model

    # AutoTP replaces nn.Linear modules by its own sharded layers: keep them plain (no skinny kernels, no
    # merged projections: a merged group would stay whole beside its sharded output projection)
    model, tokenizer = load_model(spec, dtype=dtype, device="cpu", attn_implementation=attn_implementation,
                                  cpu_kernels=tp_size == 1 and device == "cpu", merge=False,
                                  trust_remote_code=trust_remote_code)
    consensus = None
    if tp_size > 1:
        from logitspec.worker import vocab_parallel

        rank = torch.distributed.get_rank()
        head = vocab_parallel.install(model, rank, tp_size)  # before AutoTP: it needs the whole weight
        model = shard(model, tp_size, dtype)
        if head is not None:  # in place of AutoTP's hidden-split output layer
            vocab_parallel.attach(model, head)
        consensus = LogitsConsensus(every=1 if device == "cpu" else CONSENSUS_EVERY)
    elif device != "cpu":
        from logitspec.models.merged_projections import merge_projections

        model.to(device)
        merge_projections(model)  # one device: as load_model gives it off CPU
    return model, tokenizer, consensus


def make_engine(model, tokenizer, config, history=None, *, cost_curve=None, agree_on=None, consensus=None):
    """The engine of one rank (``history``: an optional draft source of earlier answers, fed alike
    on every rank since every rank sees the same outputs). The output layer is sharded, so ``W @ h.T``
    with the local weight would be wrong: the runner calls the module itself (a collective) on the
    selected nodes only, as on one device (not the model's whole forward, whose logits cover every
    padded position). ``consensus``: the :class:`LogitsConsensus` run after every forward of the
    engine's runner (default in a group: a new one, one forward in :data:`CONSENSUS_EVERY` checked off
    CPU). In a group, host-timed
    timings are rank 0's (``agree_on``, default
    :func:`rank0_times`) and the auto budget's cost curve is the group's (``cost_curve``, default
    :func:`group_cost_curve`)."""
    from logitspec.engine.engine import Engine
    from logitspec.spec_decode.policy import uses_auto_budget
    from logitspec.worker.gpu import runner_for

    grouped = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
    runner = runner_for(model, config, sharded_head=grouped)
    if grouped and consensus is None:
        consensus = LogitsConsensus(every=1 if runner.device.type == "cpu" else CONSENSUS_EVERY)
    if consensus is not None:
        runner.head.checks.append(consensus.observe)
    if grouped and agree_on is None:
        agree_on = rank0_times
    if grouped and uses_auto_budget(config) and cost_curve is None:
        cost_curve = group_cost_curve(runner)
    return Engine(model, tokenizer, config, runner=runner, history=history, cost_curve=cost_curve,
                  agree_on=agree_on or dict)


def host_group():
    """The process group for host values (timings, digests): a gloo group beside an NCCL one, so
    agreeing on a host value never waits for the device's queue; None (the default group) on gloo."""
    return _HOST_GROUP


def rank0_value(x: float) -> float:
    """Rank 0's ``x`` on every rank (one tiny broadcast of a host tensor on :func:`host_group`):
    decisions the engine takes from host timings (whether to skip drafting) must be the same on all
    ranks, or their forwards diverge (seen in CI: a replacement group failed mid-batch)."""
    t = torch.tensor([x], dtype=torch.float64)
    torch.distributed.broadcast(t, src=0, group=host_group())
    return float(t)


def rank0_times(times: dict[str, float]) -> dict[str, float]:
    """Rank 0's step timings on every rank (one broadcast of a few host values on :func:`host_group`):
    the auto budget's decisions read a step's timings only through this (``SpeculationPolicy``'s
    ``agree_on``), so ranks with different clocks decide alike."""
    # the same keys on every rank whatever each measured (a part a rank timed at 0 may be missing from
    # its dict): a broadcast of another size would break the collective
    keys = STEP_PARTS + tuple(sorted(set(times) - set(STEP_PARTS)))
    t = torch.tensor([float(times.get(k, 0.0)) for k in keys], dtype=torch.float64)
    torch.distributed.broadcast(t, src=0, group=host_group())
    return dict(zip(keys, t.tolist()))


def group_cost_curve(target):
    """One forward-cost curve for the whole group (``budget="auto"`` sizes drafts from it).

    Each rank measuring its own would make the ranks choose different draft sizes from their own
    timings, and diverge (seen: a hang within two dozen steps). Rank 0 decides: it loads the
    group's stored curve (a ``-tp<N>`` sibling of the single-process one: a sharded forward costs
    differently), or all ranks measure together (the forwards are collective) and rank 0 stores it;
    then rank 0's curve is broadcast.
    """
    import json

    from logitspec.spec_decode.budget import CostCurve
    from logitspec.worker.calibrate import (
        curve_from_doc,
        curve_path,
        grid_for,
        measure,
        rows_for,
        runner_fingerprint,
        save,
    )

    dist = torch.distributed
    world = dist.get_world_size()
    base = curve_path(target.model, head=target.head, runner=runner_fingerprint(target))
    path = base.with_name(f"{base.stem}-tp{world}.json") if base is not None else None
    doc: list = [None]
    if dist.get_rank() == 0 and path is not None and path.exists():
        with contextlib.suppress(OSError, ValueError, KeyError):
            d = json.loads(path.read_text())
            doc[0] = curve_from_doc(d).to_dict()  # the curve as measured: its head and column cost too
    dist.broadcast_object_list(doc, src=0)
    if doc[0] is None:
        t0 = time.perf_counter()
        # every rank measures again or none does: the forwards are collective
        # the grid's batch sizes, at most the runner's slots (a graph runner's: its max_rows)
        grid = grid_for(target.device)
        rows = rows_for(grid, max(grid.rows), getattr(target, "max_rows", None))
        curve = measure(target, tokens=(1, 2, 4, 8, 16, 32), reps=2, batch_rows=rows, agree=rank0_value)
        doc[0] = curve.to_dict()
        dist.broadcast_object_list(doc, src=0)
        if dist.get_rank() == 0:
            log.info("measured the group's forward cost curve in %.1f s: %s", time.perf_counter() - t0,
                     doc[0])
            if path is not None:
                with contextlib.suppress(OSError):
                    save(CostCurve(**doc[0]), path, target)
    return CostCurve(**doc[0])


# ---------------------------------------------------------------------------------------------- agreement
def decisions_digest(results: Iterable[Any]) -> str:
    """A hash of everything the ranks must agree on: per sequence the tokens, the finish reason and the
    accepted length of every step (timings excluded). Accepts engine results or output-row dicts."""
    h = hashlib.sha256()
    for r in results:
        if isinstance(r, dict):
            key = (r.get("id"), r.get("generation"), r.get("finish_reason"), r.get("n_new_tokens"),
                   tuple(r.get("accepted_lengths") or ()), r.get("error"))
        else:
            key = (tuple(r.token_ids), r.finish_reason, tuple(r.stats.get("accepted_lengths", ())))
        h.update(repr(key).encode())
    return h.hexdigest()


def check_agreement(digest: str) -> list[str]:
    """All-gather every rank's digest; raise :class:`RanksDiverged` (on every rank alike) if they differ."""
    world = torch.distributed.get_world_size()
    got: list = [None] * world
    torch.distributed.all_gather_object(got, digest, group=host_group())
    if len(set(got)) != 1:
        raise RanksDiverged(f"tensor-parallel ranks disagree on their outputs (digests {got})")
    return got


class LogitsConsensus:
    """Checks that the ranks decode in lockstep, off the hot path: the runner calls :meth:`observe`
    after every forward of the decoder, outside any captured step (``Head.checks``).

    After such a forward each rank all-gathers a checksum of its inputs (token ids, positions) and of
    its output, the final hidden states every rank's output layer reads (one tiny collective, queued on
    the device like the forward's own all-reduces) and copies the gathered checksums to host memory
    without waiting; on a GPU it reads them one checked forward later, when the engine's own wait for
    that forward's tokens has long passed, so the check adds no host wait to a step (gloo's are host
    values: compared at once). Different inputs mean the ranks' decisions already diverged: every rank
    raises :class:`RanksDiverged` at the same forward (they read the same gathered checksums). Different
    outputs are counted (``output_mismatches``) and logged: AutoTP all-reduces every layer's partial
    sums, so every rank holds the same states (never seen otherwise); were they to differ, the
    decisions they led to would differ and show as different inputs at a later forward, and the
    batch's output digest (:func:`check_agreement`) is compared after every batch. :meth:`flush`
    checks the last forward (:meth:`stats` does). ``every``: one forward in ``every`` is checked (every
    rank counts its forwards alike, so all take the same collectives); the others cost nothing.
    """

    def __init__(self, every: int = 1, lag: bool | None = None):
        """``lag``: compare a forward's checksums at the next checked forward (default: where they are
        device tensors, NCCL's; gloo's are host tensors, compared at once, before the forward's output
        layer gathers anything)."""
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.every, self.lag = every, lag
        self.forwards = 0
        self.checked = 0  # forwards whose checksums were compared
        self.output_mismatches = 0
        self._pending = None  # (forward number, host copy [world, k], event or None): not yet compared
        self._host = None  # on CUDA, two pinned [world, k] buffers

    def observe(self, ids: torch.Tensor, pos: torch.Tensor, hidden: torch.Tensor) -> None:
        """After a decoder forward of token ids and positions ``ids``, ``pos`` [B, T] whose final
        hidden states (what every rank's output layer reads) are ``hidden``."""
        self.forwards += 1
        if self.forwards % self.every:  # not sampled: no checksum, no collective
            return
        dist = torch.distributed
        dev = hidden.device if dist.get_backend() == "nccl" else torch.device("cpu")  # gloo: host tensors
        mine = torch.cat([_checksum(t).to(dev) for t in (hidden, ids, pos)])  # int64 [6]
        got = torch.empty(dist.get_world_size(), mine.numel(), dtype=mine.dtype, device=dev)  # [world, k]
        dist.all_gather(list(got.unbind(0)), mine)  # rows of one tensor: one copy to the host
        self.flush()  # the previous forward's: ready long ago
        if dev.type == "cuda":  # two pinned buffers in turn: the one being read is never the one written
            if self._host is None or self._host[0].shape != got.shape:
                self._host = [torch.empty(got.shape, dtype=got.dtype, pin_memory=True) for _ in range(2)]
            host = self._host[self.forwards % 2]
            host.copy_(got, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._pending = (self.forwards, host, event)
        else:
            self._pending = (self.forwards, got, None)
        lag = dev.type == "cuda" if self.lag is None else self.lag
        if not lag:
            self.flush()

    def flush(self) -> None:
        """Compare the checksums of the last forward not yet compared (raise :class:`RanksDiverged` on
        every rank alike if its inputs differed)."""
        if self._pending is None:
            return
        forward, got, event = self._pending
        self._pending = None
        if event is not None:
            event.synchronize()
        self.checked += 1
        if not bool((got[1:, 2:] == got[0, 2:]).all()):
            raise RanksDiverged(f"tensor-parallel ranks fed different inputs to forward {forward}: "
                                "their decoding decisions diverged")
        if not bool((got[1:, :2] == got[0, :2]).all()):
            self.output_mismatches += 1
            log.warning("tensor-parallel ranks computed different hidden states at forward %d (%d so far)",
                        forward, self.output_mismatches)

    def stats(self) -> dict:
        self.flush()
        return {"forwards": self.forwards, "checked": self.checked,
                "output_mismatches": self.output_mismatches}


def _checksum(t: torch.Tensor) -> torch.Tensor:
    """int64 [2]: the sum of the raw bit patterns (any single changed bit changes it) and the numel."""
    t = t.detach().contiguous()
    if t.is_floating_point():
        t = t.view({4: torch.int32, 2: torch.int16, 8: torch.int64}[t.element_size()])
    # the count filled on the device (torch.tensor(n, device=...) would copy from pageable memory: a wait)
    count = torch.full((), t.numel(), dtype=torch.int64, device=t.device)
    return torch.stack([t.sum(dtype=torch.int64), count])
