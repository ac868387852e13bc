"""Every command the README and docs/ show runs as written: each fenced ``bash`` block of
README.md and docs/*.md, in order per file, in a scratch directory of its own.

The scratch directory holds a symlink to each top-level entry of the checkout, so ``examples/``,
``tests/fixtures`` and ``jaxtp/`` are there as in a clean clone while ``runs/`` and ``data/``
are written into the scratch directory, never into the repository. A block whose info string has
a second word is not run: ``gpu``, ``tpu`` and ``cluster`` need hardware this machine lacks, and
``setup`` marks the README's two install commands (CI's ``.ci/run`` runs the second). Those are
not collected at all, and every such marker must be one of that set, so a typo cannot hide a
block. Each runnable block must stay cheap (the ``tiny`` preset, about 20 steps, the same
layout wherever it can be, so that the session's compilation cache serves the repeats): the whole
file is about 160 s of CPU time.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxtp import testing

ROOT = Path(__file__).resolve().parents[2]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKERS = {"gpu", "tpu", "cluster", "setup"}
SETUP = ['pip install -e . && jaxtp train',
         'pip install -e ".[test]" && python -m pytest -n 2 tests && '
         'python -m pytest -n 2 --nbmake notebooks']
WRITTEN = {"runs", "data", ".git"}  # what commands write at the top level: not linked
FENCE = re.compile(r"^(\s*)```(.*)$")
BLOCK_TIMEOUT_S = 300
TAIL_CHARS = 3000


@dataclasses.dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    words: tuple[str, ...]  # the info string: ("bash",), ("bash", "gpu"), ("python",), ...
    text: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def fenced_blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a markdown file, in order."""
    blocks, opened, body = [], None, []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        m = FENCE.match(line)
        if opened is None and m:
            opened, body = (n, m.group(1), tuple(m.group(2).split())), []
        elif opened is not None and m and not m.group(2).strip():
            line_no, indent, words = opened
            assert not indent, f"{path.relative_to(ROOT)}:{line_no}: an indented fence; keep " \
                               f"code blocks at the left margin so this test sees them"
            blocks.append(Block(path, line_no, words, "\n".join(body) + "\n"))
            opened = None
        elif opened is not None:
            body.append(line)
    assert opened is None, f"{path.relative_to(ROOT)}:{opened[0]}: a fence that never closes"
    return blocks


def bash_blocks(path: Path) -> list[Block]:
    return [b for b in fenced_blocks(path) if b.words[:1] == ("bash",)]


def runnable(path: Path) -> list[Block]:
    return [b for b in bash_blocks(path) if len(b.words) == 1]


def test_markers_are_the_known_set():
    for path in FILES:
        for b in bash_blocks(path):
            assert len(b.words) <= 2 and set(b.words[1:]) <= MARKERS, (
                f"{b.where}: ```{' '.join(b.words)}: a bash block is run unless its second word "
                f"is one of {sorted(MARKERS)}")


def test_readme_opens_with_the_two_setup_blocks_ci_runs():
    first = fenced_blocks(ROOT / "README.md")[:2]
    assert [b.words for b in first] == [("bash", "setup")] * 2
    assert [b.text.strip() for b in first] == SETUP
    assert SETUP[1] in (ROOT / ".ci" / "run").read_text()


def scratch_checkout(tmp: Path) -> Path:
    """A directory that looks like a clean clone: a symlink per top-level entry of the checkout,
    except the directories commands write into."""
    for entry in ROOT.iterdir():
        if entry.name not in WRITTEN and not entry.name.endswith(".egg-info"):
            (tmp / entry.name).symlink_to(entry)
    return tmp


def environment() -> dict[str, str]:
    """The tests' subprocess environment, with this interpreter's ``jaxtp`` and ``python``
    first on PATH."""
    env = testing.train_env()
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def run_block(block: Block, cwd: Path, env: dict[str, str]) -> None:
    start = time.perf_counter()
    try:
        proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block.text], cwd=cwd,
                              env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
        pytest.fail(f"{block.where}: the block ran past {BLOCK_TIMEOUT_S} s\n{block.text}"
                    f"--- output tail ---\n{out[-TAIL_CHARS:]}", pytrace=False)
    print(f"{block.where}: {time.perf_counter() - start:.1f} s")
    if proc.returncode != 0:
        out = proc.stdout + proc.stderr
        pytest.fail(f"{block.where}: the block exited {proc.returncode}\n{block.text}"
                    f"--- output tail ---\n{out[-TAIL_CHARS:]}", pytrace=False)


@pytest.mark.parametrize("path", [p for p in FILES if runnable(p)],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_blocks_run_as_written(path, tmp_path):
    cwd, env = scratch_checkout(tmp_path), environment()
    for block in runnable(path):
        run_block(block, cwd, env)
