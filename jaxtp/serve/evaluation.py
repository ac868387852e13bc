"""Held-out evaluation of a model: loss, perplexity and bits per byte on a text file, and
multiple-choice accuracy on a JSONL of ``{"context", "choices", "answer"}`` items.

Multiple choice is scored as lm-evaluation-harness scores it (Gao et al. 2021): each choice's
log-likelihood given the context, summed over the choice's tokens (``acc``: the argmax is the
answer) and divided by the choice's length in bytes (``acc_norm``). Everything goes through
:meth:`jaxtp.Model.token_losses`, on whatever layout the model is loaded with. Batches are padded
to a fixed row count and a power-of-two width, so a file compiles a handful of shapes, not one
per item.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from tqdm import tqdm

from jaxtp.configs import ConfigError
from jaxtp.serve.generate import Tokenizer, bucket

ROWS = 16  # windows / (context, choice) pairs scored per call


def _losses(model, seqs: list[list[int]]) -> list[np.ndarray]:
    """Per-token losses of each sequence's tokens ``1 ..`` given the ones before (right-padded to
    a power-of-two width, rows padded to :data:`ROWS`)."""
    width = bucket(max(len(s) for s in seqs) - 1, model.cfg.model.max_seq_len)
    inputs = np.zeros((ROWS, width), np.int32)
    targets = np.zeros((ROWS, width), np.int32)
    for i, s in enumerate(seqs):
        inputs[i, : len(s) - 1], targets[i, : len(s) - 1] = s[:-1], s[1:]
    out = np.asarray(model.token_losses(inputs, targets))
    return [out[i, : len(s) - 1] for i, s in enumerate(seqs)]


def _batches(items: list, progress: bool, desc: str):
    bar = tqdm(total=len(items), desc=desc, unit="seq", disable=not progress)
    for start in range(0, len(items), ROWS):
        chunk = items[start: start + ROWS]
        yield chunk
        bar.update(len(chunk))
    bar.close()


def text_metrics(model, path: str | Path, *, max_tokens: int | None = None,
                 progress: bool = False) -> dict:
    """Mean next-token loss (nats), perplexity and bits per byte of the file's text, scored in
    non-overlapping windows of ``model.max_seq_len`` tokens."""
    tok = Tokenizer(model.cfg)
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    ids = tok.encode(text)[: max_tokens]
    if len(ids) < 2:
        raise ConfigError(f"{path} has fewer than 2 tokens to score")
    n_bytes = len(tok.decode(ids).encode("utf-8"))
    window = model.cfg.model.max_seq_len
    seqs = [ids[i: i + window + 1] for i in range(0, len(ids) - 1, window)]
    seqs = [s for s in seqs if len(s) >= 2]
    total, count = 0.0, 0
    for chunk in _batches(seqs, progress, "eval text"):
        for losses in _losses(model, chunk):
            total, count = total + float(losses.sum()), count + len(losses)
    loss = total / count
    return {"tokens": count, "bytes": n_bytes, "loss": loss, "perplexity": math.exp(loss),
            "bits_per_byte": total / math.log(2) / n_bytes}


def read_choices(path: str | Path) -> list[dict]:
    """The items of a multiple-choice JSONL, checked."""
    items = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{n}: not JSON ({e})") from None
        if (not isinstance(item, dict) or not isinstance(item.get("context"), str)
                or not isinstance(item.get("choices"), list) or not item["choices"]
                or not isinstance(item.get("answer"), int)
                or not 0 <= item["answer"] < len(item["choices"])):
            raise ConfigError(f'{path}:{n}: expected {{"context": str, "choices": [str, ...], '
                              f'"answer": index}}')
        items.append(item)
    if not items:
        raise ConfigError(f"{path} has no items")
    return items


def choice_metrics(model, path: str | Path, *, progress: bool = False) -> dict:
    """``acc`` and ``acc_norm`` (log-likelihood per byte of the choice) over the JSONL's items."""
    tok = Tokenizer(model.cfg)
    items = read_choices(path)
    cap = model.cfg.model.max_seq_len + 1
    pairs = []  # (item, choice, sequence, number of choice tokens)
    for i, item in enumerate(items):
        context = tok.encode(item["context"])
        for c, choice in enumerate(item["choices"]):
            cont = tok.encode(choice)
            if not cont or len(cont) >= cap:
                raise ConfigError(f"{path}: item {i} choice {c} has {len(cont)} tokens; "
                                  f"choices need 1 .. model.max_seq_len tokens")
            seq = (context + cont)[-cap:]  # lm-eval truncates the context on the left
            pairs.append((i, c, seq, len(cont)))
    loglik = {}
    for chunk in _batches(pairs, progress, "eval choices"):
        for (i, c, _, n), losses in zip(chunk, _losses(model, [p[2] for p in chunk])):
            loglik[i, c] = -float(losses[-n:].sum())
    acc = acc_norm = 0
    for i, item in enumerate(items):
        scores = [loglik[i, c] for c in range(len(item["choices"]))]
        norm = [s / max(len(ch.encode("utf-8")), 1) for s, ch in zip(scores, item["choices"])]
        acc += int(np.argmax(scores) == item["answer"])
        acc_norm += int(np.argmax(norm) == item["answer"])
    return {"items": len(items), "acc": acc / len(items), "acc_norm": acc_norm / len(items)}


def evaluate(model, path: str | Path, *, max_tokens: int | None = None,
             progress: bool = False) -> dict:
    """:func:`choice_metrics` for a ``.jsonl`` file, :func:`text_metrics` for anything else."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--data {path}: no such file")
    if path.suffix == ".jsonl":
        return {"data": str(path), **choice_metrics(model, path, progress=progress)}
    return {"data": str(path), **text_metrics(model, path, max_tokens=max_tokens,
                                               progress=progress)}
