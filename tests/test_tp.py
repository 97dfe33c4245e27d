"""Tensor parallelism (DeepSpeed AutoTP, gloo, CPU): TP=2 decodes exactly like one process, the ranks
agree step by step, and a group that loses a rank is replaced without losing or duplicating rows.

The first run on a machine compiles DeepSpeed's shm all-reduce op (about a minute, cached in
``~/.cache/logitspec/torch_extensions``); see docs/tensor_parallel.md.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pathlib
import queue
import signal
import subprocess
import sys
import time
import traceback

import pytest
import torch

from logitspec import Engine, SpecConfig
from logitspec.distributed import PeerWatchdog, decisions_digest, free_port, rank_env
from logitspec.models import load_model
from tiny_models import repetitive_prompts, tiny_model

REPO = pathlib.Path(__file__).resolve().parents[1]
TP = 2
NEW = 24
# (method, temperature): greedy must equal one process; sampled must agree across ranks
CASES = (("ar", 0.0), ("logitspec", 0.0), ("pld", 0.0), ("logitspec", 0.8))


@pytest.fixture(scope="module")
def comm_op():
    from logitspec.distributed import build_comm_op

    return build_comm_op()  # the one-time compile happens here, not inside every rank


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    """Tiny random Llama (heads split evenly) and Gemma 3 (one KV head, sliding window 6: AutoTP keeps
    attention whole on rank 0, and cache surgery runs on sliding layers) saved as HF dirs."""
    root = tmp_path_factory.mktemp("tp_models")
    out = {}
    for fam in ("llama", "gemma3"):
        # MLP 128 wide: AutoTP splits it in 64-column units, so a 64-wide one would stay whole on rank 0
        tiny_model(fam, seed=3, intermediate_size=128).save_pretrained(root / fam)
        out[fam] = str(root / fam)
    return out


def _layer_params(model) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if ".layers." in n)


def _record(results):
    return [(list(r.token_ids), r.finish_reason, list(r.stats["accepted_lengths"])) for r in results]


def _generate(make, case, prompts):
    method, temp = case
    engine = make(SpecConfig(method=method, max_batch_size=3))
    return engine.generate(prompts, max_new_tokens=NEW, temperature=temp, seed=[11 + i for i in range(len(prompts))])


def _spmd_rank(rank: int, world: int, port: int, model_dirs: dict, prompts, results_q) -> None:
    """One rank: join the group, load its shard of each model, decode every case."""
    try:
        from logitspec.distributed import check_agreement, init_rank, load_tp_model, make_engine

        init_rank(rank, world, port, threads=1)
        out = {}
        for fam, path in model_dirs.items():
            model, tok = load_tp_model(path, world)
            for case in CASES:
                res = _generate(lambda cfg: make_engine(model, tok, cfg), case, prompts)
                check_agreement(decisions_digest(res))
                out[(fam,) + case] = _record(res)
            out[(fam, "params")] = _layer_params(model)
            out[(fam, "consensus")] = model.logitspec_consensus.stats()
        results_q.put((rank, out, None))
    except BaseException:  # noqa: BLE001 - report to the parent, which fails the test
        results_q.put((rank, None, traceback.format_exc()))


def run_group(world: int, fn, *args, timeout: float = 600.0) -> dict:
    """Run ``fn(rank, world, port, *args, q)`` in ``world`` spawned processes; {rank: result}."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=fn, args=(r, world, port, *args, q), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    got, deadline = {}, time.monotonic() + timeout
    try:
        while len(got) < world:
            try:
                rank, out, err = q.get(timeout=max(1.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"group timed out after {timeout:.0f} s; ranks done: {sorted(got)}") from None
            assert err is None, f"rank {rank} failed:\n{err}"
            got[rank] = out
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return got


def test_rank_env():
    env = rank_env(1, 2, 29555)
    assert env == {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_SIZE": "2",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555"}
    with pytest.raises(ValueError):
        rank_env(2, 2, 1)


def test_peer_watchdog_fires_on_peer_death():
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    seen = []
    dog = PeerWatchdog([peer.pid], on_death=seen.append, poll_s=0.05)
    time.sleep(0.3)
    assert seen == []
    peer.kill()  # the peer stays a zombie until reaped: the watchdog must still see it as dead
    deadline = time.monotonic() + 5
    while not seen and time.monotonic() < deadline:
        time.sleep(0.05)
    dog.stop()
    peer.wait()
    assert seen == [peer.pid]


def test_tp2_processes_equal_one_process(comm_op, tiny_dirs):
    """Two plain processes (no Ray): greedy TP=2 == one process for ar/pld/logitspec on both families,
    and both ranks take the same decisions at every step (tokens, accepted length per step), sampled too."""
    prompts = repetitive_prompts(5, seed=4)
    t0 = time.perf_counter()
    ranks = run_group(TP, _spmd_rank, tiny_dirs, prompts)
    tp_s = time.perf_counter() - t0
    for fam, path in tiny_dirs.items():
        model, tok = load_model(path)
        full = _layer_params(model)
        assert ranks[0][(fam, "params")] < full and ranks[1][(fam, "params")] < full  # really sharded
        for case in CASES:
            key = (fam,) + case
            assert ranks[0][key] == ranks[1][key], f"ranks diverged on {key}"
            if case[1] == 0.0:
                ref = _record(_generate(lambda cfg: Engine(model, tok, cfg), case, prompts))
                assert [r[0] for r in ranks[0][key]] == [r[0] for r in ref], f"TP=2 != TP=1 on {key}"
                assert all(len(r[0]) == NEW for r in ref)
        if fam == "llama":  # speculation really happened (more than one token per step somewhere)
            assert any(max(r[2]) > 1 for r in ranks[0][(fam, "logitspec", 0.0)])
        assert ranks[0][(fam, "consensus")]["forwards"] > 100
        print(f"\n{fam}: rank 0 consensus {ranks[0][(fam, 'consensus')]}")
    print(f"TP=2 group (spawn, load, {len(CASES)} cases x 2 models): {tp_s:.1f} s")


def test_batch_kv_zero_head_layers():
    """A rank that holds no attention head (Gemma 3's single KV head under AutoTP sits on rank 0) has
    [rows, 0, cols, dim] cache tensors: rows, columns and commits must still be tracked."""
    from logitspec.cache import BatchKV

    def prefilled(n):
        kv = BatchKV()
        kv.lengths = [0]
        kv.hf.update(torch.zeros(1, 0, n, 8), torch.zeros(1, 0, n, 8), 0)
        kv.lengths = [n]
        return kv

    kv = prefilled(5)
    kv.add_row(prefilled(3))
    assert kv.columns == 5 and kv.hf.layers[0].keys.shape == (2, 0, 5, 8)
    kv.hf.update(torch.zeros(2, 0, 4, 8), torch.zeros(2, 0, 4, 8), 0)  # a step of 4 nodes per row
    kv.commit([[5, 7], [6]])
    assert kv.lengths == [7, 4] and kv.columns == 7
    kv.keep_rows([1])
    assert kv.hf.layers[0].keys.shape == (1, 0, 4, 8)
