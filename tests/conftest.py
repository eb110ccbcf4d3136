"""Shared pytest fixtures (keep small: helpers for one area live in their own module)."""

from __future__ import annotations

import os
import sys

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if TESTS_DIR not in sys.path:  # lets tests import helper modules such as byte_surgery
    sys.path.insert(0, TESTS_DIR)


@pytest.fixture
def pool():
    """A handle pool closed after the test (no leaked file descriptors)."""
    from qdelay.segments.segment import HandlePool

    p = HandlePool(16)
    yield p
    p.close()
