"""geotrain's export, loaded by Hugging Face transformers: llama-tiny trains
20 steps on 2 workers (the daemons of the tree GEOTRAIN_BIN_DIR names), the
coordinator's --export_dir writes the model, and LlamaForCausalLM reads it
with no missing or unexpected weights and scores fortunes bytes well below
a uniform guess. Run by tests/run.sh with the torch wheel's venv, into which
it installs transformers."""
import math
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "integration"))
from cluster import Cluster, job_path, wait_for  # noqa: E402

import torch  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402


class ExportLoadsTest(unittest.TestCase):
    def test_llama_export_loads_in_transformers(self):
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "export")
            with Cluster(job_path("llama-tiny.textproto"),
                         ["--steps=20", "--min_workers=2", f"--export_dir={out}"]) as c:
                c.train(2, timeout=300)
                wait_for(lambda: any(e["kind"] in ("exported", "export_failed")
                                     for e in c.status()["events"]), 30, "the export")
                events = [e for e in c.status()["events"] if e["kind"].startswith("export")]
                val_loss = c.evals()[-1]["val_loss"]
            self.assertEqual(events[-1]["kind"], "exported", events[-1])
            model, info = LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float32,
                                                           output_loading_info=True)
            self.assertEqual(info["missing_keys"], [] if isinstance(info["missing_keys"], list)
                             else set(), info)
            self.assertFalse(info["unexpected_keys"], info)
            model.eval()
            with open("/usr/share/games/fortunes/fortunes", "rb") as f:
                text = f.read()
            generator = torch.Generator().manual_seed(0)
            starts = torch.randint(0, len(text) - 65, (32,), generator=generator)
            batch = torch.tensor([list(text[s:s + 65]) for s in starts.tolist()])
            with torch.no_grad():
                logits = model(input_ids=batch[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256),
                                                     batch[:, 1:].reshape(-1)).item()
            print(f"transformers scores the export {loss:.4f} on 32 fortunes windows "
                  f"(geotrain's validation loss {val_loss:.4f}; uniform {math.log(256):.4f})")
            # Mis-mapped weights score at or above uniform; trained ones near
            # geotrain's own figure.
            self.assertLess(loss, math.log(256) - 1.0)
            self.assertLess(abs(loss - val_loss), 0.5)


if __name__ == "__main__":
    unittest.main(verbosity=2)
