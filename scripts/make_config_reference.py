"""Write docs/config.md, the config reference, from the config dataclasses.

    python scripts/make_config_reference.py           # rewrite docs/config.md
    python scripts/make_config_reference.py --check   # exit 1 if docs/config.md is out of date

Every ``section.field`` of :class:`jaxtp.configs.schema.Config` with its type and default (read
from the dataclasses) and the comment that stands beside or above the field in the source (read
with ``tokenize``, since comments are not in the AST), then the presets. Imports no JAX.
``tests/unit/configs/test_config_reference.py`` checks that the committed file is current.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import os
import sys
import tokenize
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "config.md"
sys.path.insert(0, str(ROOT))

from jaxtp.configs import schema  # noqa: E402

HEADER = """\
# Config reference

Generated from the dataclasses in `jaxtp/configs/schema.py` by
`python scripts/make_config_reference.py`; do not edit it by hand
(`tests/unit/configs/test_config_reference.py` fails when it is out of date).

Every key is set the same way everywhere: `section.field=value` on the command line
(`jaxtp train model.n_layers=4 train.steps=100`), or from Python
`jaxtp.config("tiny", {"model.n_layers": 4})`. Booleans are `true` / `false`. An unknown key or a
bad value is a one-line error that names the valid choices. The defaults below are the
dataclasses'; a preset (`--config NAME`, default `tiny`) sets some of them: see
[Presets](#presets).
"""


def _comments(source: str) -> dict[int, str]:
    """Line number -> the text of the comment on that line."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string.lstrip("#").strip()
    return out


def field_comments(cls: type) -> dict[str, str]:
    """Each field of dataclass ``cls``: the comment block right above it, then its own trailing
    comment, joined into one line."""
    path = inspect.getsourcefile(cls)
    source = Path(path).read_text()
    lines = source.splitlines()
    comments = _comments(source)
    node = next(n for n in ast.walk(ast.parse(source))
                if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    out = {}
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        above, line = [], stmt.lineno - 1
        while line >= 1 and lines[line - 1].strip().startswith("#"):
            above.insert(0, comments[line])
            line -= 1
        own = [comments[n] for n in range(stmt.lineno, stmt.end_lineno + 1) if n in comments]
        out[stmt.target.id] = " ".join(above + own)
    return out


def type_text(hint) -> str:
    if typing.get_origin(hint) is typing.Literal:
        return "one of " + ", ".join(f"`{a}`" for a in typing.get_args(hint))
    return hint.__name__


def value_text(value) -> str:
    """A value as it is typed in an override."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value == "":
        return '""'
    return str(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def section(name: str, cls: type) -> list[str]:
    hints = typing.get_type_hints(cls)
    comments = field_comments(cls)
    defaults = cls()
    out = [f"## {name}", ""]
    if cls.__doc__ and not cls.__doc__.startswith(f"{cls.__name__}("):  # not dataclass's own
        out += [inspect.cleandoc(cls.__doc__), ""]
    out += ["| key | type | default | what it does |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        out.append(f"| `{name}.{f.name}` | {type_text(hints[f.name])} | "
                   f"`{value_text(getattr(defaults, f.name))}` | {_cell(comments[f.name])} |")
    return out + [""]


def _preset_doc(name: str) -> str:
    fn = schema.PRESETS[name]
    if name in schema.NARAYANAN_TABLE1:  # registered as lambdas over one shape table
        return "GPT model of Narayanan et al. 2021 (arXiv 2104.04473), Table 1."
    return inspect.cleandoc(fn.__doc__ or "").replace("\n", " ")


def presets() -> list[str]:
    out = ["## Presets", "",
           "`--config NAME` (Python: `jaxtp.config(NAME, overrides)`) starts from one of these; "
           "overrides apply on top. Parameters are the unpadded model's.", "",
           "| preset | parameters | layers | d_model | heads / kv heads | d_ff | vocab | "
           "batch x seq | what it is |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name in schema.PRESETS:
        cfg = schema.PRESETS[name]()
        m, t = cfg.model, cfg.train
        count = m.param_count()
        size = f"{count / 1e9:.2f} B" if count >= 1e9 else f"{count / 1e6:.2f} M"
        out.append(f"| `{name}` | {size} | {m.n_layers} | {m.d_model} | "
                   f"{m.n_heads} / {m.n_kv_heads} | {m.d_ff} | {m.vocab_size} | "
                   f"{t.batch_size} x {t.seq_len} | {_cell(_preset_doc(name))} |")
    return out + [""]


def render() -> str:
    lines = [HEADER]
    for f in dataclasses.fields(schema.Config):
        lines += section(f.name, type(getattr(schema.Config(), f.name)))
    lines += presets()
    return "\n".join(lines).rstrip("\n") + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if docs/config.md differs from what this script writes")
    args = parser.parse_args()
    text = render()
    if args.check:
        current = OUT.read_text() if OUT.exists() else ""
        if current != text:
            print(f"{OUT.relative_to(ROOT)} is out of date: run "
                  f"python scripts/make_config_reference.py", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(exist_ok=True)
    tmp = OUT.with_name(f"{OUT.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, OUT)  # readers (the test) never see half a file
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
