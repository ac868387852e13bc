"""Two small JSONL corpora made from the running Python's standard library, for docs/data.md's
examples: ``docstrings.jsonl`` (each module's and each top-level function's docstring: prose) and
``functions.jsonl`` (each top-level function's source: code), one document per line in the field
``text``. Deterministic for a given Python version.

    python examples/data/make_docs.py [--out examples/data] [--max-docs 4000]
"""

import argparse
import ast
import json
import sysconfig
from pathlib import Path


def documents(max_docs: int):
    root = Path(sysconfig.get_paths()["stdlib"])
    prose, code = [], []
    for path in sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts):
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        doc = ast.get_docstring(tree)
        if doc and len(doc) > 80:
            prose.append(doc)
        for node in tree.body:
            if isinstance(node, ast.FunctionDef):
                text = ast.get_source_segment(source, node)
                if text and 80 < len(text) < 4000:
                    code.append(text)
                doc = ast.get_docstring(node)
                if doc and len(doc) > 80:
                    prose.append(doc)
        if len(prose) >= max_docs and len(code) >= max_docs:
            break
    return prose[:max_docs], code[:max_docs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(Path(__file__).parent))
    p.add_argument("--max-docs", type=int, default=4000)
    a = p.parse_args()
    prose, code = documents(a.max_docs)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    for name, docs in (("docstrings", prose), ("functions", code)):
        path = Path(a.out) / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
        print(f"wrote {path}: {len(docs)} documents, {sum(map(len, docs))} characters")


if __name__ == "__main__":
    main()
