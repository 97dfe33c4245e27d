"""One history of answers for the whole job (``--share-history``), kept by the driver.

Each replica drafts from a :class:`~logitspec.spec_decode.history.HistorySource` of answers. With a shared
history,
a replica's finished batch reports its answers' token ids (``stats["answers"]``, see
:meth:`pipeline.replica.worker.RowGenerator.answers`); the driver keeps the newest ``max_tokens`` tokens of
them, and every batch it sends a replica carries the answers the *other* replicas produced since
that replica's previous batch (a new or replacement replica gets all that is kept). The driver
already talks to every replica once per batch, so this needs no extra actor, and a tensor-parallel
group's ranks receive the same answers with the same batch (their drafts stay identical). Answers
only feed drafts: outputs are the same with or without them.
"""
from __future__ import annotations

from collections import deque


class SharedHistory:
    """The job's newest answers (token ids), at most ``max_tokens`` tokens, with where each came from."""

    def __init__(self, max_tokens: int):
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self._answers: deque[tuple[int, str, list[int]]] = deque()  # (number, replica name, token ids)
        self._tokens = 0
        self._next = 0
        self._seen: dict[str, int] = {}  # replica name -> answers numbered below this were sent or its own
        self.stats = {"answers_in": 0, "answers_out": 0, "tokens_out": 0}

    def collect(self, name: str, answers: list[list[int]] | None) -> None:
        """Keep the answers replica ``name`` just produced (oldest first); drop the oldest beyond the
        budget."""
        for answer in answers or ():
            answer = list(answer)[-self.max_tokens:]
            self._answers.append((self._next, name, answer))
            self._next += 1
            self._tokens += len(answer)
            self.stats["answers_in"] += 1
        while self._tokens > self.max_tokens:
            self._tokens -= len(self._answers.popleft()[2])

    def for_replica(self, name: str) -> list[list[int]] | None:
        """The answers of other replicas that ``name`` has not been sent yet (oldest first), or None."""
        since = self._seen.get(name, 0)
        self._seen[name] = self._next
        out = [a for n, origin, a in self._answers if n >= since and origin != name]
        if not out:
            return None
        self.stats["answers_out"] += len(out)
        self.stats["tokens_out"] += sum(map(len, out))
        return out
