"""The GPU decode path: static KV slots, step inputs in static buffers, one CUDA graph per shape
bucket (docs/gpu.md, "Graph runner"). Everything here also runs on CPU, eagerly, for the tests."""
from .runner import GraphRunner, default_runner, greedy_chains
from .slots import SlotKV, SlotLayer
from .step import NODE_BUCKETS, ROW_BUCKETS, bucket

__all__ = ["GraphRunner", "default_runner", "SlotKV", "SlotLayer", "greedy_chains", "bucket", "ROW_BUCKETS",
           "NODE_BUCKETS"]
