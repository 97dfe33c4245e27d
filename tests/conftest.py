import os
import pathlib

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

REPO = pathlib.Path(__file__).resolve().parents[1]
SPEC_BENCH = REPO.parent / "shared" / "data" / "spec_bench" / "question.jsonl"


@pytest.fixture
def one_thread():
    """Tiny models gain nothing from threads (on a busy 2-core box 2 threads ran them far slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_collection_modifyitems(config, items):
    if os.environ.get("LOGITSPEC_SKIP_SLOW"):
        skip = pytest.mark.skip(reason="LOGITSPEC_SKIP_SLOW set")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip)
