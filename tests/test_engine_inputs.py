"""Bad input fails fast with a clear ValueError, before any forward pass."""
import pytest
from tiny_models import tiny_model

from logitspec import Engine, SpecConfig


@pytest.fixture(scope="module")
def engine():
    model = tiny_model("llama")
    calls = []
    for module in model.modules():  # every layer: the engine runs the inner decoder, not the top module
        module.register_forward_pre_hook(lambda *a: calls.append(1))
    eng = Engine(model, None, SpecConfig(method="logitspec", budget="fixed"))
    eng.forward_calls = calls
    return eng


@pytest.mark.parametrize("kwargs,match", [
    (dict(prompts=[[]]), "empty prompt"),
    (dict(prompts=[[1, 2], "text"]), "no tokenizer"),
    (dict(prompts=[[1] * 5000]), "context"),
    (dict(prompts=[[1, 2]], max_new_tokens=0), "max_new_tokens"),
    (dict(prompts=[[1, 2]], temperature=-0.5), "temperature"),
    (dict(prompts=[[1, 2]], top_p=0.0), "top_p"),
    (dict(prompts=[[1, 999]]), "token ids"),
    (dict(prompts=[None]), "None"),
    (dict(prompts=[3.5]), "prompt must be"),
])
def test_bad_input_raises_before_forward(engine, kwargs, match):
    n = len(engine.forward_calls)
    with pytest.raises(ValueError, match=match):
        engine.generate(**kwargs)
    assert len(engine.forward_calls) == n


def test_the_forward_counter_sees_the_engine_forward(engine):
    """The control for the test above: a good prompt's generation is counted."""
    n = len(engine.forward_calls)
    engine.generate([[1, 2, 3]], max_new_tokens=2)
    assert len(engine.forward_calls) > n


def test_unknown_method_and_bad_config():
    with pytest.raises(ValueError, match="unknown method"):
        SpecConfig(method="medusa")
    with pytest.raises(ValueError, match="max_batch_size"):
        SpecConfig(max_batch_size=0)


def test_sampling_is_seeded_and_batch_independent():
    model = tiny_model("qwen2")
    prompts = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12], [3, 3, 3]]
    kw = dict(max_new_tokens=16, temperature=1.0, top_p=0.9, seed=[11, 12, 13, 14])
    solo = [Engine(model, None, SpecConfig(method="logitspec")).generate([p],
                                                                         **{**kw, "seed": [s]})[0].token_ids
            for p, s in zip(prompts, kw["seed"])]
    batched = Engine(model, None, SpecConfig(method="logitspec", max_batch_size=3)).generate(prompts, **kw)
    assert [r.token_ids for r in batched] == solo
    again = Engine(model, None, SpecConfig(method="ar", max_batch_size=2)).generate(prompts, **kw)
    # one uniform draw per emitted token in both methods: same seeds, same tokens (up to float noise)
    assert sum(a.token_ids == b for a, b in zip(again, solo)) >= 3
    other = Engine(model, None, SpecConfig(method="logitspec")).generate(prompts,
                                                                         **{**kw, "seed": [1, 2, 3, 4]})
    assert [r.token_ids for r in other] != solo
