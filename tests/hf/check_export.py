"""Loads a directory geotrain exported (--export_dir) with Hugging Face
transformers and scores 32 fixed windows of the fortunes as bytes.

By hand (tests/hf/test_export_loads.py is the automatic check); run it
with a Python that has torch and transformers, e.g. the wheel tree's venv:

  build-wheel/torch-venv/bin/pip install transformers
  build-wheel/torch-venv/bin/python tests/hf/check_export.py DIR

A wrong name or layout fails from_pretrained, or scores at or above the
uniform ln(256) = 5.545 nats.
"""
import json
import math
import os
import sys

import torch
from transformers import LlamaForCausalLM


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    directory = sys.argv[1]
    model = LlamaForCausalLM.from_pretrained(directory, torch_dtype=torch.float32)
    model.eval()
    with open("/usr/share/games/fortunes/fortunes", "rb") as f:
        text = f.read()
    with open(os.path.join(directory, "config.json")) as f:
        context = json.load(f)["max_position_embeddings"]
    generator = torch.Generator().manual_seed(0)
    starts = torch.randint(0, len(text) - context - 1, (32,), generator=generator)
    batch = torch.tensor([list(text[s:s + context + 1]) for s in starts.tolist()])
    with torch.no_grad():
        logits = model(input_ids=batch[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                             batch[:, 1:].reshape(-1))
    print(f"transformers loaded {sum(p.numel() for p in model.parameters())} parameters; "
          f"loss on 32 fortunes windows {loss.item():.4f} (uniform {math.log(256):.4f})")
    sys.exit(0 if loss.item() < math.log(256) else 1)


if __name__ == "__main__":
    main()
