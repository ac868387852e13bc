"""benchmarks/vs_maxtext.py, quickly: jaxtp's side only (MaxText is never installed here), tiny
sizes; the table, the census and the host-time column come out."""

import argparse
import os
import subprocess
import sys
from pathlib import Path

from jaxtp.cli import host_malloc

REPO = Path(__file__).resolve().parents[2]


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


def _vs_maxtext_module():
    import importlib.util  # noqa: PLC0415
    spec = importlib.util.spec_from_file_location("vs_maxtext", REPO / "benchmarks/vs_maxtext.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_run_watched_kills_a_stalled_process_and_keeps_a_working_one():
    """The MaxText runs' watchdog: a process that uses no CPU for ``stall_s`` is killed (a
    deadlocked MaxText sat idle for minutes), one that works and ends is left alone."""
    mod = _vs_maxtext_module()
    env = dict(os.environ)
    stalled = mod.run_watched([sys.executable, "-c", "import time; print('up', flush=True); "
                               "time.sleep(60)"], env, stall_s=2.0, poll_s=0.2)
    assert stalled.returncode == -9 and "up" in stalled.stdout
    busy = mod.run_watched([sys.executable, "-c", "import time\nt = time.time()\n"
                            "while time.time() - t < 4: pass\nprint('done')"],
                           env, stall_s=4.0, poll_s=0.2)
    assert busy.returncode == 0 and busy.stdout.strip() == "done"
    too_long = mod.run_watched([sys.executable, "-c", "while True: pass"], env, stall_s=60.0,
                               timeout_s=1.0, poll_s=0.2)
    assert too_long.returncode == -9  # busy, but past timeout_s


def test_host_allocator_per_side():
    """``--preload`` puts one host allocator under both sides (``LD_PRELOAD``), with each side's
    own XLA flags; ``--host-malloc hugetlb`` glibc's huge-page tunable under both; ``glibc``
    neither; ``each`` gives jaxtp what ``jaxtp train`` gives a CPU run and MaxText nothing."""
    mod = _vs_maxtext_module()
    lib = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"

    def args(host_malloc, preload=None):
        return argparse.Namespace(host_malloc=host_malloc, preload=preload)

    both = args("each", lib)
    jaxtp_env = mod.side_env(("XLA_FLAGS",), mod.allocator(both, "jaxtp"))
    maxtext_env = mod.maxtext_env(None, mod.allocator(both, "maxtext"))
    assert jaxtp_env["LD_PRELOAD"] == maxtext_env["LD_PRELOAD"] == lib
    assert "--xla_force_host_platform_device_count=8" in maxtext_env["XLA_FLAGS"]
    assert "XLA_FLAGS" not in jaxtp_env
    assert mod.maxtext_env(None, None).get("LD_PRELOAD") == os.environ.get("LD_PRELOAD")
    hugetlb = args("hugetlb")
    assert (mod.allocator(hugetlb, "jaxtp") == mod.allocator(hugetlb, "maxtext")
            == {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"})
    assert mod.allocator(args("glibc"), "jaxtp") == mod.allocator(args("glibc"), "maxtext") == {}
    each = args("each")
    assert mod.allocator(each, "maxtext") == {}
    expected = host_malloc.plan({"JAX_PLATFORMS": "cpu"}, ["train"])
    if not any(k in os.environ for k in ("LD_PRELOAD", "GLIBC_TUNABLES")):
        assert expected is not None and mod.allocator(each, "jaxtp") == expected[0]
    assert "as `jaxtp train` runs" in mod.allocator_line(each)
    assert mod.allocator_line(hugetlb).endswith("(both)")


