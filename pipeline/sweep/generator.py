"""Rows of a sweep -> one output row per (row, configuration), on one loaded model. No Ray here.

A :class:`SweepGenerator` holds one engine per configuration of the grid, all over the same model,
and runs every configuration a row still needs back to back on the batch it is given, so each row's
prompt is read, encoded and (with a shared prefix cache) prefilled on one replica for all of them.
"""
from __future__ import annotations

import logging
import time

from logitspec.engine.request import Request

from ..replica.resources import peak_rss
from ..rows import SweepInputRow, SweepOutputRow
from .config import SweepConfig

log = logging.getLogger("pipeline.sweep.generator")


def row_id(key: str, config: str) -> str:
    """The output id of a row under one configuration."""
    return f"{key}|{config}"


def sweep_error_row(row: SweepInputRow, config: SweepConfig, error: str,
                    n_prompt_tokens: int | None = None) -> SweepOutputRow:
    e = row.example
    return SweepOutputRow(id=row_id(e.key, config.name), key=e.key, dataset=e.dataset,
                          example_id=e.example_id,
                          config=config.name, method=config.method, n_prompt_tokens=n_prompt_tokens,
                          truncated=e.truncated, error=error)


def ok_row(row: SweepInputRow, config: SweepConfig, res, share_s: float, n_run: int,
           peak: int | None) -> SweepOutputRow:
    """The output row of one example's :class:`~logitspec.engine.engine.GenerationResult` under ``config``."""
    e, s = row.example, res.stats
    return SweepOutputRow(
        id=row_id(e.key, config.name), key=e.key, dataset=e.dataset, example_id=e.example_id,
        config=config.name,
        method=config.method, generation=res.text, token_ids=list(res.token_ids),
        finish_reason=res.finish_reason,
        n_prompt_tokens=len(res.prompt_token_ids), n_new_tokens=len(res.token_ids), steps=s["steps"],
        mean_accepted=s["mean_accepted"], prefill_s=s["prefill_s"], row_wall_s=s["wall_s"],
        cached_prompt_tokens=s["cached_prompt_tokens"],
        run_share_s=share_s,
        run_rows=n_run, peak_rss_bytes=peak, truncated=e.truncated, max_step_gap_s=s["max_step_gap_s"])


class SweepGenerator:
    """Generates every configuration a row asks for (``row.configs``), configuration by configuration.

    ``engines``: ``{config name: Engine}`` over one model; ``configs``: the :class:`SweepConfig` of each.
    Greedy decoding only: the sweep compares methods that must give the same text.
    """

    def __init__(self, engines: dict, configs: dict[str, SweepConfig]):
        self.engines = engines
        self.configs = configs

    def __call__(self, rows: list[SweepInputRow], history: None = None) -> tuple[list[SweepOutputRow], dict]:
        """(output rows, batch stats): for each row, one output row per name in its ``configs``.
        ``history``: the job's shared answers, which a sweep never has (its configurations must not
        see each other's outputs)."""
        if history:
            raise ValueError("an evaluation sweep shares no history between replicas")
        t0 = time.perf_counter()
        out: list[SweepOutputRow] = []
        encoder = next(iter(self.engines.values()))
        encoded: dict[str, list[int]] = {}
        for r in rows:
            try:
                encoded[r.id] = encoder.encode(r.example.prompt, apply_chat_template=r.example.chat)
            except ValueError as e:
                out += [sweep_error_row(r, self.configs[c], str(e)) for c in r.configs]
        runs = {}
        for name, config in self.configs.items():  # configurations back to back on this batch
            todo = [r for r in rows if name in r.configs and r.id in encoded]
            for group in _groups(todo):
                t = time.perf_counter()
                out += self._run(config, group, [encoded[r.id] for r in group])
                runs[name] = runs.get(name, 0.0) + time.perf_counter() - t
        return out, {"wall_s": time.perf_counter() - t0, "rows": len(rows), "config_s": runs}

    def _run(self, config: SweepConfig, rows: list[SweepInputRow],
             ids: list[list[int]]) -> list[SweepOutputRow]:
        """One ``Engine.run`` of ``rows`` under ``config`` (rows one by one if the batch raises)."""
        engine = self.engines[config.name]
        r0 = rows[0]
        try:
            run = engine.run(ids, Request(max_new_tokens=r0.example.max_new_tokens, stop=r0.example.stop))
        except Exception as e:  # noqa: BLE001 - isolate the failing row(s)
            if len(rows) == 1:
                return [sweep_error_row(r0, config, f"{type(e).__name__}: {e}", len(ids[0]))]
            log.warning("%s: batch of %d rows failed (%s); retrying them one by one", config.name, len(rows),
                        e)
            return [o for r, i in zip(rows, ids) for o in self._run(config, [r], [i])]
        peak = peak_rss()
        share = run.stats["wall_s"] / len(rows)
        return [ok_row(r, config, res, share, len(rows), peak) for r, res in zip(rows, run.results)]


def _groups(rows: list[SweepInputRow]) -> list[list[SweepInputRow]]:
    """Rows split by what ``Engine.run`` takes once per call (new tokens, stop strings), in order."""
    groups: dict[tuple, list[SweepInputRow]] = {}
    for r in rows:
        groups.setdefault((r.example.max_new_tokens, r.example.stop), []).append(r)
    return list(groups.values())
