"""The device check's decode-step parts (scripts/gpu_check_steps.py) and its summary
(scripts/gpu_check_summary.py) on CPU: the HF reference step decodes as HF ``generate`` does, with no
host wait, on the path HF takes while a CUDA stream captures; the summary has every key the device
check promises."""
import json
import sys

import pytest
import torch
from conftest import REPO
from tiny_models import hf_greedy, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(REPO / "scripts"))
import gpu_check_steps  # noqa: E402
import gpu_check_summary  # noqa: E402

# the ops whose results the host reads (each a wait for the device on CUDA, and not capturable)
HOST_READS = ("_local_scalar_dense", "nonzero", "is_nonzero", "equal")


class HostReads(TorchDispatchMode):
    """Records every op that reads a tensor's value on the host."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(k in func.__name__ for k in HOST_READS):
            self.seen.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("capturing", [False, True])
def test_the_hf_reference_step_decodes_as_generate_and_reads_nothing_on_the_host(capturing, monkeypatch):
    """Each call of the step decodes one more token in place (the replayed graph's contract); HF
    takes other mask paths while a CUDA stream captures (``is_tracing``), so both are run."""
    import transformers.utils.import_utils as hf_utils

    model = tiny_model("llama", attn="sdpa")
    prompts = gpu_check_steps.token_prompts(2, 12, model.config.vocab_size)
    with torch.inference_mode():
        step, token = gpu_check_steps.hf_step(model, 2, 12, room=16)
        got = [token.clone()]
        monkeypatch.setattr(hf_utils, "is_cuda_stream_capturing", lambda: capturing)
        with HostReads() as reads:
            for _ in range(7):
                step()
                got.append(token.clone())
    assert reads.seen == []
    tokens = torch.cat(got, 1).tolist()
    assert tokens == [hf_greedy(tiny_model("llama"), p, 8) for p in prompts]


def test_the_summary_has_every_promised_key_from_the_parts_files(tmp_path):
    ar = {b: {"ms": ms, "timed_run": {"captures": 0}, "host_waits": {"per_step": 1.0}}
          for b, ms in (("1", 6.0), ("32", 9.0))}
    parts = {
        "ar_steps": {"greedy": ar, "sampled": {b: {**v, "ms": v["ms"] * 1.1} for b, v in ar.items()}},
        "hf_graph": {"ms": {"1": 8.2, "32": 9.8}},
        "graph_timing": {"goals": {"tree16_x_b1": 1.1, "tree16_x_b8": 1.2, "tree8_x_b32": 1.5,
                                   "tree4_x_b64": 1.7},
                         "attention": {"sdpa": {"repeat": {"captures": 0}}}},
        "prefill_8k": {"engine_s": 0.4},
        "graph_lossless": {"ok": True, "cases": [{"equal": 3, "of": 3, "ok": True},
                                                 {"skipped": True, "equal": 0, "of": 0, "ok": True}]}}
    for name, doc in parts.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
    summary = gpu_check_summary.write({"parts": {n: {"error": None} for n in parts}}, tmp_path, 0.0)
    assert set(gpu_check_summary.SUMMARY_KEYS) <= set(summary)
    assert json.loads((tmp_path / "summary.json").read_text())["ar_ms_b32"] == 9.0
    assert summary["sampled_x_greedy_b1"] == summary["sampled_x_greedy_b32"] == 1.1
    assert (summary["hf_graph_ms_b1"], summary["prefill_8k_s"], summary["tree4_x_b64"]) == (8.2, 0.4, 1.7)
    assert (summary["lossless_equal"], summary["lossless_total"]) == (3, 3)
    assert summary["replay"] is None and "replay" in summary["replay_note"]
    assert summary["captures_after_start"] == 0 and summary["graph_host_waits_per_step"] == 1.0
    # a figure not measured is None with its reason beside it
    assert summary["kernels_per_step"] is None
    assert summary["nulls"]["kernels_per_step"] == "counted on CUDA only"
    assert "replay" in summary["nulls"]["replay"] and "ar_ms_b1" not in summary["nulls"]
    (tmp_path / "replay.json").write_text(json.dumps({"replay": {"trace": {"logitspec": {"x_ar": 2.5}}}}))
    summary = gpu_check_summary.write({"parts": {}}, tmp_path, 0.0)
    assert summary["replay"] == {"trace": {"logitspec": {"x_ar": 2.5}}} and summary["replay_note"] is None


def test_the_ar_case_times_steady_steps_and_sums_the_wait_counter_over_them_only(monkeypatch):
    """A warm-up run, then the timed run of the same shapes: nothing built or captured in it. The host
    wait counter (CUDA's sync debug mode, which counts nothing on a CPU) is replaced by one that reports
    one wait each time it is entered: the case enters it once per steady step and no other time, and
    reports the sum and the mean per step. That the counter sees real waits is for the device check."""
    import contextlib
    from collections import Counter

    from logitspec import Engine, SpecConfig
    from logitspec.engine.request import Request
    from logitspec.worker.gpu import GraphRunner

    @contextlib.contextmanager
    def one_wait(device):
        yield Counter({"acceptance.py:131": 1})

    monkeypatch.setattr(gpu_check_steps, "count_host_waits", one_wait)
    model = tiny_model("qwen2")
    runner = GraphRunner(model, max_rows=2, max_len=128, key_block=32)
    engine = Engine(model, None, SpecConfig(method="ar", max_batch_size=2), runner=runner)
    prompts = gpu_check_steps.token_prompts(2, 10, model.config.vocab_size)
    request = Request.make(max_new_tokens=8, **gpu_check_steps.SAMPLED)
    with torch.inference_mode():
        case = gpu_check_steps.ar_case(engine, runner, prompts, request)
    steady = case["steady_steps"]
    assert steady >= 5 and case["ms"] >= case["ms_min"] > 0
    assert {k: case["timed_run"][k] for k in ("graphs", "captures", "allocations")} == dict.fromkeys(
        ("graphs", "captures", "allocations"), 0)
    where = {"acceptance.py:131": steady}
    assert case["host_waits"] == {"total": steady, "per_step": 1.0, "by_location": where}
