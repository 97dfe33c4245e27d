"""CUDA graph capture for the graph runner's steps (docs/gpu.md, "Graph runner")."""
from __future__ import annotations

import torch


class GraphPool:
    """Captures step functions in CUDA graphs on ``device`` that share one memory pool (the runner
    replays one step at a time, so their intermediates may share memory)."""

    def __init__(self, device: torch.device, warmup: int = 3):
        self.device, self.warmup = device, warmup
        self.pool = None

    def capture(self, fn):
        """``fn`` captured in a CUDA graph (``warmup`` calls on a side stream first); the graph's
        replay. The warm-up calls run the step for real (its writes are the replay's: idempotent)."""
        cur = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                fn()
        cur.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            fn()
        if self.pool is None:
            self.pool = graph.pool()
        return graph.replay
