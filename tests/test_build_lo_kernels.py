"""scripts/build_lo_kernels.py: what it says when it cannot build (its builds are `lo_cuda.build`'s,
tested in test_lo_cuda.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "build_lo_kernels.py"


def test_a_missing_source_is_one_line_and_exit_2(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "nope.cu"), "--arch", "90"],
                          capture_output=True, text=True, check=False)  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"build_lo_kernels: no such source: {tmp_path / 'nope.cu'}"]
    assert done.stdout == ""
