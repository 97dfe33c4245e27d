"""One host wait per steady decoding step on the device path: counted on CPU by treating the model's
parameters as device memory (tests/device_reads.py), with the graph runner and acceptance on the
device, as on a GPU (a float16 model: the CPU-only output-layer screens stay out)."""
from collections import Counter

import pytest
import torch
from device_reads import DeviceReads
from tiny_models import repetitive_prompts, tiny_model

from logitspec import Engine, SpecConfig
from logitspec.engine.request import Request
from logitspec.worker.gpu import GraphRunner

ROWS = 3


def steady_step_reads(method: str, budget: str, request: Request, sample_on_host: bool = False,
                      decide: bool = False) -> tuple[int, Counter]:
    """Steady steps (every row decoding, nothing waiting to start) of a session, and the host's
    reads of device values in them, by code line. ``decide``: greedy steps decided inside the step."""
    model = tiny_model("gemma3").to(torch.float16)
    cfg = SpecConfig(method=method, budget=budget, capacity=8, max_batch_size=ROWS)
    runner = GraphRunner(model, max_rows=ROWS, max_len=256, decide_top=cfg.top_k + 1 if decide else None)
    engine = Engine(model, None, cfg, runner=runner, sample_on_host=sample_on_host)
    session = engine.open()
    for p in repetitive_prompts(ROWS, seed=11):
        session.submit(p, request)
    # the device memory: the parameters, the KV slots and every bucket's static buffers (built now, as
    # on CUDA at start-up); one counter for the whole session, so values a step leaves on the device
    # (the slots it writes, its decision) stay marked when a later step reads them
    buffers = [runner._buffers_for(R, T) for R in runner.row_buckets for T in runner.node_buckets[:5]]
    seeds = [t for b in buffers for t in (b.ints, b.anc, b.hidden, b.decision) if t is not None]
    steps, reads = 0, Counter()
    slots = [runner.kv.K, runner.kv.V, *(t for layer in runner.kv.layer_views for t in layer)]
    with DeviceReads(model.parameters(), slots, seeds) as counted:
        while session.busy:
            steady = len(session.active) == ROWS and not (session.pending or session.ready
                                                          or session.prefilling)
            before = Counter(counted.reads)
            session.step()
            if steady:
                steps += 1
                reads += counted.reads - before
    assert not decide or runner.counters["decided"] == runner.counters["replays"] > 0
    return steps, reads


@pytest.mark.parametrize("method,budget", [("ar", "fixed"), ("pld", "fixed"), ("logitspec", "fixed"),
                                           ("logitspec", "auto"), ("lookahead", "fixed")])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_steady_step_waits_for_the_device_once(method, budget, temperature):
    """Drafting, packing, the forward, acceptance and the KV commit of a steady step read one device
    value on the host: the decision's single transfer (the next step's drafts need it)."""
    request = Request.make(max_new_tokens=20, temperature=temperature, seed=1)
    steps, reads = steady_step_reads(method, budget, request)
    assert steps >= 5
    assert sum(reads.values()) == steps, reads
    assert set(reads) == {next(iter(reads))} and next(iter(reads)).startswith("tolist acceptance.py")


@pytest.mark.parametrize("method", ["ar", "logitspec", "lookahead"])
def test_a_step_decided_in_the_step_waits_once(method):
    """Greedy steps decided inside the graph runner's step: the one read is the decision's transfer."""
    steps, reads = steady_step_reads(method, "fixed", Request.make(max_new_tokens=20), decide=True)
    assert steps >= 5 and sum(reads.values()) == steps, reads
    assert set(reads) == {next(iter(reads))} and next(iter(reads)).startswith("tolist acceptance.py")


def test_the_count_sees_host_reads():
    """The counter is not blind: sampled rows walked on the host (the CPU engine's way) read the
    device's logits node by node, several times a step."""
    request = Request.make(max_new_tokens=20, temperature=0.8, seed=1)
    steps, reads = steady_step_reads("logitspec", "fixed", request, sample_on_host=True)
    assert steps >= 5 and sum(reads.values()) > 2 * steps


def test_flex_attentions_block_lists_are_rewritten_without_reading_the_device():
    """The engine's CUDA attention rewrites each row's block lists from the device buffers inside the
    step: no host read (flex attention's own CPU reference traces itself, so the whole step is counted
    with SDPA above)."""
    model = tiny_model("gemma3")
    runner = GraphRunner(model, max_rows=2, max_len=256, attention="flex")
    buf = runner._buffers_for(2, 8)
    buf.lens.copy_(torch.tensor([40, 7]))
    masks = runner._flex[(2, 8)]
    with DeviceReads([buf.ints, buf.anc, buf.lens]) as counted:
        kinds = masks.update()
    assert counted.total == 0 and set(kinds) == set(runner.windows)
    bm = next(iter(kinds.values()))
    assert int(bm.kv_num_blocks[0, 0, 0]) == 1  # row 0: 40 + 8 columns, one 128-column block
