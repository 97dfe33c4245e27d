"""cluster.yaml: a valid Ray cluster-launcher config that can run jobs/generate.py on GPUs."""
import json
import pathlib
import re

import pytest
import yaml

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cluster():
    return yaml.safe_load((REPO / "cluster.yaml").read_text())


def test_matches_rays_launcher_schema(cluster):
    jsonschema = pytest.importorskip("jsonschema")
    ray = pytest.importorskip("ray")
    schema = json.loads((pathlib.Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    jsonschema.validate(cluster, schema)
    # the launcher's own checks beyond the schema
    types = cluster["available_node_types"]
    assert cluster["head_node_type"] in types
    assert "cluster_synced_files" in cluster
    assert sum(t.get("min_workers", 0) for t in types.values()) <= cluster["max_workers"]


def test_has_gpu_workers_and_a_gpu_free_head(cluster):
    types = cluster["available_node_types"]
    head = types[cluster["head_node_type"]]
    assert not head.get("resources", {}).get("GPU")  # replicas (--gpus-per-actor) never land on the head
    gpu = [t for name, t in types.items()
           if name != cluster["head_node_type"] and t.get("resources", {}).get("GPU", 0) >= 1]
    assert gpu and all(t.get("max_workers", 0) > 0 for t in gpu)
    assert all(re.match(r"^(g4dn|g5|g6|p3|p4d|p5)\.", t["node_config"]["InstanceType"]) for t in gpu)


def test_installs_this_project_and_the_same_ray(cluster):
    ray = pytest.importorskip("ray")
    mounts = cluster["file_mounts"]
    remote = [r for r, local in mounts.items() if (REPO / local).resolve() == REPO]
    assert remote, "the repo root is copied to the nodes"
    cmds = cluster["setup_commands"]
    assert any("pip install" in c and f"-e {remote[0]}" in c for c in cmds), "pip install -e <the checkout>"
    assert any(f"ray[default,data]=={ray.__version__}" in c for c in cmds), "cluster Ray == local Ray"
    assert any("torch" in c and "pip install" in c for c in cmds)
    assert (REPO / "jobs" / "generate.py").is_file()  # what `ray job submit ... python jobs/generate.py` runs
    assert ".venv" in cluster["rsync_exclude"]


def test_starts_a_head_with_the_job_server_and_joins_workers(cluster):
    head = " ".join(cluster["head_start_ray_commands"])
    assert "ray start --head" in head and "--dashboard-host=0.0.0.0" in head  # `ray job submit` talks to it
    assert "ray start --address=$RAY_HEAD_IP:6379" in " ".join(cluster["worker_start_ray_commands"])
