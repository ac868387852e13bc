"""The ``jaxtp`` command's host allocator (jaxtp.cli.host_malloc): which environment a run starts
under, and that the re-execution really starts the process again under it."""

import os
import subprocess
import sys

import pytest

from jaxtp.cli.host_malloc import HUGETLB, HostMallocError, plan

CPU = {"JAX_PLATFORMS": "cpu"}


def test_a_cpu_run_on_linux_gets_glibc_huge_pages():
    env, line = plan(CPU, ["train"], platform="linux")
    assert env == {"GLIBC_TUNABLES": HUGETLB}
    assert "transparent huge pages" in line and "JAXTP_HOST_MALLOC=off" in line
    # other tunables are kept, ours appended
    env, _ = plan({**CPU, "GLIBC_TUNABLES": "glibc.pthread.rseq=0"}, ["train"], platform="linux")
    assert env == {"GLIBC_TUNABLES": f"glibc.pthread.rseq=0:{HUGETLB}"}
    # --devices N simulates CPU devices whatever is installed
    assert plan({}, ["train", "--devices", "8"], platform="linux") is not None
    assert plan({}, ["train", "--devices=8"], platform="linux") is not None


def test_left_alone_when_not_a_cpu_run_or_already_chosen():
    assert plan({"JAX_PLATFORMS": "cuda"}, ["train"], platform="linux") is None
    assert plan({"JAX_PLATFORMS": "cuda,cpu"}, ["train"], platform="linux") is None
    assert plan(CPU, ["train"], platform="darwin") is None
    assert plan({**CPU, "JAXTP_HOST_MALLOC": "off"}, ["train"], platform="linux") is None
    tc = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
    assert plan({**CPU, "LD_PRELOAD": tc}, ["train"], platform="linux") is None
    assert plan({**CPU, "GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=1"}, ["train"],
                platform="linux") is None
    # an unrelated preload does not count as a choice
    assert plan({**CPU, "LD_PRELOAD": "libfoo.so"}, ["train"], platform="linux") is not None


def test_hugetlb_and_a_library_path_are_explicit_choices(tmp_path):
    env, _ = plan({"JAX_PLATFORMS": "cuda", "JAXTP_HOST_MALLOC": "hugetlb"}, ["train"],
                  platform="linux")
    assert env == {"GLIBC_TUNABLES": HUGETLB}
    lib = tmp_path / "libmymalloc.so"
    lib.write_bytes(b"")
    env, line = plan({"JAXTP_HOST_MALLOC": str(lib), "LD_PRELOAD": "libfoo.so"}, ["train"],
                     platform="darwin")
    assert env == {"LD_PRELOAD": f"{lib}:libfoo.so"} and str(lib) in line


def test_a_bad_choice_is_one_line_naming_the_key_the_value_and_the_fix(tmp_path):
    with pytest.raises(HostMallocError, match=r"JAXTP_HOST_MALLOC='tcmaloc': not a file; use "
                                              r"auto, off, hugetlb or the path"):
        plan({"JAXTP_HOST_MALLOC": "tcmaloc"}, ["train"], platform="linux")
    r = subprocess.run([sys.executable, "-m", "jaxtp", "train", "--config", "tiny"],
                       env={**os.environ, "JAXTP_HOST_MALLOC": str(tmp_path / "nope.so")},
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        f"error: JAXTP_HOST_MALLOC={str(tmp_path / 'nope.so')!r}: not a file; use auto, off, "
        "hugetlb or the path of an allocator library, e.g. "
        "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"]


_PROBE = ("from jaxtp.cli import host_malloc; host_malloc.reexec_if_needed(['train']); import os, "
          "sys; print(os.getpid(), os.environ.get('GLIBC_TUNABLES'), sys.argv[1:], "
          "host_malloc.describe() is not None, 'jax' in sys.modules, host_malloc.MARK in "
          "os.environ)")


def test_the_process_starts_again_under_the_tunable_with_its_own_command_line():
    env = {k: v for k, v in os.environ.items()
           if k not in ("GLIBC_TUNABLES", "LD_PRELOAD", "JAXTP_HOST_MALLOC")}
    p = subprocess.Popen([sys.executable, "-c", _PROBE, "a", "--b=1"], env={**env, **CPU},
                         stdout=subprocess.PIPE, text=True)
    out, _ = p.communicate(timeout=60)
    # exec keeps the process: the same pid and arguments, the tunable in its environment, the
    # line to print, JAX not imported by the check (Linux: CI's and these machines' OS), and the
    # marker gone once read, so a child jaxtp command plans for itself
    assert out.strip() == f"{p.pid} {HUGETLB} ['a', '--b=1'] True False False"
    off = subprocess.run([sys.executable, "-c", _PROBE],
                         env={**env, **CPU, "JAXTP_HOST_MALLOC": "off"},
                         capture_output=True, text=True, timeout=60, check=True)
    assert " None [] False False False" in off.stdout
