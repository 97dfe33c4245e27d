"""When a sequence ends: the model's end-of-sequence ids, and where a stop string first appears."""
from __future__ import annotations


def stop_cut(tokenizer, out: list[int], before: int, stops: list[str]) -> int | None:
    """Smallest token count > ``before`` whose text contains a stop string, or None."""
    if not any(s in tokenizer.decode(out, skip_special_tokens=True) for s in stops):
        return None
    for n in range(before + 1, len(out) + 1):
        text = tokenizer.decode(out[:n], skip_special_tokens=True)
        if any(s in text for s in stops):
            return n
    return len(out)


def eos_ids(model, tokenizer) -> set[int]:
    """Token ids that end a sequence: the generation config's and the tokenizer's EOS."""
    ids: set[int] = set()
    gc = getattr(model, "generation_config", None)
    for src in (getattr(gc, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif src:
            ids.update(int(t) for t in src)
    return ids
