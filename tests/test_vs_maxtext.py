"""benchmarks/vs_maxtext.py, quickly: jaxtp's side only (MaxText is never installed here), tiny
sizes; the table, the census and the host-time column come out."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_vs_maxtext_smoke_runs_jaxtp_side_only(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAXTP_MAXTEXT_VENV"] = str(tmp_path / "no-maxtext")  # absent: never installed here
    r = subprocess.run(
        [sys.executable, "benchmarks/vs_maxtext.py", "--no-install", "--d-model", "64",
         "--layers", "2", "--heads", "8", "--d-ff", "128", "--seq", "32", "--batch", "8",
         "--steps", "3", "--warmup", "1", "--rounds", "1", "--layouts", "data=2 x model=4",
         "--out", str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    text = (tmp_path / "vs_maxtext.md").read_text()
    assert "MaxText not run" in text and "no MaxText venv" in text
    assert "| data=2 x model=4 |" in text
    assert "all-reduce over model" in text and "params: jaxtp 115008" in text
    assert "remat: jaxtp `parallel.remat=none`; MaxText `remat_policy=full`" in text
