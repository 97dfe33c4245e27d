import os
import pathlib

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

REPO = pathlib.Path(__file__).resolve().parents[1]
SPEC_BENCH = REPO.parent / "shared" / "data" / "spec_bench" / "question.jsonl"


def pytest_collection_modifyitems(config, items):
    if os.environ.get("LOGITSPEC_SKIP_SLOW"):
        skip = pytest.mark.skip(reason="LOGITSPEC_SKIP_SLOW set")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip)
