"""Every experiment runs on CPU and agrees with its paper (STYLE.md test layer 4)."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_megatron_census_quick(tmp_path):
    proc = subprocess.run(
        [sys.executable, "experiments/megatron_census.py", "--quick", "--out", str(tmp_path)],
        cwd=REPO, env=dict(os.environ), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "megatron_census.md").is_file()
    assert (tmp_path / "megatron_census.png").is_file()


def test_zero_memory_quick(tmp_path):
    """Exits non-zero unless the paper's 7.5B example reproduces and every stage's measured
    persistent bytes, gradient bytes and data-axis volume are within 2% of the formulas."""
    proc = subprocess.run(
        [sys.executable, "experiments/zero_memory.py", "--quick", "--out", str(tmp_path)],
        cwd=REPO, env=dict(os.environ), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| 3 | 1.88 | 1.88 | True |" in proc.stdout
    assert (tmp_path / "zero_memory_quick.md").is_file()
    assert (tmp_path / "zero_memory_quick.png").is_file()


def test_activation_memory_quick(tmp_path):
    """Exits non-zero unless the attention, MLP and (without SP) residual terms of the measured
    saved activations equal the adapted Korthikanti formula."""
    proc = subprocess.run(
        [sys.executable, "experiments/activation_memory.py", "--quick", "--out", str(tmp_path)],
        cwd=REPO, env=dict(os.environ), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "activation_memory_quick.md").is_file()
    assert (tmp_path / "activation_memory_quick.png").is_file()
