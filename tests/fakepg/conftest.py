"""Fixtures for large-model planning tests (no process group needed; models live on the ``meta`` device)."""

from __future__ import annotations


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "slow: plans a multi-billion-parameter model (seconds each); "
                                       "deselect with -m 'not slow'")
