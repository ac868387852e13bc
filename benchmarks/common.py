"""What the benchmark scripts share: the model shapes they run, the simulated-device set-up (which
must happen before jax is imported, so nothing here imports jax at module level), and a header
that says which code and machine produced a table."""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"

# (preset, overrides, one-line description). "gpt2-small-ish" keeps GPT-2 small's width (d=768,
# d_ff=3072, vocab 50257, tied embeddings, GELU) but has 2 layers and 64-token sequences so that a
# step takes seconds on a 2-core CPU, and 16 heads of 48 instead of 12 of 64 (same d and the same
# FLOPs) so that model=8 divides the heads.
SHAPES: dict[str, tuple[str, tuple[str, ...], str]] = {
    "tiny": ("tiny", ("train.batch_size=8", "train.seq_len=64"),
             "jaxtp's `tiny` preset: d=64, 2 layers, 8 heads, d_ff=256 SwiGLU, byte vocab 256, "
             "untied; batch 8 x 64 tokens"),
    "gpt2-small-ish": ("gpt2-small", ("model.n_layers=2", "model.n_heads=16",
                                      "model.n_kv_heads=16", "train.batch_size=8",
                                      "train.seq_len=64"),
                       "GPT-2-small-*shaped*, reduced to fit 2 CPU cores: d=768, d_ff=3072 GELU, "
                       "vocab 50257 tied, **2 layers** (not 12), **16 heads x 48** (not 12 x 64: "
                       "same width and FLOPs, lets model=8 divide the heads), batch 8 x **64** "
                       "tokens (not 1024)"),
}


def force_cpu_devices(n: int = 8) -> None:
    """Append ``--xla_force_host_platform_device_count=n`` to XLA_FLAGS (keeping other flags)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def git_state() -> str:
    """``<short sha>`` plus a note when jaxtp/ has uncommitted changes (benchmarks measure the tree)."""
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                             capture_output=True, check=True).stdout.strip()
        diff = subprocess.run(["git", "diff", "HEAD", "--", "jaxtp"], cwd=ROOT,
                              capture_output=True, check=True).stdout
        untracked = subprocess.run(["git", "ls-files", "--others", "--exclude-standard", "jaxtp"],
                                   cwd=ROOT, text=True, capture_output=True,
                                   check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    if not diff and not untracked:
        return sha
    digest = hashlib.sha1(diff + "\n".join(untracked).encode()).hexdigest()[:10]
    return (f"{sha} + uncommitted changes in jaxtp/ (diff sha1 {digest}"
            + (f", {len(untracked)} untracked files" if untracked else "") + ")")


def machine() -> str:
    import jax

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{cpu}, {os.cpu_count()} cores visible; jax {jax.__version__}, "
            f"{jax.device_count()} {jax.devices()[0].platform} devices")
