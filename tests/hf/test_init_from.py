"""Fine-tuning a Hugging Face model: transformers builds a tiny LLaMA (random
init, save_pretrained, nothing downloaded); a geotrain job starts from it
with init_from and an empty llama {} block, on 2 workers.

- The first step's loss (weights as imported, before any update) equals the
  loss transformers computes for the same model and batch, within 1e-4
  relative. The token files hold context + 1 tokens, so every window the
  job draws is the same one: the batch is fixed.
- After training, the coordinator's export loads with
  LlamaForCausalLM.from_pretrained, and its logits on that batch match
  geotrain's own forward of the same weights (geotrain-eval) within 1e-4.
- A job whose llama block disagrees with config.json is refused, naming
  both.

Run by tests/run.sh with the torch wheel's venv (transformers installed)."""
import json
import os
import subprocess
import sys
import tempfile
import unittest

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "integration"))
from cluster import Cluster, binary, wait_for  # noqa: E402

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

CONTEXT = 32
VOCAB = 320


def tiny_llama(path, tied=False):
    torch.manual_seed(11)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=192,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, rope_theta=10000.0, rms_norm_eps=1e-6,
                         tie_word_embeddings=tied, attention_bias=False, mlp_bias=False)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    return model


def write_job(path, model_dir, tokens, block="", steps=6):
    with open(path, "w") as f:
        f.write(f"""
name: "hf-init"
init_from: "{model_dir}"
llama {{ context: {CONTEXT} {block} }}
tokens {{ train: "{tokens}" validation: "{tokens}" dtype: UINT16 }}
optimizer {{ kind: KIND_ADAMW lr: 0.01 }}
schedule: SCHEDULE_SYNC
steps: {steps}
microbatches: 2
microbatch_size: 2
seed: 3
min_workers: 2
checkpoint_every: 3
eval_every: {steps}
eval_batches: 1
""")
    return path


def hf_logits(model, window):
    with torch.no_grad():
        return model(input_ids=torch.tensor([window[:-1]])).logits[0].double()


def hf_loss(model, window):
    logits = hf_logits(model, window)
    return torch.nn.functional.cross_entropy(logits, torch.tensor(window[1:])).item()


class InitFromTest(unittest.TestCase):
    def test_fine_tunes_a_transformers_model_and_exports_it_back(self):
        self.fine_tune_and_export(tied=False)

    def test_tied_embeddings_fine_tune_and_export_back(self):
        """tie_word_embeddings: transformers saves the embedding alone; the
        head on the other worker starts from it, and the two copies train
        as one matrix (their gradients traded at each update)."""
        self.fine_tune_and_export(tied=True)

    def fine_tune_and_export(self, tied):
        with tempfile.TemporaryDirectory() as d:
            model_dir = os.path.join(d, "hf")
            model = tiny_llama(model_dir, tied)
            model.eval()
            window = np.random.default_rng(5).integers(0, VOCAB, CONTEXT + 1).astype(np.uint16)
            tokens = os.path.join(d, "tokens.bin")
            window.tofile(tokens)
            window = [int(t) for t in window]
            expected = hf_loss(model, window)

            export = os.path.join(d, "export")
            job = write_job(os.path.join(d, "job.textproto"), model_dir, tokens)
            with Cluster(job, [f"--export_dir={export}"]) as c:
                c.train(2, timeout=300)
                wait_for(lambda: any(e["kind"] in ("exported", "export_failed")
                                     for e in c.status()["events"]), 30, "the export")
                events = c.status()["events"]
                losses = [m["loss"] for m in c.steps()]
            imported = [e for e in events if e["kind"] == "imported"]
            self.assertTrue(imported, events)
            self.assertIn("5 layers", imported[0]["detail"])  # embedding, 3 blocks, head
            self.assertEqual([e for e in events if e["kind"].startswith("export")][-1]["kind"],
                             "exported")
            print(f"tied {tied}: step 1 loss: geotrain {losses[0]:.7f}, transformers {expected:.7f}; "
                  f"after {len(losses)} steps {losses[-1]:.4f}")
            self.assertLess(abs(losses[0] - expected) / expected, 1e-4)
            # It trained: the loss on the one window fell.
            self.assertLess(losses[-1], losses[0] - 0.1)

            with open(os.path.join(export, "config.json")) as f:
                self.assertEqual(json.load(f)["tie_word_embeddings"], tied)
            trained, info = LlamaForCausalLM.from_pretrained(export, torch_dtype=torch.float32,
                                                             output_loading_info=True)
            self.assertFalse(info["missing_keys"] or info["unexpected_keys"], info)
            trained.eval()
            logits_path = os.path.join(d, "logits.bin")
            done = subprocess.run([binary("geotrain-eval"), f"--model={export}",
                                   f"--tokens={tokens}", f"--context={CONTEXT}",
                                   "--max_windows=1", f"--logits_out={logits_path}"],
                                  capture_output=True, text=True, timeout=120)
            self.assertEqual(done.returncode, 0, done.stderr)
            ours = np.fromfile(logits_path, dtype=np.float32).reshape(CONTEXT, VOCAB)
            theirs = hf_logits(trained, window).numpy()
            gap = float(np.abs(ours - theirs).max())
            print(f"exported model: max |logit gap| {gap:.2e} over {ours.size} logits; "
                  f"geotrain-eval loss {json.loads(done.stdout)['loss']:.6f}, "
                  f"transformers {hf_loss(trained, window):.6f}")
            self.assertLess(gap, 1e-4)
            # The export is the trained model, not the one we started from.
            self.assertGreater(float(np.abs(theirs - hf_logits(model, window).numpy()).max()),
                               0.01)

    def test_a_block_that_disagrees_with_config_json_is_refused(self):
        with tempfile.TemporaryDirectory() as d:
            model_dir = os.path.join(d, "hf")
            tiny_llama(model_dir)
            tokens = os.path.join(d, "tokens.bin")
            np.zeros(CONTEXT + 1, dtype=np.uint16).tofile(tokens)
            job = write_job(os.path.join(d, "job.textproto"), model_dir, tokens,
                            block="d_model: 128")
            done = subprocess.run([binary("geotrain-coordinator"), f"--job={job}", "--insecure",
                                   f"--state_dir={d}/state", "--listen=127.0.0.1:0"],
                                  capture_output=True, text=True, timeout=60)
            self.assertNotEqual(done.returncode, 0)
            self.assertIn("llama.d_model is 128", done.stderr)
            self.assertIn(os.path.join(model_dir, "config.json"), done.stderr)
            self.assertIn("hidden_size 64", done.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
