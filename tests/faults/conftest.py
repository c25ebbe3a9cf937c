"""The fault corpus's shared fixture: a local Ray instance of this module's own."""

from __future__ import annotations

import logging

import pytest
import ray


@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
    yield
    ray.shutdown()
