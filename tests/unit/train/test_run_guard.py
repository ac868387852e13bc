"""The watchdog's error line (jaxtp.train.run_guard): what it names for a stuck step."""

from jaxtp.train.run_guard import hang_hint, last_saved_step


def test_last_saved_step_reads_finished_steps_only(tmp_path):
    assert last_saved_step(tmp_path / "missing") is None and last_saved_step(None) is None
    assert last_saved_step(tmp_path) is None
    for name in ("2", "10", "12.orbax-checkpoint-tmp-1", "notes"):
        (tmp_path / name).mkdir()
    assert last_saved_step(tmp_path) == 10


def test_hang_hint_names_the_layout_and_the_fix():
    cpu = hang_hint(layout="pipeline=2 x data=2 x model=2", platform="cpu", processes=1,
                    devices=8, pool_threads=32, nproc="2")
    assert cpu.startswith("on pipeline=2 x data=2 x model=2 (simulated CPU devices)")
    assert "NPROC=2 sets it" in cpu and "NPROC=32" in cpu
    assert "one thread per core" in hang_hint(layout="data=8", platform="cpu", processes=1,
                                              devices=8, pool_threads=32, nproc=None)
    gpu = hang_hint(layout="data=16", platform="gpu", processes=2, devices=16, pool_threads=32,
                    nproc=None)
    one = hang_hint(layout="1 device", platform="cpu", processes=1, devices=1, pool_threads=4,
                    nproc="4")
    assert one.startswith("on 1 device: the step itself is stuck") and "NPROC" not in one
    assert gpu.startswith("on data=16 over 2 process(es): a device or a peer process is stuck")
    assert "\n" not in cpu + gpu + one
