"""Cost curves per device: the grid each device is measured on, the store keyed by device, and the
draft budget a flat (GPU-like) curve leads to against a steep (CPU-like) one."""
import json

import numpy as np
import pytest
import torch
from tiny_models import tiny_model

from logitspec.spec_decode.budget import CostCurve, choose_size
from logitspec.worker import calibrate
from logitspec.worker.eager_runner import EagerRunner

NODES = (1, 2, 4, 8, 16, 32, 64)


def _curve(base: float, per_token: float, rows=(8, 32, 64), knee: int = 0) -> CostCurve:
    """t = base * rows-factor + per_token * max(0, tokens - knee): flat up to ``knee`` tokens in the
    forward."""
    def t(b, n):
        return base * (1 + 0.02 * b) + per_token * max(0, b * n - knee)

    return CostCurve(NODES, [t(1, n) for n in NODES],
                     {b: {"tokens": NODES, "seconds": [t(b, n) for n in NODES]} for b in rows})


GPU_LIKE = _curve(20e-3, 2e-6, knee=512)  # an 8B-class forward: flat until hundreds of tokens
CPU_LIKE = _curve(30e-3, 4e-3)  # every token costs: a 64-node tree about 9x a plain step


def _probs(rows: int, n: int = 64, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [np.sort(np.cumprod(rng.uniform(0.3, 0.9, n)))[::-1] for _ in range(rows)]


@pytest.mark.parametrize("rows", [1, 8, 32, 64])
def test_a_flat_curve_leads_to_larger_trees(rows):
    probs = _probs(rows)
    gpu, cpu = choose_size(probs, GPU_LIKE, 64), choose_size(probs, CPU_LIKE, 64)
    assert gpu > cpu, (gpu, cpu)
    if rows <= 8:
        assert gpu >= 32  # flat to 512 tokens: big trees are nearly free
    assert cpu <= 4


def test_gpu_trees_shrink_only_past_the_flat_part():
    row = _probs(1)[0]
    sizes = [choose_size([row] * b, GPU_LIKE, 64) for b in (1, 8, 32, 64)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] >= 32 and sizes[-1] >= 1, sizes


def test_grid_depends_on_the_device():
    assert calibrate.grid_for("cpu") == calibrate.CPU_GRID
    g = calibrate.grid_for(torch.device("cuda"))  # only the device type is read: no GPU needed
    assert g.rows == (8, 32, 64) and g.per_row == NODES and g.max_tokens >= 64 * 64 and g.context >= 1024
    assert calibrate.rows_for(g, 1) == () and calibrate.rows_for(g, 4) == (8,)
    assert calibrate.rows_for(g, 16) == (8, 32) and calibrate.rows_for(g, 200) == (8, 32, 64)
    cpu = calibrate.CPU_GRID
    assert calibrate.rows_for(cpu, 8) == (4, 8) and calibrate.rows_for(cpu, 2) == (4,)


def test_measure_times_rows_and_nodes_per_row():
    target = EagerRunner(tiny_model("llama"))
    c = calibrate.measure(target, tokens=(1, 4), context=12, reps=1, warmup=0, batch_rows=(2, 3),
                          batch_tokens=(1, 2))
    assert c.tokens == [1, 4] and sorted(c.batches) == [2, 3]
    assert all(s > 0 for s in c.seconds) and c.batches[3].tokens == [1, 2]


def test_one_slow_forward_does_not_become_the_cost_of_its_size(monkeypatch):
    """Machine noise only adds time: a forward slowed by another process in one of the reps must
    not be taken for the cost of its size (with a median of two, it made a second token a row
    look free at 8 rows and the budget drafted at a loss)."""
    target = EagerRunner(tiny_model("llama"))
    real, calls = calibrate.elapsed, []

    def noisy(fn, device):  # the forward runs; its time is the test's (this machine's load is not)
        calls.append(1)
        real(fn, device)
        return 0.01 + (1.0 if len(calls) == 2 else 0.0)  # the first rep's 2-token forward: +1 s

    monkeypatch.setattr(calibrate, "elapsed", noisy)
    c = calibrate.measure_rows(target, 2, (1, 2), 12, reps=2, warmup=0)
    assert len(calls) == 4 and c.seconds == [0.01, 0.01]


def test_the_allocator_is_part_of_the_machine_key(monkeypatch):
    """A curve measured under the system allocator is not used under tcmalloc (cheaper steps here)."""
    monkeypatch.setattr(calibrate.allocator, "loaded", lambda: True)
    on = calibrate.machine_fingerprint("cpu")
    monkeypatch.setattr(calibrate.allocator, "loaded", lambda: False)
    assert calibrate.machine_fingerprint("cpu") != on and "tcmalloc" in on


def test_batch_curves_verify_the_models_own_continuation(monkeypatch):
    """Every curve verifies chains of the model's own continuation, and the stored curve's key says so."""
    target = EagerRunner(tiny_model("llama"))
    seen = []
    real = calibrate.measure_rows
    def spy(*a, own_chains=False, **k):
        seen.append(own_chains)
        return real(*a, own_chains=own_chains, **k)

    monkeypatch.setattr(calibrate, "measure_rows", spy)
    calibrate.measure(target, tokens=(1, 2), context=12, reps=1, warmup=0, batch_rows=(2,),
                      batch_tokens=(1, 2))
    assert seen and all(seen)
    assert "chains=own" in calibrate.kernel_fingerprint(target.model)


def test_an_edited_kernel_source_keys_a_new_curve(tmp_path, monkeypatch):
    """A stored curve measured with other kernel code (an edited csrc file) is not reused."""
    from logitspec.kernels import skinny

    model = tiny_model("llama")
    before = calibrate.kernel_fingerprint(model)
    assert f"kernels={skinny.sources_digest()}" in before
    edited = tmp_path / "screen.cpp"
    edited.write_bytes(skinny._OTHER_SOURCES[1].read_bytes() + b"// edited\n")
    sources = skinny._OTHER_SOURCES
    monkeypatch.setattr(skinny, "_OTHER_SOURCES", (*sources[:1], edited, *sources[2:]))
    assert calibrate.kernel_fingerprint(model) != before


def test_store_is_keyed_by_device_and_covers_the_batch(tmp_path, monkeypatch):
    monkeypatch.setenv("LOGITSPEC_CACHE", str(tmp_path))
    # this test counts what is stored: a 1-rep curve of a tiny model's sub-millisecond forwards may
    # fail the speed control by jitter alone (the control has a test of its own)
    monkeypatch.setattr(calibrate, "SETTLED", float("inf"))
    model = tiny_model("qwen2")
    model.config._name_or_path = "tiny-curve-test"
    target = EagerRunner(model)
    path = calibrate.curve_path(model, head=target.head)
    assert path.parent == tmp_path / "calibration"
    model_half = tiny_model("qwen2").to(torch.bfloat16)
    model_half.config._name_or_path = "tiny-curve-test"
    assert calibrate.curve_path(model_half) != path  # dtype is part of the key, like the device
    assert "cpus" in calibrate.machine_fingerprint("cpu")
    calls = []
    real = calibrate.measure
    def counting(*a, **k):
        calls.append(k["batch_rows"])
        return real(*a, **{**k, "reps": 1})

    monkeypatch.setattr(calibrate, "measure", counting)
    calibrate.load_or_measure(target, 1)
    calibrate.load_or_measure(target, 1)  # stored
    calibrate.load_or_measure(target, 3)  # the stored curve has no batch curve: measured again
    calibrate.load_or_measure(target, 4)  # covered by the 4-row curve
    assert calls == [(), (4,)]
    doc = json.loads(path.read_text())
    # a curve from an older, smaller grid
    doc["batches"]["4"] = {"tokens": [1, 2, 3], "seconds": [0.1, 0.2, 0.3]}
    path.write_text(json.dumps(doc))
    calibrate.load_or_measure(target, 4)  # lacks the grid's 4 and 6 tokens a row: measured again
    assert calls == [(), (4,), (4,)]


def test_batch_rows_share_one_prefill_and_the_head_is_measured_apart():
    """The rows of a batch measurement are copies of one prefilled row with their own committed
    lengths: a step on them equals the same step on rows prefilled apart."""
    from logitspec.worker.kv_cache import BatchKV
    from logitspec.worker.masks import StepRow

    target = EagerRunner(tiny_model("llama"))
    toks = [(7 * i + 3) % target.vocab_size for i in range(20)]
    lengths = [12, 20, 16]
    tiled, _ = target.prefill(toks, chunk=20)
    tiled.repeat_row(lengths)
    apart = BatchKV()
    for n in lengths:
        apart.add_row(target.prefill(toks[:n], chunk=n)[0])
    step = [StepRow.chain(n, [5, 6]) for n in lengths]
    a = target(step, tiled, all_logits=True).nodes.scores
    b = target(step, apart, all_logits=True).nodes.scores
    assert torch.allclose(a, b, atol=1e-5) and tiled.lengths == lengths
    c = calibrate.measure(target, tokens=(1, 2), context=8, reps=1, warmup=0, batch_rows=(2,),
                          batch_tokens=(1,))
    assert c.head is not None and c.head.tokens[0] == 1 and all(s > 0 for s in c.head.seconds)
    assert calibrate.measure(target, tokens=(1,), context=8, reps=1, warmup=0, batch_rows=()).head is None


def test_columns_read_follow_the_windows_and_their_cost_is_measured():
    gemma = EagerRunner(tiny_model("gemma3"))  # sliding window 6 on all but every 6th layer
    kinds = gemma.model.config.layer_types
    full = sum(k == "full_attention" for k in kinds)
    assert gemma.read_columns(100) == pytest.approx((full * 100 + (len(kinds) - full) * 6) / len(kinds))
    assert gemma.read_columns(4) == 4
    llama = EagerRunner(tiny_model("llama"))
    assert llama.read_columns(300) == 300
    ctx = calibrate.measure_columns(llama, 16, 200, reps=1, warmup=0, nodes=4)
    assert ctx["columns"] == 16 and ctx["per_column"] >= 0


def test_a_noisy_curve_is_made_monotone_in_tokens_and_rows():
    """A point measured below a smaller one (noise) is raised to it, so the budget never takes
    noise for free drafting; points already in order are kept."""
    batches = {4: {"tokens": [1, 2], "seconds": [0.06, 0.09]},
               16: {"tokens": [1, 2], "seconds": [0.20, 0.17]},  # 16 x 2 "cheaper" than 16 x 1
               32: {"tokens": [1, 2], "seconds": [0.19, 0.29]}}  # 32 x 1 "cheaper" than 16 x 1
    curve = CostCurve([1, 2, 4], [0.05, 0.04, 0.07], batches=batches,
                      head={"tokens": [1, 8], "seconds": [0.014, 0.012]},
                      context={"per_column": 1e-7, "columns": 256})
    m = curve.monotone()
    assert m.seconds == [0.05, 0.05, 0.07]
    assert m.batches[4].seconds == [0.06, 0.09]
    assert m.batches[16].seconds == [0.20, 0.20]
    assert m.batches[32].seconds == [0.20, 0.29]
    assert m.head.seconds == [0.014, 0.014] and m.context == curve.context
    assert m.step(24, 2) >= m.step(24, 1)


def test_one_row_is_measured_on_the_models_own_continuation():
    """The one-row curve verifies a chain that reads like text to the model: an arbitrary first
    token, then the model's greedy continuation (as stock ``generate`` gives it); the measured
    cache is left as it was (lengths, columns, and the next forward's output)."""
    from logitspec.worker.masks import StepRow

    model = tiny_model("llama")
    target = EagerRunner(model)
    context = [(7 * i + 3) % target.vocab_size for i in range(20)]
    with torch.inference_mode():
        kv, _ = target.prefill(context, chunk=8)
        kv.repeat_row([20, 14])
        probe = [StepRow.chain(n, [5]) for n in kv.lengths]
        before = target(probe, kv, all_logits=True).nodes.scores
        kv.commit([[], []])
        chains = calibrate.own_continuations(target, kv, 6)
        assert kv.lengths == [20, 14] and kv.columns == 20
        torch.testing.assert_close(target(probe, kv, all_logits=True).nodes.scores, before, rtol=0, atol=0)
        kv.commit([[], []])
        for row, n in enumerate((20, 14)):
            ids = torch.tensor([context[:n] + [chains[row][0]]])
            out = model.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False)
            want = out[0, n + 1:].tolist()
            assert chains[row][1:] == want
    with pytest.raises(ValueError, match="cannot truncate"):
        kv.truncate([21, 14])


