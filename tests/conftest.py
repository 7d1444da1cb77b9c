"""Fixtures shared by the test modules."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="module")
def quiet_single_threaded() -> Iterator[None]:
    """One torch thread and Flower's log at WARNING for the module's tests.

    Tiny models on a shared 2-core machine: one torch thread is far faster,
    and the strategies' per-round INFO lines would drown the test output.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    yield
    torch.set_num_threads(threads)
