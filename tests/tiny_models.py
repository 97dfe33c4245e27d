"""Tiny random models of each supported family, built from configs (no downloads)."""
import json
import pathlib

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from logitspec.worker.attention import NAME as ATTENTION

REPO = pathlib.Path(__file__).resolve().parents[1]
VOCAB = 96
_NO_SPECIAL = dict(eos_token_id=None, bos_token_id=None, pad_token_id=None)


def tiny_model(family: str, seed: int = 0, attn: str = ATTENTION, **overrides):
    """A tiny random model of ``family`` with the engine's attention (``attn``), as ``load_model`` gives."""
    torch.manual_seed(seed)
    if family == "llama":
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, **_NO_SPECIAL)
        cls = LlamaForCausalLM
    elif family == "qwen2":
        cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, **_NO_SPECIAL)
        cls = Qwen2ForCausalLM
    elif family == "gemma3":
        # sliding window far smaller than the sequences below, so the window wraps
        cfg = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=1, head_dim=8, sliding_window=6,
                               **_NO_SPECIAL)
        cls = Gemma3ForCausalLM
    else:
        raise ValueError(family)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    model = cls(cfg).eval()
    model.set_attn_implementation(attn)
    # sharpen the random logits so greedy ties (float noise) are vanishingly rare
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model


FAMILIES = ("llama", "qwen2", "gemma3")


def repetitive_prompts(n: int, seed: int = 0, lengths=(5, 9, 14, 20, 27, 33, 8, 12)):
    """Token-id prompts with repeated spans, so retrieval has something to find."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        L = lengths[i % len(lengths)]
        base = torch.randint(0, VOCAB, (max(3, L // 2),), generator=g).tolist()
        out.append((base * 3)[:L])
    return out


def stock_copy(model):
    """A model of ``model``'s class and weights as transformers alone builds it: its SDPA attention and
    its own modules, nothing the engine swapped in."""
    cfg = type(model.config).from_dict(model.config.to_dict())
    stock = type(model)(cfg).eval()
    stock.load_state_dict(model.state_dict())
    stock.set_attn_implementation("sdpa")
    assert not [m for m in stock.modules() if type(m).__module__.startswith("logitspec")]
    return stock


def hf_greedy(model, prompt, n):
    """``n`` tokens of stock HF generate (greedy) on a stock copy of ``model``."""
    with torch.no_grad():
        out = stock_copy(model).generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                                         do_sample=False)
    return out[0, len(prompt):].tolist()


def save_tiny_text_model(path, hidden: int = 32, heads: int = 2, kv_heads: int = 1, max_positions: int = 128,
                         chat_template: bool = True) -> None:
    """Save a tiny random Llama with a byte-level BPE tokenizer (512 tokens) trained on the sample
    corpus to ``path``: text in, text out, as the job expects. Its output layer is sharpened so that
    greedy ties (float noise) become vanishingly rare."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    texts = [p.read_text() for p in sorted((REPO / "data" / "sample_corpus").rglob("*.txt"))]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<pad>", "<eos>", "<bos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>")
    if chat_template:
        fast.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                              "{% if add_generation_prompt %}<assistant>{% endif %}")
    cfg = LlamaConfig(vocab_size=len(fast), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=max_positions, bos_token_id=2, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    model.save_pretrained(path)
    fast.save_pretrained(path)


def write_two_questions(path) -> pathlib.Path:
    """A Spec-Bench ``question.jsonl`` of two one-turn questions (qa, rag) whose text repeats itself."""
    rows = [(1, "qa", "the quick brown fox jumps over the lazy dog, the quick brown fox"),
            (2, "rag", "four score and seven years ago four score and seven years ago")]
    path = pathlib.Path(path)
    path.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [t]}) + "\n"
                            for i, c, t in rows))
    return path
