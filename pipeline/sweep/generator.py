"""Rows of a sweep -> one output row per (row, configuration), on one loaded model. No Ray here.

A :class:`SweepGenerator` holds one engine per configuration of the grid, all over the same model,
and runs every configuration a row still needs back to back on the batch it is given, so each row's
prompt is read, encoded and (with a shared prefix cache) prefilled on one replica for all of them.
"""
from __future__ import annotations

import logging
import time

import pyarrow as pa

from ..replica.resources import peak_rss
from .config import SweepConfig

log = logging.getLogger("pipeline.sweep.generator")


def row_id(key: str, config: str) -> str:
    """The output id of a row under one configuration."""
    return f"{key}|{config}"


def sweep_schema() -> pa.Schema:
    return pa.schema([
        ("id", pa.string()), ("sample", pa.int32()),  # sample: always 0 (the batch job's output key is (id, sample))
        ("key", pa.string()), ("dataset", pa.string()), ("example_id", pa.string()),
        ("config", pa.string()), ("method", pa.string()), ("generation", pa.string()),
        ("token_ids", pa.list_(pa.int32())), ("finish_reason", pa.string()), ("n_prompt_tokens", pa.int32()),
        ("n_new_tokens", pa.int32()), ("steps", pa.int32()), ("mean_accepted", pa.float64()),
        ("prefill_s", pa.float64()), ("row_wall_s", pa.float64()), ("run_share_s", pa.float64()),
        ("run_rows", pa.int32()), ("peak_rss_bytes", pa.int64()), ("truncated", pa.bool_()),
        ("error", pa.string()),
        ("max_step_gap_s", pa.float64()),  # the longest time between two of the row's forwards
    ])


def sweep_error_row(row: dict, config: SweepConfig, error: str, n_prompt_tokens: int | None = None) -> dict:
    out = dict.fromkeys(sweep_schema().names)
    out.update(id=row_id(row["key"], config.name), sample=0, key=row["key"], dataset=row["dataset"],
               example_id=row["example_id"], config=config.name, method=config.method,
               n_prompt_tokens=n_prompt_tokens, truncated=row.get("truncated"), error=error)
    return out


def _ok_row(row: dict, config: SweepConfig, res, share_s: float, n_run: int, peak: int | None) -> dict:
    s = res.stats
    return {"id": row_id(row["key"], config.name), "sample": 0, "key": row["key"], "dataset": row["dataset"],
            "example_id": row["example_id"], "config": config.name, "method": config.method,
            "generation": res.text, "token_ids": list(res.token_ids), "finish_reason": res.finish_reason,
            "n_prompt_tokens": len(res.prompt_token_ids), "n_new_tokens": len(res.token_ids),
            "steps": s["steps"], "mean_accepted": s["mean_accepted"], "prefill_s": s["prefill_s"],
            "row_wall_s": s["wall_s"], "run_share_s": share_s, "run_rows": n_run, "peak_rss_bytes": peak,
            "truncated": row.get("truncated"), "error": None, "max_step_gap_s": s["max_step_gap_s"]}


class SweepGenerator:
    """Generates every configuration a row asks for (``row["configs"]``), configuration by configuration.

    ``engines``: ``{config name: Engine}`` over one model; ``configs``: the :class:`SweepConfig` of each.
    Greedy decoding only: the sweep compares methods that must give the same text.
    """

    def __init__(self, engines: dict, configs: dict[str, SweepConfig]):
        self.engines = engines
        self.configs = configs

    def __call__(self, rows: list[dict]) -> tuple[list[dict], dict]:
        """(output rows, batch stats): for each row, one output row per name in its ``configs``."""
        t0 = time.perf_counter()
        out: list[dict] = []
        encoder = next(iter(self.engines.values()))
        encoded: dict[str, list[int]] = {}
        for r in rows:
            try:
                encoded[r["key"]] = encoder.encode(r["prompt"], apply_chat_template=r.get("chat", False))
            except ValueError as e:
                out += [sweep_error_row(r, self.configs[c], str(e)) for c in r["configs"]]
        runs = {}
        for name, config in self.configs.items():  # configurations back to back on this batch
            todo = [r for r in rows if name in r["configs"] and r["key"] in encoded]
            for group in _groups(todo):
                t = time.perf_counter()
                out += self._run(config, group, [encoded[r["key"]] for r in group])
                runs[name] = runs.get(name, 0.0) + time.perf_counter() - t
        return out, {"wall_s": time.perf_counter() - t0, "rows": len(rows), "config_s": runs}

    def _run(self, config: SweepConfig, rows: list[dict], ids: list[list[int]]) -> list[dict]:
        """One ``Engine.run`` of ``rows`` under ``config`` (rows one by one if the batch raises)."""
        engine = self.engines[config.name]
        r0 = rows[0]
        try:
            run = engine.run(ids, max_new_tokens=r0["max_new_tokens"], stop=list(r0["stop"]) or None)
        except Exception as e:  # noqa: BLE001 - isolate the failing row(s)
            if len(rows) == 1:
                return [sweep_error_row(r0, config, f"{type(e).__name__}: {e}", len(ids[0]))]
            log.warning("%s: batch of %d rows failed (%s); retrying them one by one", config.name, len(rows), e)
            return [o for r, i in zip(rows, ids) for o in self._run(config, [r], [i])]
        peak = peak_rss()
        share = run.stats["wall_s"] / len(rows)
        return [_ok_row(r, config, res, share, len(rows), peak) for r, res in zip(rows, run.results)]


def _groups(rows: list[dict]) -> list[list[dict]]:
    """Rows split by what ``Engine.run`` takes once per call (new tokens, stop strings), in order."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["max_new_tokens"], tuple(r["stop"])), []).append(r)
    return list(groups.values())
