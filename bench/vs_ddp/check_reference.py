"""Checks that reference.py trains geotrain's maths: runs geotrain (one
worker, sync) and the reference on the same job for a few steps and
asserts that every step's loss, and the final validation loss, agree to
1e-5 relative. Prints both columns.

Two jobs: the shipped demo (deploy/jobs/gpt-tiny.textproto, 5 steps) and a
larger GPT written to a temporary file (d_model 512, 8 blocks, context 128,
8 heads: 25.5M parameters; 4 microbatches of 8; 2 steps, the first in the
warm-up and the second at the cosine's floor, so both branches of the
schedule are used).

Binaries: $GEOTRAIN_BIN_DIR (default <source>/build/bin; copy them first if
someone is rebuilding that tree). Run with a Python that has torch:
  GEOTRAIN_BIN_DIR=/tmp/vsddp-bin python bench/vs_ddp/check_reference.py
"""
import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE_DIR = os.environ.setdefault("GEOTRAIN_SOURCE_DIR",
                                   os.path.abspath(os.path.join(HERE, "..", "..")))
sys.path.insert(0, os.path.join(SOURCE_DIR, "tests", "integration"))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import reference  # noqa: E402
from cluster import Cluster, job_path  # noqa: E402

TOLERANCE = 1e-5

LARGE_JOB = """
name: "gpt-25m-check"
gpt { context: 128 d_model: 512 heads: 8 blocks: 8 mlp_ratio: 4 }
text { paths: "/usr/share/games/fortunes" validation_fraction: 0.05 }
optimizer {
  kind: KIND_ADAMW lr: 0.0006 weight_decay: 0.01
  warmup_fraction: 0.6 decay: DECAY_COSINE min_lr_fraction: 0.1
}
schedule: SCHEDULE_SYNC
steps: 2
microbatches: 4
microbatch_size: 8
seed: 3
min_workers: 1
eval_every: 0
eval_batches: 2
checkpoint_every: 1000
"""


def run_geotrain(job_file, steps, timeout):
    flags = [f"--steps={steps}", "--min_workers=1", "--schedule=sync"]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="vs-ddp-geotrain-") as d, \
            Cluster(job_file, flags, workdir=d) as c:
        c.train(1, timeout=timeout)
        losses = [m["loss"] for m in sorted(c.steps(), key=lambda m: m["step"])]
        evals = [m["val_loss"] for m in sorted(c.evals(), key=lambda m: m["step"])]
    return losses, evals, time.monotonic() - started


def run_reference(job_file, steps):
    started = time.monotonic()
    job = reference.load_job(job_file, steps=steps)
    losses, evals = [], []
    for record in reference.train(job):
        losses.append(record["loss"])
        if "val_loss" in record:
            evals.append(record["val_loss"])
    return losses, evals, time.monotonic() - started


def compare(name, job_file, steps, timeout):
    print(f"== {name}: {job_file}, {steps} steps, 1 worker, sync", flush=True)
    g_losses, g_evals, g_time = run_geotrain(job_file, steps, timeout)
    r_losses, r_evals, r_time = run_reference(job_file, steps)
    print(f"   geotrain {g_time:.1f} s (with startup), reference {r_time:.1f} s")
    print(f"   {'step':>4}  {'geotrain':>12}  {'reference':>12}  {'rel diff':>9}")
    worst = 0.0
    rows = [(str(i + 1), g, r) for i, (g, r) in enumerate(zip(g_losses, r_losses))]
    rows += [("val", g, r) for g, r in zip(g_evals, r_evals)]
    for label, g, r in rows:
        rel = abs(g - r) / abs(g)
        worst = max(worst, rel)
        print(f"   {label:>4}  {g:12.8f}  {r:12.8f}  {rel:9.2e}")
    failures = []
    if len(g_losses) != steps or len(r_losses) != steps:
        failures.append(f"{len(g_losses)} geotrain and {len(r_losses)} reference losses, "
                        f"want {steps}")
    if len(g_evals) != len(r_evals) or not g_evals:
        failures.append(f"{len(g_evals)} geotrain and {len(r_evals)} reference evaluations")
    if worst > TOLERANCE:
        failures.append(f"largest relative difference {worst:.2e} > {TOLERANCE:g}")
    print(f"   worst relative difference {worst:.2e}: {'FAIL' if failures else 'ok'}", flush=True)
    return failures


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="steps of the demo job")
    parser.add_argument("--skip_large", action="store_true", help="only the demo job")
    args = parser.parse_args()
    torch.set_num_threads(1)
    failures = compare("demo", job_path("gpt-tiny.textproto"), args.steps, timeout=300)
    if not args.skip_large:
        with tempfile.TemporaryDirectory(prefix="vs-ddp-check-") as d:
            large = os.path.join(d, "gpt-25m.textproto")
            with open(large, "w") as f:
                f.write(LARGE_JOB)
            failures += compare("large", large, 2, timeout=900)
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        return 1
    print(f"reference matches geotrain to {TOLERANCE:g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
