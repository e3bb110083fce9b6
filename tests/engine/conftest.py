"""Fixtures of the engine tests."""
from __future__ import annotations

import signal

import pytest


@pytest.fixture
def python_ctrl_c():
    """Python's own Ctrl-C handler for the test, whatever the process inherited: a shell's background job starts
    with SIGINT ignored, and then interrupt_main does nothing."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)
