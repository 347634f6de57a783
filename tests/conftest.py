"""Fixtures for the layernorm test-suite (shared helpers are in helpers.py)."""

import pytest

import layernorm


@pytest.fixture
def restore_runtime():
    """Put back the SIMD level, thread count and result cache limit, which are process-global,
    after the test."""
    level = layernorm.simd_level()
    threads = layernorm.get_num_threads()
    cache = layernorm.result_cache_info()["max_bytes"]
    yield
    layernorm.set_simd_level(level)
    layernorm.set_num_threads(threads)
    layernorm.set_result_cache(cache)
