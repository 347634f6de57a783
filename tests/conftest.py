"""Fixtures for the layernorm test-suite (shared helpers are in helpers.py)."""

import pytest

import layernorm


@pytest.fixture
def restore_runtime():
    """Put back the SIMD level and thread count, which are process-global, after the test."""
    level = layernorm.simd_level()
    threads = layernorm.get_num_threads()
    yield
    layernorm.set_simd_level(level)
    layernorm.set_num_threads(threads)
