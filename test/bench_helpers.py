"""What the benchmarks' tests share: one torch thread while a benchmark runs."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    """One torch thread, here and in child processes (a node the benchmark starts): on a busy
    2-core machine two OpenMP threads per process spin against each other and the tiny model
    gets ~10x slower. Autouse in every module that imports it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    yield
    torch.set_num_threads(threads)
