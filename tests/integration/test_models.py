"""Models and data people use, with real processes: the LLaMA-family decoder
and token-file datasets made by deploy/tokenize.py."""
import array
import json
import math
import os
import struct
import subprocess
import tempfile
import unittest

from cluster import SOURCE_DIR, Cluster, job_path, wait_for

TOKENIZE = os.path.join(SOURCE_DIR, "deploy", "tokenize.py")
# Debian's python, which has python3-sentencepiece (deploy/install-deps.sh).
DEBIAN_PYTHON = "/usr/bin/python3"


def tokenize_fortunes(out, vocab=1024):
    done = subprocess.run([DEBIAN_PYTHON, TOKENIZE, f"--out={out}", f"--vocab={vocab}",
                           "/usr/share/games/fortunes"],
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"tokenize.py failed:\n{done.stdout}{done.stderr}")
    return done.stdout


def llama_tokens_job(path, train, val, vocab, steps, min_workers=2):
    with open(path, "w") as f:
        f.write(f"""
name: "llama-tokens"
llama {{ context: 32 d_model: 64 heads: 4 kv_heads: 2 blocks: 2 vocab: {vocab} }}
tokens {{ train: "{train}" validation: "{val}" dtype: UINT16 }}
optimizer {{ kind: KIND_ADAMW lr: 0.003 }}
schedule: SCHEDULE_SYNC
steps: {steps}
microbatches: 2
microbatch_size: 8
seed: 4
min_workers: {min_workers}
eval_every: {steps}
eval_batches: 4
""")
    return path


