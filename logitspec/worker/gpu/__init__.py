"""The GPU decode path: static KV slots, step inputs in static buffers, one CUDA graph per shape
bucket (docs/gpu.md, "Graph runner"). Everything here also runs on CPU, eagerly, for the tests."""
from logitspec.worker.gpu.choice import default_runner, runner_for
from logitspec.worker.gpu.graph_runner import GraphRunner
from logitspec.worker.gpu.greedy import greedy_chains
from logitspec.worker.gpu.slots import SlotKV, SlotLayer
from logitspec.worker.gpu.step import NODE_BUCKETS, ROW_BUCKETS, bucket

__all__ = ["GraphRunner", "default_runner", "runner_for", "SlotKV", "SlotLayer", "greedy_chains", "bucket",
           "ROW_BUCKETS", "NODE_BUCKETS"]
