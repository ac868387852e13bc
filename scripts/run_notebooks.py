"""Execute the tutorial notebooks and write their outputs back into the files.

    .venv/bin/python scripts/run_notebooks.py                            # all six, in order
    .venv/bin/python scripts/run_notebooks.py notebooks/02_zero.ipynb    # only the ones named

Each notebook runs top to bottom, in place, with nbclient in a kernel of the Python that runs
this script (``sys.executable``: the venv's jaxtp, not whichever ``python`` is first on PATH),
from the ``notebooks/`` directory, on 8 simulated CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu``, which each notebook's
first cell also asks for). Notebooks run one after another in name order, never in parallel.
A cell that raises stops the run and leaves that notebook's file as it was.

What is written is kept small and stable, so a re-run shows a small diff: no execution timing
metadata (``record_timing=False``), consecutive prints merged into one stream output (the kernel
flushes at random points), figures as PNG at 80 dpi, and each notebook's size is checked
against ``MAX_BYTES``. CI executes the same notebooks without writing them
(``python -m pytest -n 2 --nbmake notebooks``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError
from traitlets import default

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
MAX_BYTES = 1_000_000  # per notebook file, outputs included
CELL_TIMEOUT_S = 900
FIGURE_DPI = 80


class _ThisPython(KernelSpecManager):
    """Every kernel name resolves to an IPython kernel of ``sys.executable``."""

    def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
        return KernelSpec(argv=[sys.executable, "-m", "ipykernel_launcher", "-f",
                                "{connection_file}"],
                          display_name="Python 3", language="python", name=kernel_name)


class _ThisPythonKernel(AsyncKernelManager):
    @default("kernel_spec_manager")
    def _this_python(self) -> KernelSpecManager:
        return _ThisPython()


def _environment(tmp: Path) -> None:
    """What the kernels inherit: 8 CPU devices and a small figure resolution."""
    flag = "--xla_force_host_platform_device_count=8"
    if flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
    os.environ["JAX_PLATFORMS"] = "cpu"
    rc = tmp / "matplotlibrc"
    rc.write_text(f"figure.dpi: {FIGURE_DPI}\nsavefig.dpi: {FIGURE_DPI}\n")
    os.environ["MATPLOTLIBRC"] = str(rc)


def _coalesce_streams(outputs: list) -> list:
    """One stream output per run of stdout (stderr) prints: where the kernel happened to flush
    would otherwise split them differently on every run."""
    out = []
    for o in outputs:
        if (o.output_type == "stream" and out and out[-1].output_type == "stream"
                and out[-1].name == o.name):
            out[-1].text += o.text
        else:
            out.append(o)
    return out


def run(path: Path) -> tuple[float, int]:
    """Execute ``path`` and write it back with its outputs: (seconds, bytes written)."""
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                            kernel_manager_class=_ThisPythonKernel, record_timing=False,
                            extra_arguments=["--log-level=ERROR"],  # not the TCP warning
                            resources={"metadata": {"path": str(path.parent)}})
    start = time.perf_counter()
    try:
        client.execute()
    except CellExecutionError as e:
        raise SystemExit(f"{path.name}: a cell failed, the file is left as it was\n{e}") from None
    seconds = time.perf_counter() - start
    for cell in nb.cells:
        cell.metadata.pop("execution", None)  # older runs may have left timing behind
        if cell.cell_type == "code":
            cell.outputs = _coalesce_streams(cell.outputs)
    text = nbformat.writes(nb) + "\n"
    size = len(text.encode())
    if size > MAX_BYTES:
        raise SystemExit(f"{path.name}: {size:,} bytes with outputs, over MAX_BYTES="
                         f"{MAX_BYTES:,}; shrink what its cells print or plot")
    path.write_text(text)
    return seconds, size


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path,
                        help="notebooks to run (default: every notebooks/*.ipynb)")
    args = parser.parse_args(argv)
    paths = sorted(p.resolve() for p in args.notebooks) or sorted(NOTEBOOKS.glob("*.ipynb"))
    for p in paths:
        if p.suffix != ".ipynb" or not p.is_file():
            why = "no such file" if not p.exists() else "not a .ipynb file"
            raise SystemExit(f"{p}: {why}; pass notebooks such as "
                             f"notebooks/01_tensor_parallelism.ipynb")
    with tempfile.TemporaryDirectory() as tmp:
        _environment(Path(tmp))
        for p in paths:
            seconds, size = run(p)
            print(f"{p.relative_to(ROOT) if p.is_relative_to(ROOT) else p}: "
                  f"{seconds:.1f} s, {size / 1024:.0f} KiB", flush=True)


if __name__ == "__main__":
    main()
