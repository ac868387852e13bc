"""The README's Python API examples run as written (small sizes)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*args, timeout=300):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_custom_loop_then_score_the_saved_run(tmp_path):
    out = _run("examples/custom_loop.py", "--steps", "20", "--save", str(tmp_path / "run"))
    losses = [float(line.split("loss")[1].split()[0]) for line in out.splitlines()
              if line.startswith("step")]
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.5, out
    scored = _run("examples/score_text.py", "--run", str(tmp_path / "run"),
                  "--layout", "parallel.data=8", "--layout", "parallel.model=1",
                  "import numpy as np", "qzxj vbnw")
    bits = [float(line.split()[0]) for line in scored.splitlines()]
    assert len(bits) == 2 and bits[0] < bits[1], scored  # code this file is like vs noise


def test_readme_python_api_block_runs_as_written(tmp_path):
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Python API"):]
    start = section.index("```python\n") + len("```python\n")
    code = section[start:section.index("\n```", start)]
    script = tmp_path / "readme_api.py"
    script.write_text("import os\nos.environ['XLA_FLAGS'] = "
                      "'--xla_force_host_platform_device_count=8'\n" + code)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "runs" / "start" / "config.json").is_file()
