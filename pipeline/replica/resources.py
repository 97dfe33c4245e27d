"""What a replica is to the rest of the job, and what it can say about its own memory.

:class:`Replica` is the interface the scheduler and the job use (one actor,
:class:`pipeline.replica.actor.ActorReplica`, or a tensor-parallel group,
:class:`pipeline.replica.tp.TPReplica`);
:class:`ReplicaResources` is what each of its actors asks Ray for. The memory readers run inside a
replica's process (Linux ``/proc/self``): :func:`process_memory` splits its resident memory into private
and shared pages, :func:`where_bytes_live` says which kind of mapping holds given arrays (a private
anonymous copy, a shared mapping such as the Ray object store, a file mapping, or a device).
"""
from __future__ import annotations

import bisect
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

# keys read from /proc/self/status and /proc/self/smaps_rollup (sizes in kB there, bytes here)
_STATUS_KEYS = ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM")
_ROLLUP_KEYS = ("Rss", "Pss", "Shared_Clean", "Shared_Dirty", "Private_Clean", "Private_Dirty")


@dataclass(frozen=True)
class ReplicaResources:
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    threads: int = 1  # torch intra-op threads in the replica's process(es)


class Replica(Protocol):
    """One model replica: one actor, or a tensor-parallel group of actors."""

    name: str
    concurrent: bool  # its tasks in flight run together (a death may be any one's), not one after another

    def ready(self) -> ray.ObjectRef:  # noqa: F821
        """Resolves to an info dict (pids, load times, memory) once the replica can take rows; fails if it
        dies."""

    def submit(self, rows: list, history: list[list[int]] | None = None) -> ray.ObjectRef:  # noqa: F821
        """Resolves to ``(output rows, batch stats)``; raises ``RayActorError`` if the replica dies.
        ``history``: other replicas' answers to add to its draft history first (``--share-history``)."""

    def info(self) -> ray.ObjectRef:  # noqa: F821
        """Resolves to the info dict with the replica's memory now; fails if it died."""

    def kill(self) -> None:
        """Stop the replica's process(es) now."""


def _read_kb(path: str, keys) -> dict:
    out = {}
    with open(path) as fh:
        for line in fh:
            k, _, v = line.partition(":")
            if k in keys:
                out[k] = int(v.split()[0]) * 1024
    return out


def process_memory() -> dict:
    """Resident memory of this process, in bytes.

    From ``/proc/self/status``: ``VmRSS``, ``RssAnon`` (anonymous pages), ``RssFile``, ``RssShmem``
    (shared memory, e.g. the Ray object store), ``VmHWM`` (the peak). From ``/proc/self/smaps_rollup``:
    ``Pss`` (resident pages, each shared one divided among the processes mapping it: summing it over
    processes counts a shared page once), ``private_bytes`` (pages only this process maps) and
    ``shared_bytes`` (pages other processes map too). Off Linux: ``VmRSS`` alone.
    """
    try:
        out = _read_kb("/proc/self/status", _STATUS_KEYS)
    except OSError:  # not Linux
        import psutil

        return {"VmRSS": psutil.Process().memory_info().rss}
    try:
        roll = _read_kb("/proc/self/smaps_rollup", _ROLLUP_KEYS)
    except OSError:  # kernels before 4.14
        return out
    out["Pss"] = roll.get("Pss")
    out["private_bytes"] = roll.get("Private_Clean", 0) + roll.get("Private_Dirty", 0)
    out["shared_bytes"] = roll.get("Shared_Clean", 0) + roll.get("Shared_Dirty", 0)
    return out


def resident_bytes() -> int | None:
    """This process's resident memory now (``/proc/self/statm``: one small read, cheap enough for every
    task); None off Linux."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def peak_rss() -> int | None:
    """VmHWM: this process's peak resident memory so far (the load peak, when read right after loading)."""
    try:
        return _read_kb("/proc/self/status", ("VmHWM",)).get("VmHWM")
    except OSError:
        return None


def _mappings() -> tuple[list[int], list[tuple[int, str]]]:
    """Start addresses (sorted) and ``(end, kind)`` of this process's mappings; kind: ``private``
    (anonymous, copy-on-write: only this process's), ``shared`` (MAP_SHARED: shared memory, the object
    store) or ``file`` (a private file mapping: the page cache's pages until written)."""
    starts, rest = [], []
    with open("/proc/self/maps") as fh:
        for line in fh:
            parts = line.split(None, 5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            perms, inode = parts[1], parts[4]
            kind = "shared" if perms[3] == "s" else ("private" if inode == "0" else "file")
            starts.append(lo)
            rest.append((hi, kind))
    return starts, rest


def where_bytes_live(spans: Iterable[tuple[int, int, str]]) -> dict:
    """Bytes by the kind of memory holding them: ``{"private", "shared", "file", "device", "unknown"}``.

    ``spans``: ``(address, nbytes, device)`` of arrays or tensors; the same address counts once (tied
    weights). Arrays on a ``cuda`` device count as ``device``; host addresses are looked up in
    ``/proc/self/maps``; ``unknown`` where that cannot be read or holds no such address."""
    out = dict.fromkeys(("private", "shared", "file", "device", "unknown"), 0)
    try:
        starts, rest = _mappings()
    except OSError:
        starts, rest = [], []
    seen = set()
    for addr, nbytes, device in spans:
        if (addr, device) in seen or not nbytes:
            continue
        seen.add((addr, device))
        if device.startswith("cuda"):
            out["device"] += nbytes
            continue
        i = bisect.bisect_right(starts, addr) - 1
        out[rest[i][1] if i >= 0 and addr < rest[i][0] else "unknown"] += nbytes
    return out


def tensor_spans(tensors) -> list[tuple[int, int, str]]:
    """``(address, nbytes, device)`` of torch tensors (e.g. a model's parameters and buffers)."""
    return [(t.data_ptr(), t.numel() * t.element_size(), str(t.device)) for t in tensors]


def array_spans(arrays) -> list[tuple[int, int, str]]:
    """``(address, nbytes, "cpu")`` of numpy arrays."""
    return [(a.__array_interface__["data"][0], a.nbytes, "cpu") for a in arrays]