def test_a_grid_measured_while_the_machine_was_slow_is_measured_again_and_not_stored(tmp_path, monkeypatch):
    """The control forward after a grid catches a machine whose speed changed during the measurement
    (another job's burst made one stored curve 15x slow): the grid is measured again, each point's
    fastest kept; a curve that never settles is used but not stored; in a group, rank 0's decides."""
    model = tiny_model("llama")
    model.config._name_or_path = "tiny-settle-test"
    target = EagerRunner(model)
    real_rows, grids = calibrate.measure_rows, []
    slow_grids = [0]  # how many grids run slow (their controls never do)

    def rows(target, n, tokens, *a, **k):
        c = real_rows(target, n, tokens, *a, **k)
        if tuple(tokens) == (1,) and grids:  # the grid measures (1, 4): this is the control
            return c
        grids.append(1)
        slow = len(grids) <= slow_grids[0]
        return CostCurve(c.tokens, [t + (5.0 if slow else 0.0) for t in c.seconds])

    monkeypatch.setattr(calibrate, "measure_rows", rows)
    monkeypatch.setattr(calibrate, "measure_columns", lambda *a, **k: None)
    kw = dict(tokens=(1, 4), context=12, reps=1, warmup=0, batch_rows=(), batch_tokens=())
    assert calibrate.measure(target, **kw).settled
    grids.clear()
    slow_grids[0] = 1  # the first grid slow
    c = calibrate.measure(target, **kw)
    assert c.settled and len(grids) == 2 and max(c.seconds) < 1.0  # measured again: the fast points kept
    grids.clear()
    slow_grids[0] = 10 ** 6  # every grid slow, every control fast
    unsettled = calibrate.measure(target, **kw)
    assert not unsettled.settled and len(grids) == calibrate.ATTEMPTS
    # a tensor-parallel group acts on rank 0's speed change (agree): here rank 0 saw none, so this
    # process measures once too, whatever its own control said (the forwards are collective)
    grids.clear()
    agreed = []
    assert calibrate.measure(target, **kw, agree=lambda d: agreed.append(d) or 1.0).settled
    assert len(grids) == 1 and len(agreed) == 1 and agreed[0] < 0.5  # its own control: much faster
    monkeypatch.setattr(calibrate, "measure", lambda *a, **k: unsettled)
    monkeypatch.setenv("LOGITSPEC_CACHE", str(tmp_path))  # (after the forwards: the kernels stay built)
    assert calibrate.load_or_measure(target, 1) is unsettled
    assert not calibrate.curve_path(model, head=target.head).exists()  # used, not stored
