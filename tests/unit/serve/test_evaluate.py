"""jaxtp.serve.evaluation and the `sample` / `eval` verbs: metrics on a task whose answer is known (a
model built to predict "the next byte value"), and the CLI run as a user would."""

import json
import math
import os
from pathlib import Path
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxtp
from jaxtp.serve import evaluation as evaluate
from jaxtp.configs.schema import ConfigError
from jaxtp.testing import train_env

ROOT = str(Path(__file__).resolve().parents[3])


@pytest.fixture(scope="module")
def successor_model():
    """The tiny model with every block's output zeroed and a head whose logit for byte ``v`` is
    the (normalised) embedding of byte ``v - 1``: it predicts ``t + 1`` after byte ``t``."""
    ref = jaxtp.Model(jaxtp.config("tiny", {"parallel.data": 1, "model.max_seq_len": 32}),
                      seed=0, devices=jax.devices()[:1])
    params = ref.params
    attn, mlp = params["blocks"]["attn"], params["blocks"]["mlp"]
    attn["wo"] = attn["wo"].replace(jnp.zeros_like(attn["wo"][...]))
    mlp["w_down"] = mlp["w_down"].replace(jnp.zeros_like(mlp["w_down"][...]))
    table = params["embed"]["table"][...]
    unit = table / jnp.linalg.norm(table, axis=-1, keepdims=True)
    # column v of the head: byte v - 1's direction
    params["head"]["w"] = params["head"]["w"].replace(40.0 * jnp.roll(unit, 1, axis=0).T)
    cfg = jaxtp.config("tiny", {"parallel.data": 2, "parallel.model": 4,
                                "model.max_seq_len": 32})
    return jaxtp.Model(cfg, params=params)


def test_choice_accuracy_on_known_task(successor_model, tmp_path):
    items = []
    for i, start in enumerate(range(97, 117)):
        context = "".join(chr(c) for c in range(start, start + 4))
        right = "".join(chr(c) for c in range(start + 4, start + 6))
        wrong = [right[::-1], chr(start) * 2, chr(start + 9) + chr(start + 3)]
        answer = i % 4
        choices = wrong[:answer] + [right] + wrong[answer:]
        items.append({"context": context, "choices": choices, "answer": answer})
    path = tmp_path / "mc.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in items) + "\n")
    out = evaluate.evaluate(successor_model, path)
    assert out["items"] == 20 and out["acc"] == 1.0 and out["acc_norm"] == 1.0
    # the same file with the answers moved: accuracy 0
    for x in items:
        x["answer"] = (x["answer"] + 1) % 4
    path.write_text("\n".join(json.dumps(x) for x in items))
    assert evaluate.evaluate(successor_model, path)["acc"] == 0.0


def test_text_metrics(successor_model, tmp_path):
    counting = tmp_path / "counting.txt"
    counting.write_text("".join(chr(c) for c in range(33, 127)))  # no wrap-around
    shuffled = tmp_path / "shuffled.txt"
    rng = np.random.default_rng(0)
    shuffled.write_text("".join(rng.permutation(list(counting.read_text()))))
    good = evaluate.evaluate(successor_model, counting)
    bad = evaluate.evaluate(successor_model, shuffled)
    assert good["loss"] < 0.5 and bad["loss"] > 3.0
    assert good["bits_per_byte"] == pytest.approx(good["loss"] / math.log(2)
                                                 * good["tokens"] / good["bytes"])
    assert good["perplexity"] == pytest.approx(math.exp(good["loss"]))


def test_bad_inputs(successor_model, tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        evaluate.evaluate(successor_model, tmp_path / "missing.txt")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"context": "a", "choices": ["b"], "answer": 3}\n')
    with pytest.raises(ConfigError, match="answer"):
        evaluate.evaluate(successor_model, bad)


def _jaxtp(*args):
    env = train_env()
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "jaxtp", *args], capture_output=True, text=True,
                          check=False,
                          env=env, timeout=600, cwd=ROOT)


def test_cli_sample_and_eval(tmp_path):
    run = tmp_path / "run"
    cfg = jaxtp.config("tiny", {"parallel.data": 2, "parallel.model": 4})
    jaxtp.Model(cfg, seed=0).save(run)
    r = _jaxtp("sample", "--run", str(run), "--prompt", "def ", "--max-new-tokens", "5",
               "--temperature", "0", "parallel.mode=explicit")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("def ")
    r = _jaxtp("eval", "--run", str(run), "--data", "examples/data/mc_tiny.jsonl", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["items"] > 0 and 0 <= out["acc"] <= 1 and 0 <= out["acc_norm"] <= 1
    r = _jaxtp("sample", "--run", str(tmp_path / "nope"), "--prompt", "x")
    assert r.returncode == 2 and "not a jaxtp run directory" in r.stderr
    r = _jaxtp("sample", "--run", str(run), "--prompt", "x" * 200)
    assert r.returncode == 2 and "max_seq_len" in r.stderr
