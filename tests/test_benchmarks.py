"""The benchmarks still run, and the baseline they compare against computes jaxtp's loss.
(No timing is asserted here: speed lives in benchmarks/, read from its results.)"""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_throughput_smoke(tmp_path):
    proc = subprocess.run(
        [sys.executable, "benchmarks/throughput.py", "--shape", "tiny", "--steps", "1",
         "--rounds", "1", "--warmup", "0", "--layouts", "model=4, explicit", "pipeline",
         "--out", str(tmp_path)],
        cwd=REPO, env=dict(os.environ), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads((tmp_path / "throughput.json").read_text())
    assert r["parity"] < 1e-5  # the plain baseline and jaxtp's reference: same loss
    measured = [row for row in r["rows"] if row["status"] == "measured"]
    assert not [row for row in r["rows"] if row["status"] == "error"]
    assert len(measured) >= 2 and all(row["step_s"] > 0 for row in measured)
    assert (tmp_path / "throughput.md").is_file() and (tmp_path / "throughput.png").is_file()
