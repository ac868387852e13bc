"""Check that transformers loads what ``jaxtp export-hf`` / ``Model.save_hf`` wrote, and that its
logits are the golden ones of the fixture it came from.

    python scripts/check_hf_export.py EXPORTED_DIR tests/fixtures/hf/NAME/golden.npz

Needs torch + transformers (not jaxtp dependencies); prints the largest logit difference.
"""

import sys

import numpy as np
import torch
import transformers


def main(exported: str, golden: str) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(exported, torch_dtype=torch.float32)
    model.eval()
    g = np.load(golden)
    with torch.no_grad():
        logits = model(torch.as_tensor(g["tokens"]).long()).logits.float().numpy()
    diff = float(np.abs(logits - g["logits"]).max())
    print(f"{type(model).__name__} loaded from {exported}: max |dlogits| vs golden = {diff:.3g}")
    if diff > 1e-4:
        sys.exit(1)


if __name__ == "__main__":
    main(*sys.argv[1:3])
