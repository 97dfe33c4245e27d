"""The job on a real multi-node Ray cluster (``ray.cluster_utils.Cluster``: a CPU-less head and two 1-CPU
worker nodes, each its own raylet and object store; one replica per node), under a seeded chaos schedule
(``chaos:SEED:DIR``, :mod:`pipeline.replica.faults`: SIGKILLs, a hang, out-of-memory errors mid-decode,
slow batches) while a worker node is removed abruptly mid-job and a fresh one joins 10 s later. The job
finishes; every row is written exactly once and equals its fault-free generation; a replica starts on the
new node and takes batches; the summary accounts for every fault (deaths: the kills and the hang injected,
and the lost node's replica; out-of-memory splits) and the log names the lost node and the rows redone;
memory stays flat through the run; the shared reference index is zero-copy on the new node."""
import json
import os
import subprocess
import sys
import time

import pytest
from conftest import REPO
from test_pipeline import _check_exactly_once, _fault_free, _write_jsonl
from tiny_models import save_tiny_text_model

pytestmark = [pytest.mark.slow, pytest.mark.ray]

ROWS = 240
CHAOS_SEED = 10  # over its 60 batches of 4: kills, the hang (batch 5), out-of-memory errors, slow batches


@pytest.fixture
def cluster(monkeypatch, tmp_path):
    from ray.cluster_utils import Cluster

    # the nodes' processes inherit this environment: this checkout importable, the job paced (each batch
    # takes 1.5 s more, so the fresh node joins while rows are left) under the chaos schedule
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("RAY_worker_niceness", "0")
    (tmp_path / "faults").mkdir()
    monkeypatch.setenv("LOGITSPEC_FAULT", f"slow:1.5+chaos:{CHAOS_SEED}:{tmp_path / 'faults'}")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    workers = [c.add_node(num_cpus=1) for _ in range(2)]
    c.wait_for_nodes()
    yield c, workers
    import ray

    ray.shutdown()
    c.shutdown()


def test_a_worker_node_lost_mid_job_and_a_new_one_joining(tmp_path, cluster):
    c, workers = cluster
    tiny = tmp_path / "tiny"
    save_tiny_text_model(tiny)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text((REPO / "data" / "sample_corpus" / "README.md").read_text()
                      if (REPO / "data" / "sample_corpus" / "README.md").exists()
                      else "the quick brown fox jumps over the lazy dog\n" * 50)
    inp = _write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": f"Row {i}: the quick brown fox jumps"}
                                               for i in range(ROWS)])
    out = tmp_path / "out"
    argv = ["--input", str(inp), "--output", str(out), "--model", str(tiny), "--address", c.address,
            "--actors", "2", "--cpus-per-actor", "1", "--threads-per-actor", "1", "--max-batch-size", "4",
            "--batch-rows", "4", "--part-rows", "8", "--max-new-tokens", "4", "--no-warmup",
            "--batch-timeout", "12", "--max-replacements", "12", "--reference", f"notes={corpus}"]
    # the driver in a process of its own, as `ray job submit` runs it; this thread plays the cluster
    log = tmp_path / "job.log"
    with open(log, "w") as fh:
        job = subprocess.Popen([sys.executable, str(REPO / "jobs" / "generate.py"), *argv], stdout=fh,
                               stderr=subprocess.STDOUT, cwd=REPO)
        deadline = time.monotonic() + 180
        while not list(out.glob("part-*.parquet")) and time.monotonic() < deadline and job.poll() is None:
            time.sleep(0.2)  # the first rows are written
        lost = workers[0]
        c.remove_node(lost, allow_graceful=False)
        time.sleep(10)
        fresh = c.add_node(num_cpus=1)
        code = job.wait(timeout=300)
    text = log.read_text()
    assert code == 0, text[-3000:]
    table = _check_exactly_once(out, list(range(ROWS)))
    summary = json.loads((out / "_summary.json").read_text())
    assert summary["complete"]
    faults = tmp_path / "faults"
    injected = {k: len(list(faults.glob(f"{k}-*"))) for k in ("kill", "hang", "oom", "fired-oom")}
    assert injected["kill"] >= 1 and injected["hang"] == 1 and injected["oom"] >= 1, injected
    reps = summary["replicas"]
    assert len(reps["lost"]) == reps["deaths"] and reps["replacements"] >= 1
    # every kill and the hang cost a replica of its own; a death on a node still up is one of them; the
    # others died with the lost node (its replica, and replacements placed on it before it was marked dead)
    chaos_deaths = injected["kill"] + injected["hang"]
    elsewhere = [d for d in reps["lost"] if d["node_id"] not in (None, lost.node_id)]
    # (<=: the lost node's replica may have been a kill's or the hang's victim already)
    assert len(elsewhere) <= chaos_deaths <= reps["deaths"], (reps["lost"], injected)
    assert sum("--batch-timeout" in d["error"] for d in reps["lost"]) <= injected["hang"]
    assert reps["batches_redone"] >= len(elsewhere)
    assert summary["engine"]["out_of_memory_splits"] <= injected["fired-oom"]
    rows = table.sort_by("id").to_pylist()
    assert all(r["error"] is None for r in rows)
    assert [r["generation"] for r in rows] == _fault_free(str(tiny), ROWS)
    through = summary["memory"]["through_run"]
    assert through["driver"]["max_bytes"] - through["driver"]["first_bytes"] < 200 * 2**20
    assert all(p["max_bytes"] - p["first_bytes"] < 64 * 2**20 for p in through["replica_processes"])
    lost_entry = next(d for d in reps["lost"] if d["node_id"] == lost.node_id)
    assert lost_entry["rows_redone"], lost_entry  # the batches it had in flight were redone
    assert f"on node {lost.node_id} died" in text and "rows redone:" in text
    on_fresh = [r for r in reps["startup"] if r["node_id"] == fresh.node_id]
    assert on_fresh, reps["startup"]  # a replica started on the node that joined
    assert f"on node {fresh.node_id}" in text
    memory = summary["memory"]
    fresh_mem = next(r for r in memory["replicas"] if r.get("node_id") == fresh.node_id)
    assert fresh_mem["reference_zero_copy"] and memory["reference_copies_per_node"] == 1
