"""Write examples/data/mc_tiny.jsonl: multiple-choice items made from Python source text (the
standard library's ``textwrap`` module), no download. Each item's context is the start of a line
of code, the right choice is how that line really ends, the three others end other lines.

    python examples/data/make_mc_tiny.py
"""

import inspect
import json
import random
import textwrap
from pathlib import Path

ITEMS, TAIL = 40, 10


def main() -> None:
    rng = random.Random(0)
    lines = [ln.strip() for ln in inspect.getsource(textwrap).splitlines()]
    lines = sorted({ln for ln in lines if 30 <= len(ln) <= 100 and not ln.startswith("#")})
    picked = rng.sample(lines, ITEMS)
    items = []
    for line in picked:
        others = rng.sample([ln for ln in lines if ln[-TAIL:] != line[-TAIL:]], 3)
        choices = [o[-TAIL:] for o in others]
        answer = rng.randrange(4)
        choices.insert(answer, line[-TAIL:])
        items.append({"context": line[:-TAIL], "choices": choices, "answer": answer})
    out = Path(__file__).with_name("mc_tiny.jsonl")
    out.write_text("".join(json.dumps(item) + "\n" for item in items))
    print(f"wrote {len(items)} items to {out}")


if __name__ == "__main__":
    main()
