"""Rows with different settings share a batch: greedy and sampled rows (their own temperature, top-p,
top-k, seed, token limit and stop strings) decode in one step, each row exactly as it decodes alone."""
import pytest
import torch
from tiny_models import hf_greedy, repetitive_prompts, tiny_model

from logitspec import Engine, SpecConfig
from logitspec.engine.request import Request
from logitspec.worker.head import ScreenedArgmax

pytestmark = [pytest.mark.skipif(not ScreenedArgmax.supported(torch.zeros(1, 1)),
                                 reason="no float16 kernels"),
              pytest.mark.usefixtures("one_thread")]  # one_thread: tests/conftest.py


class Letters:
    """A tokenizer for token-id prompts: token t reads as one letter (stop strings need a decode)."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + int(t) % 26) for t in ids)




def _requests(model, prompt) -> list[Request]:
    """Greedy, sampled three ways, and greedy with a stop string its answer contains."""
    text = Letters().decode(hf_greedy(model, prompt, 10))
    return [Request(max_new_tokens=10),
            Request.make(max_new_tokens=9, temperature=0.8, top_p=0.9, seed=5),
            Request.make(max_new_tokens=12, temperature=1.2, top_k=8, seed=11, n=2),
            Request.make(max_new_tokens=7, temperature=0.7, seed=3),
            Request(max_new_tokens=10, stop=(text[5:7],))]


def _check(model, method: str, **engine_kw):
    prompts = repetitive_prompts(5, seed=7)
    requests = _requests(model, prompts[4])
    cfg = dict(method=method, budget="fixed")
    alone = [r.token_ids for p, q in zip(prompts, requests)
             for r in Engine(model, Letters(), SpecConfig(**cfg), **engine_kw).generate([p], q)]
    batch = Engine(model, Letters(), SpecConfig(max_batch_size=4, **cfg), **engine_kw)
    mixed = batch.generate(prompts, requests)
    assert [r.token_ids for r in mixed] == alone
    assert mixed[0].token_ids == hf_greedy(model, prompts[0], 10)
    assert mixed[-1].finish_reason == "stop" and len(mixed[-1].token_ids) < 10
    assert all(len(r.token_ids) <= q.max_new_tokens for r, q in zip(mixed, requests[:3] + requests[2:]))
    return mixed


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("method", ["ar", "pld", "logitspec"])
def test_mixed_rows_decode_as_alone(family, method):
    mixed = _check(tiny_model(family), method)
    assert mixed[2].token_ids != mixed[3].token_ids  # a prompt's two samples differ


def test_mixed_rows_decided_where_the_logits_are():
    """The device path (every sampled node drawn, rows grouped by their settings) mixes rows too."""
    _check(tiny_model("llama"), "logitspec", sample_on_host=False)


def test_a_session_takes_each_request_as_it_comes():
    model = tiny_model("qwen2")
    prompts = repetitive_prompts(3, seed=2)
    requests = [Request.make(max_new_tokens=6, temperature=0.9, seed=1), Request(max_new_tokens=8)]
    eng = Engine(model, None, SpecConfig(method="logitspec", max_batch_size=3, budget="fixed"))
    session = eng.open(Request(max_new_tokens=8))
    ids = [session.submit(p, q) for p, q in zip(prompts[:2], requests)] + [session.submit(prompts[2])]
    got = {r.request_id: r.token_ids for r in session.drain()}
    alone = eng.generate([prompts[0]], requests[0])[0].token_ids
    assert got[ids[0]] == alone
    assert got[ids[1]] == hf_greedy(model, prompts[1], 8) and got[ids[2]] == hf_greedy(model, prompts[2], 8)
