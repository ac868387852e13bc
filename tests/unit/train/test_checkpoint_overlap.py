"""Save and eval steps that do not hold up the next step: the state is copied on the devices, the
next step is dispatched, and only then are the copy saved and the eval losses read
(``train.checkpoint_overlap``). The checkpoints, records and resume are the same as saving in
place."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtp.ckpt import checkpoint
from jaxtp.configs import schema as config
from jaxtp.inspect import hlo
from jaxtp.train import loop
from jaxtp.train import trainer as train

COMMON = ["train.steps=6", "train.log_every=1", "train.checkpoint_every=2", "train.eval_every=2",
          "train.eval_batches=1", "train.keep_checkpoints=10"]


def _run(out, overlap, monkeypatch=None, events=None):
    cfg = config.load("tiny", [f"train.out_dir={out}", f"train.checkpoint_overlap={overlap}",
                               *COMMON])
    if events is not None:  # record the order of step dispatches and saves
        step_fn, save = train.Trainer.step_fn, checkpoint.Checkpointer.save

        def counting_step_fn(self, state):
            fn = step_fn(self, state)

            def call(*a, **k):
                events.append("step")
                return fn(*a, **k)
            return call

        def recording_save(self, step, state, **k):
            events.append(f"save {step}")
            return save(self, step, state, **k)

        monkeypatch.setattr(train.Trainer, "step_fn", counting_step_fn)
        monkeypatch.setattr(checkpoint.Checkpointer, "save", recording_save)
    return cfg, train.run(cfg)


def _saved(cfg, out):
    ckpt = checkpoint.Checkpointer(out / "checkpoints", keep=10, cfg=cfg)
    like = train.Trainer(cfg).abstract_state()
    saved = {s: ckpt.restore(s, like=like) for s in ckpt.all_steps()}
    ckpt.close()
    return saved


def test_overlapped_saves_equal_saves_in_place(tmp_path):
    """Every 2 steps a checkpoint and an eval: with the copy (on) and without (off) the records
    (loss, eval loss) and every checkpoint's arrays and data state are equal, bit for bit; the
    copy survives the next step donating the state it was made from."""
    cfg, on = _run(tmp_path / "on", "on")
    _, off = _run(tmp_path / "off", "off")
    assert [r["step"] for r in on] == list(range(1, 7))
    for a, b in zip(on, off):
        assert (a["loss"], a.get("eval_loss")) == (b["loss"], b.get("eval_loss")), a["step"]
    assert [r["step"] for r in on if "eval_loss" in r] == [2, 4, 6]
    saved_on, saved_off = _saved(cfg, tmp_path / "on"), _saved(cfg, tmp_path / "off")
    assert sorted(saved_on) == sorted(saved_off) == [2, 4, 6]
    for s in saved_on:
        (state_a, data_a), (state_b, data_b) = saved_on[s], saved_off[s]
        assert data_a == data_b and data_a["step"] == s
        assert int(state_a.step) == s
        jax.tree.map(np.testing.assert_array_equal, state_a, state_b)


@pytest.mark.parametrize("overlap, order", [
    ("on", ["step", "step", "step", "save 2", "step", "step", "save 4", "step", "save 6"]),
    ("off", ["step", "step", "save 2", "step", "step", "save 4", "step", "step", "save 6"]),
])
def test_the_next_step_is_dispatched_before_the_save(tmp_path, monkeypatch, overlap, order):
    """on: step 3 is dispatched before step 2's save starts (the last step's save has no next
    step); off: the save comes first."""
    events = []
    _run(tmp_path, overlap, monkeypatch, events)
    assert events == order


def test_resume_after_overlapped_saves_is_exact(tmp_path):
    """Stopped at 4 with overlapped saves, resumed to 6: the same losses as one run."""
    cut, full = tmp_path / "cut", tmp_path / "full"
    cfg = config.load("tiny", [f"train.out_dir={cut}", *COMMON, "train.steps=4"])
    train.run(cfg)
    _, resumed = _run(cut, "on")
    _, one = _run(full, "on")
    assert [r["step"] for r in resumed] == list(range(1, 7))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in one]


class _Device:
    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats

    def __str__(self):
        return "gpu:0"


def _state_on(device, nbytes):
    shard = types.SimpleNamespace(device=device, data=types.SimpleNamespace(nbytes=nbytes))
    return {"w": types.SimpleNamespace(addressable_shards=[shard])}


def test_auto_copies_only_where_the_devices_have_room(capsys):
    """auto: CPU devices -> save in place (the copy competes with the next step for the same
    cores); an accelerator with no memory statistics or room beside the step's peak -> copy;
    too little -> save in place, with one line saying so and how to force the copy."""
    assert not loop._copy_pays({"w": jnp.zeros(4)})
    assert loop._copy_pays(_state_on(_Device(None), 2**30))
    roomy = _Device({"bytes_limit": 10 * 2**30, "peak_bytes_in_use": 6 * 2**30})
    assert loop._copy_pays(_state_on(roomy, 2 * 2**30))
    assert capsys.readouterr().out == ""
    full = _Device({"bytes_limit": 10 * 2**30, "peak_bytes_in_use": 8 * 2**30})
    assert not loop._copy_pays(_state_on(full, 2 * 2**30))
    line = capsys.readouterr().out.strip()
    assert "gpu:0 has 2.0 GiB free" in line and "needs 2.0 GiB" in line
    assert "train.checkpoint_overlap=on" in line and "\n" not in line


def test_a_snapshot_is_a_copy_on_the_same_devices(tmp_path):
    """The snapshot's arrays are new buffers with the original's shardings and values."""
    cfg = config.load("tiny", [f"train.out_dir={tmp_path}", "parallel.model=2"])
    trainer = train.Trainer(cfg)
    state = trainer.init_state()
    ckpt = checkpoint.Checkpointer(tmp_path / "ck", keep=1, cfg=cfg)
    snap = ckpt.snapshot(state)
    flat, _ = checkpoint._flatten(state)
    assert snap.copied and set(snap.flat) == set(flat)
    for k, v in flat.items():
        c = snap.flat[k]
        assert c.sharding.is_equivalent_to(v.sharding, v.ndim), k
        assert all(a.data.unsafe_buffer_pointer() != b.data.unsafe_buffer_pointer()
                   for a, b in zip(c.addressable_shards, v.addressable_shards)), k
        np.testing.assert_array_equal(np.asarray(c), np.asarray(v))
    # memory contract, from the compiled copy: one more state's bytes per device, no collective
    compiled = checkpoint._device_copy.lower(flat).compile()
    per_device = sum(x.addressable_shards[0].data.nbytes for x in flat.values())
    out = compiled.memory_analysis().output_size_in_bytes  # + the output tuple's pointer table
    assert per_device <= out <= per_device + 8 * len(flat), (out, per_device)
    mesh = next(iter(flat.values())).sharding.mesh
    assert not hlo.collectives(compiled.as_text(), dict(mesh.shape))


def test_a_bad_overlap_choice_is_one_line_before_anything_runs():
    with pytest.raises(config.ConfigError, match=r"train.checkpoint_overlap='sometimes' .*"
                                                 r"choose one of \['auto', 'on', 'off'\]"):
        config.load("tiny", ["train.checkpoint_overlap=sometimes"])
