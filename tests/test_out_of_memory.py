"""A step that runs out of memory: the replica's worker splits the batch in halves and retries, down to one
prompt; a prompt that does not fit alone becomes error rows naming its size; the others equal plain
generation. The fault is injected at the model-runner seam (``pipeline.replica.faults.OutOfMemoryAt``), on
the per-task path (``RowGenerator``) and the streaming one (``StreamingRows``)."""
import pytest
from job_specs import job_spec
from tiny_models import save_tiny_text_model

from logitspec import Engine
from logitspec.models import load_model
from logitspec.worker.eager_runner import EagerRunner
from logitspec.worker.gpu import GraphRunner
from pipeline.replica.faults import OutOfMemoryAt
from pipeline.replica.streaming import StreamingRows
from pipeline.replica.worker import RowGenerator, is_out_of_memory
from pipeline.rows import InputRow

LONG = " ".join(["the lighthouse keeper counted his telescopes again"] * 3)  # about 80 tokens


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-text-llama")
    save_tiny_text_model(path)
    return load_model(str(path))


def _rows():
    prompts = ["Hello there", "Lorem ipsum dolor", LONG, "The quick brown fox", "Once upon a time"]
    return [InputRow(i, p) for i, p in enumerate(prompts)]


class CountingRunner(OutOfMemoryAt):
    """Records the rows of every forward it is asked for (prefills and steps), and whether it failed."""

    def __init__(self, runner, rows, tokens, at="before", steps_only=False):
        super().__init__(runner, rows, tokens, at, steps_only)
        self.forwards = []

    def _check(self, rows, positions):
        self.forwards.append((rows, rows > self.rows or positions > self.tokens))
        super()._check(rows, positions)


def _generator(model, tok, runner=None):
    spec = job_spec(max_new_tokens=6, max_batch_size=4, budget="fixed", warmup=False)
    return RowGenerator(Engine(model, tok, spec.engine, runner=runner), spec)


@pytest.mark.parametrize("path", ["per-task", "streaming"])
def test_out_of_memory_halves_the_batch_and_a_row_too_big_alone_is_an_error_row(tiny, path):
    model, tok = tiny
    plain, _ = _generator(model, tok)(_rows())
    runner = CountingRunner(EagerRunner(model), rows=1, tokens=40)
    gen = _generator(model, tok, runner)
    out, _ = gen(_rows()) if path == "per-task" else StreamingRows(gen)(_rows())
    assert [r.id for r in out] == [r.id for r in plain]  # every row once, in order
    long = out[2]
    assert long.generation is None and long.error.startswith("out of memory: the prompt's")
    assert f"{long.n_prompt_tokens} tokens + 6 new x 1 sample(s), about " in long.error
    assert "MiB of KV cache" in long.error
    assert "MemoryError" in long.error
    for got, want in zip(out[:2] + out[3:], plain[:2] + plain[3:]):
        assert got.error is None and got.generation == want.generation  # retried rows: as generated plainly
    assert (4, True) in runner.forwards and (1, False) in runner.forwards  # 4 rows failed, single rows ran


@pytest.mark.parametrize("kind,at", [("eager", "after"), ("eager", "layer:1"), ("graph", "before"),
                                     ("graph", "after"), ("graph", "layer:1")])
def test_out_of_memory_anywhere_in_a_forward_on_either_runner_retries_losslessly(tiny, kind, at):
    """The fault in a decode step (rows mid-generation), before the forward, after it wrote its KV
    (slots, cache), or from inside it at a decoder layer, through the eager runner or the graph runner
    (its static slots): the retried rows equal plain generation, the row too big alone is an error row,
    and the graph runner's storage was neither grown nor replaced (its slots are its memory: one
    allocation), nor did an out-of-memory step switch a flex bucket to SDPA."""
    model, tok = tiny
    plain, _ = _generator(model, tok)(_rows())
    # the graph runner with the engine's CUDA attention: an out-of-memory step is not a flex failure
    inner = (EagerRunner(model) if kind == "eager"
             else GraphRunner(model, max_rows=4, max_len=256, attention="flex"))
    runner = CountingRunner(inner, rows=1, tokens=40, at=at, steps_only=True)
    gen = _generator(model, tok, runner)
    for _ in range(2):  # a second batch after the first's faults: the replica still works
        out, _ = gen(_rows())
        assert [r.id for r in out] == [r.id for r in plain] and out[2].error.startswith("out of memory")
        for got, want in zip(out[:2] + out[3:], plain[:2] + plain[3:]):
            assert got.error is None and got.generation == want.generation
    assert (4, True) in runner.forwards  # a step of the whole batch failed
    if kind == "graph":
        assert inner.kv.allocations == 1 and inner.counters["flex_fallbacks"] == 0


def test_a_batch_that_fits_in_halves_is_split_once(tiny):
    """Two rows at a time fit: a 4-row batch that runs out of memory runs as two halves, no single rows."""
    model, tok = tiny
    runner = CountingRunner(EagerRunner(model), rows=2, tokens=100)
    rows = [r for r in _rows() if r.prompt != LONG]
    out, _ = _generator(model, tok, runner)(rows)
    assert all(r.error is None for r in out)
    assert runner.forwards[0] == (4, True)  # the 4-row prefill ran out of memory
    assert (2, False) in runner.forwards and all(not failed for _, failed in runner.forwards[1:])


def test_out_of_memory_is_recognised_and_other_errors_are_not():
    assert is_out_of_memory(MemoryError("x"))
    assert is_out_of_memory(RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: "
                                         "can't allocate memory: you tried to allocate 123 bytes"))
    assert is_out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(ValueError("out of range"))