class ModelsTest(unittest.TestCase):
    def test_llama_sync_pipeline_matches_single_process(self):
        """sync over 3 workers gives the same per-step losses as 1, for LLaMA."""
        losses = {}
        for workers in (1, 3):
            with Cluster(job_path("llama-tiny.textproto"),
                         ["--steps=8", f"--min_workers={workers}", "--seed=5"]) as c:
                c.train(workers, timeout=300)
                self.assertEqual(len(c.status()["workers"]), workers)
                losses[workers] = [m["loss"] for m in c.steps()]
        self.assertEqual(len(losses[1]), 8)
        self.assertEqual(len(losses[3]), 8)
        # Bytes at initialisation: near ln(256).
        self.assertLess(abs(losses[1][0] - math.log(256)), 0.5, losses[1][0])
        print("llama-tiny per-step losses, 1 worker vs 3 workers:")
        for step, (one, three) in enumerate(zip(losses[1], losses[3]), start=1):
            print(f"  step {step}: {one:.7f} {three:.7f}")
            self.assertLessEqual(abs(one - three) / abs(one), 1e-4,
                                 f"step {step}: 1 worker {one}, 3 workers {three}")
        self.assertLess(losses[1][-1], losses[1][0])

    def test_llama_small_sync_over_3_workers_matches_1(self):
        """The shipped llama-small (21.9M parameters, context 256) under sync:
        3 workers give the same per-step losses as 1. Its token files are
        replaced by random ids below its vocabulary (the maths, not the
        data, is what is compared), and it runs 3 steps without checkpoints
        or evaluations."""
        with open(job_path("llama-small.textproto")) as f:
            shipped = f.read()
        with tempfile.TemporaryDirectory() as d:
            ids = array.array("H", ((i * 2654435761 >> 7) % 4096 for i in range(200000)))
            for name in ("train.bin", "val.bin"):
                with open(os.path.join(d, name), "wb") as f:
                    ids.tofile(f)
            lines = []
            for line in shipped.splitlines():
                key = line.split(":")[0].strip()
                if key in ("schedule", "eval_every", "checkpoint_every"):
                    continue
                if key in ("train", "validation"):
                    line = f'  {key}: "{os.path.join(d, "train.bin" if key == "train" else "val.bin")}"'
                lines.append(line)
            job = os.path.join(d, "llama-small.textproto")
            with open(job, "w") as f:
                f.write("\n".join(lines) +
                        "\nschedule: SCHEDULE_SYNC\neval_every: 0\ncheckpoint_every: -1\n")
            losses = {}
            for workers in (1, 3):
                with Cluster(job, ["--steps=3", f"--min_workers={workers}"]) as c:
                    c.train(workers, timeout=300)
                    self.assertEqual(len(c.status()["workers"]), workers)
                    losses[workers] = [m["loss"] for m in c.steps()]
        print("llama-small per-step losses, 1 worker vs 3 workers:")
        self.assertEqual(len(losses[1]), 3)
        self.assertEqual(len(losses[3]), 3)
        # A 4096-token vocabulary at initialisation: near ln(4096).
        self.assertLess(abs(losses[1][0] - math.log(4096)), 0.5, losses[1][0])
        for step, (one, three) in enumerate(zip(losses[1], losses[3]), start=1):
            print(f"  step {step}: {one:.7f} {three:.7f}")
            self.assertLessEqual(abs(one - three) / abs(one), 1e-4,
                                 f"step {step}: 1 worker {one}, 3 workers {three}")

    def test_tied_embeddings_over_3_workers_match_1(self):
        """tie_embeddings: the first and the last stage trade the tied
        matrix's gradient at every update, so 3 workers still train as 1."""
        with tempfile.TemporaryDirectory() as d:
            with open(job_path("llama-tiny.textproto")) as f:
                text = f.read().replace("llama {", "llama {\n  tie_embeddings: true", 1)
            job = os.path.join(d, "tied.textproto")
            with open(job, "w") as f:
                f.write(text)
            losses = {}
            for workers in (1, 3):
                with Cluster(job, ["--steps=6", f"--min_workers={workers}", "--seed=5"]) as c:
                    c.train(workers, timeout=300)
                    losses[workers] = [m["loss"] for m in c.steps()]
        print("tied llama-tiny per-step losses, 1 worker vs 3 workers:")
        for step, (one, three) in enumerate(zip(losses[1], losses[3]), start=1):
            print(f"  step {step}: {one:.7f} {three:.7f}")
            self.assertLessEqual(abs(one - three) / abs(one), 1e-4,
                                 f"step {step}: 1 worker {one}, 3 workers {three}")
        self.assertEqual(len(losses[3]), 6)
        self.assertLess(losses[1][-1], losses[1][0])

    def test_llama_trains_on_token_files(self):
        with tempfile.TemporaryDirectory() as d:
            print(tokenize_fortunes(os.path.join(d, "tok")).strip())
            train = os.path.join(d, "tok", "train.bin")
            val = os.path.join(d, "tok", "val.bin")
            job = llama_tokens_job(os.path.join(d, "job.textproto"), train, val, 1024, 40)
            with Cluster(job) as c:
                c.train(2, timeout=300)
                steps = c.steps()
                evals = c.evals()
            self.assertEqual(len(steps), 40)
            # A 1024-token vocabulary at initialisation: near ln(1024).
            self.assertLess(abs(steps[0]["loss"] - math.log(1024)), 0.5, steps[0]["loss"])
            first = sum(s["loss"] for s in steps[:5]) / 5
            last = sum(s["loss"] for s in steps[-5:]) / 5
            print(f"llama on fortunes tokens: loss {first:.3f} -> {last:.3f} over 40 steps; "
                  f"held-out {evals[-1]['val_loss'] if evals else None}")
            # It learns: 40 steps took 0.8 nats off here.
            self.assertLess(last, first - 0.5)
            self.assertTrue(evals, "no evaluation on val.bin")
            self.assertLess(evals[-1]["val_loss"], math.log(1024) - 0.5)

    def test_export_writes_hugging_face_safetensors_and_config(self):
        """--export_dir: at the job's end the newest complete checkpoint step
        is written as LlamaForCausalLM's safetensors and config.json."""
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "export")
            with Cluster(job_path("llama-tiny.textproto"),
                         ["--steps=10", "--min_workers=2", f"--export_dir={out}"]) as c:
                c.train(2, timeout=300)
                wait_for(lambda: any(e["kind"] in ("exported", "export_failed")
                                     for e in c.status()["events"]), 30, "the export")
                events = [e for e in c.status()["events"] if e["kind"].startswith("export")]
            print(events[-1]["detail"])
            self.assertEqual(events[-1]["kind"], "exported", events[-1])
            self.assertIn("of step 10 ", events[-1]["detail"])
            with open(os.path.join(out, "config.json")) as f:
                config = json.load(f)
            self.assertEqual(config["architectures"], ["LlamaForCausalLM"])
            self.assertEqual((config["hidden_size"], config["num_hidden_layers"],
                              config["num_attention_heads"], config["num_key_value_heads"],
                              config["intermediate_size"], config["vocab_size"]),
                             (128, 4, 4, 2, 384, 256))
            with open(os.path.join(out, "model.safetensors"), "rb") as f:
                length = struct.unpack("<Q", f.read(8))[0]
                header = json.loads(f.read(length))
                size = os.path.getsize(os.path.join(out, "model.safetensors"))
            self.assertEqual(header["__metadata__"]["format"], "pt")
            names = {n for n in header if n != "__metadata__"}
            expected = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
            for i in range(4):
                for part in ("input_layernorm", "post_attention_layernorm"):
                    expected.add(f"model.layers.{i}.{part}.weight")
                for proj in ("q", "k", "v", "o"):
                    expected.add(f"model.layers.{i}.self_attn.{proj}_proj.weight")
                for proj in ("gate", "up", "down"):
                    expected.add(f"model.layers.{i}.mlp.{proj}_proj.weight")
            self.assertEqual(names, expected)
            self.assertEqual(header["model.layers.2.self_attn.k_proj.weight"]["shape"], [64, 128])
            end = max(t["data_offsets"][1] for n, t in header.items() if n != "__metadata__")
            self.assertEqual(8 + length + end, size)
            self.assertTrue(all(t["dtype"] == "F32" for n, t in header.items()
                                if n != "__metadata__"))

    def test_ctl_exports_a_running_job(self):
        """geotrain-ctl export against a live coordinator: refused with a
        reason before every layer has a checkpoint, then the newest
        complete model, byte for byte what --export_dir writes for that
        step."""
        with tempfile.TemporaryDirectory() as d:
            job = os.path.join(d, "llama-tiny-5.textproto")
            with open(job_path("llama-tiny.textproto")) as f, open(job, "w") as out:
                out.write(f.read() + "\ncheckpoint_every: 5\n")
            with Cluster(job, ["--steps=100000", "--min_workers=2"]) as c:
                c.start_coordinator()
                early = c.ctl("export", f"--out={d}/early")
                self.assertNotEqual(early.returncode, 0)
                self.assertIn("no step has a checkpoint of every layer", early.stderr)
                c.start_worker("w0")
                c.start_worker("w1")
                wait_for(lambda: (lambda s: s["checkpoint_steps"] and
                                  min(s["checkpoint_steps"]) >= 5)(c.status()), 120,
                         "a checkpoint of every layer")
                out = c.ctl("export", f"--out={d}/live")
                self.assertEqual(out.returncode, 0, out.stderr)
                print(out.stdout.strip())
                self.assertIn("model.safetensors, config.json", out.stdout)
                step = int(out.stdout.split("exported step ")[1].split()[0])
                self.assertGreaterEqual(step, 5)
                self.assertTrue(any(e["kind"] == "exported" and "geotrain-ctl" in e["detail"]
                                    for e in c.status()["events"]))
            self.assertEqual(sorted(os.listdir(f"{d}/live")), ["config.json", "model.safetensors"])
            with open(f"{d}/live/model.safetensors", "rb") as f:
                length = struct.unpack("<Q", f.read(8))[0]
                header = json.loads(f.read(length))
            self.assertIn("model.layers.3.mlp.down_proj.weight", header)
            end = max(t["data_offsets"][1] for n, t in header.items() if n != "__metadata__")
            self.assertEqual(8 + length + end, os.path.getsize(f"{d}/live/model.safetensors"))

    def test_out_of_range_token_ids_are_an_error_at_start_naming_the_file(self):
        with tempfile.TemporaryDirectory() as d:
            bad = os.path.join(d, "bad.bin")
            ids = array.array("H", [i % 1000 for i in range(5000)])
            ids[1234] = 4000  # past a vocabulary of 1024
            with open(bad, "wb") as f:
                ids.tofile(f)
            good = os.path.join(d, "good.bin")
            with open(good, "wb") as f:
                array.array("H", [i % 1000 for i in range(5000)]).tofile(f)
            job = llama_tokens_job(os.path.join(d, "job.textproto"), bad, good, 1024, 5,
                                   min_workers=1)
            with Cluster(job) as c:
                c.start_coordinator()
                worker = c.start_worker("w0")
                wait_for(lambda: "out of range" in worker.log(), 60,
                         "the worker to refuse the token file")
                log = worker.log()
                self.assertIn(f"{bad}: token id 4000 at position 1234 is out of range for a "
                              "vocabulary of 1024", log)
                self.assertEqual(c.status().get("step", 0), 0)  # nothing trained on it


if __name__ == "__main__":
    unittest.main()
