"""Shared fixtures: one local Ray instance for the whole session, data file writers."""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))


@pytest.fixture(scope="session")
def ray_local():
    """A real local Ray with 2 CPUs, shared by every integration test (start-up is slow)."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield ray
    ray.shutdown()


@pytest.fixture()
def storage(tmp_path):
    return str(tmp_path / "runs")
