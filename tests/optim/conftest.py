"""Optimizer tests run single-threaded: torch's fused CPU AdamW starts its thread pool on
every call, which on a small shared machine costs far more than the update itself.
Results do not depend on the thread count (split points are aligned; see buckets.py)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
