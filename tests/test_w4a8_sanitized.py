"""``make test-asan`` runs the kernel tests on a library built with AddressSanitizer and UBSan
(SPECDEC_W4A8_SANITIZE=1). These tests say that run means something: the library it loads is the
instrumented one, and a kernel handed a buffer one row short is stopped by ASan (the negative
control: the same call with the right buffer passes). Without SPECDEC_W4A8_SANITIZE they skip."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from shared.engines.w4a8.build import find

pytestmark = pytest.mark.skipif(not os.environ.get("SPECDEC_W4A8_SANITIZE"),
                                reason="SPECDEC_W4A8_SANITIZE is not set (make test-asan)")

# rms_norm of n rows of d floats into a buffer of `rows_out` rows; exit 0 when it returns.
CALL = """
import ctypes, sys
import numpy as np
from shared.engines.w4a8.build import library
n, d, rows_out = 4, 512, int(sys.argv[1])
x = np.ones((n, d), np.float32)
w = np.ones(d, np.float32)
out = np.empty((rows_out, d), np.float32)
ptr = lambda a: ctypes.c_void_p(a.ctypes.data)
status = library().w4a8_rms_norm(ptr(x), ptr(w), ctypes.c_float(1e-6), n, d, ptr(out))
sys.exit(status)
"""


def test_the_library_loaded_is_the_instrumented_one() -> None:
    found, reasons = find()
    assert found is not None, reasons
    assert b"__asan_report_store4" in found.read_bytes(), found


def run_norm(rows_out: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", CALL, str(rows_out)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_a_kernel_writing_past_its_buffer_is_stopped_and_the_right_buffer_passes() -> None:
    intact = run_norm(4)
    assert intact.returncode == 0, intact.stderr[-2000:]
    short = run_norm(3)
    assert short.returncode != 0
    assert "AddressSanitizer: heap-buffer-overflow" in short.stderr, short.stderr[-2000:]
