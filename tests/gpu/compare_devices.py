#!/usr/bin/env python3
"""Trains the demo job under `sync` with 3 workers on the CPU and then on
--device (workers sharing it), and checks that the per-step losses agree
within a relative 1e-3 (LibTorch keeps TF32 off for fp32 matmuls by default,
so the remaining differences are summation order). Prints samples/s of both.
Exits non-zero on any difference beyond the tolerance or a failed run.

  GEOTRAIN_BIN_DIR=build-wheel/bin tests/gpu/compare_devices.py --device=cuda:0
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "integration"))
import cluster  # noqa: E402

TOLERANCE = 1e-3


def train(device, steps):
    with cluster.Cluster(cluster.job_path("gpt-tiny.textproto"),
                         ["--schedule=sync", f"--steps={steps}", "--min_workers=3"]) as c:
        c.start_coordinator()
        for i in range(3):
            c.start_worker(f"w{i}", [f"--device={device}", "--threads=0"])
        try:
            c.wait_done(timeout=600)
        except Exception:
            print(c.dump_logs())
            raise
        steps_log = c.steps()
        status = c.status()
    losses = {m["step"]: m["loss"] for m in steps_log}
    # Steady state: the last 2/3 of the run.
    tail = steps_log[len(steps_log) // 3:]
    rate = 0.0
    if len(tail) >= 2 and tail[-1]["time_s"] > tail[0]["time_s"]:
        rate = (tail[-1]["samples"] - tail[0]["samples"]) / (tail[-1]["time_s"] - tail[0]["time_s"])
    devices = sorted({w["device"] for w in status["workers"]})
    blas = sorted({w.get("blas", "") for w in status["workers"]})
    return losses, rate, devices, blas


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()

    cpu_losses, cpu_rate, cpu_devices, blas = train("cpu", args.steps)
    print(f"cpu: {len(cpu_losses)} steps, {cpu_rate:.1f} samples/s, devices {cpu_devices}, BLAS {blas}")
    dev_losses, dev_rate, dev_devices, _ = train(args.device, args.steps)
    print(f"{args.device}: {len(dev_losses)} steps, {dev_rate:.1f} samples/s, devices {dev_devices}")
    if args.device != "cpu" and not all(d.startswith("cuda") for d in dev_devices):
        print(f"FAIL: workers ran on {dev_devices}, not {args.device}")
        return 1

    common = sorted(set(cpu_losses) & set(dev_losses))
    if len(common) < args.steps:
        print(f"FAIL: only {len(common)} of {args.steps} steps in both runs")
        return 1
    worst_step, worst = None, 0.0
    for step in common:
        a, b = cpu_losses[step], dev_losses[step]
        rel = abs(a - b) / max(abs(a), 1e-12)
        if rel > worst:
            worst_step, worst = step, rel
    print(f"per-step losses over {len(common)} steps: worst relative difference {worst:.2e}"
          + (f" at step {worst_step}" if worst_step is not None else "")
          + f" (tolerance {TOLERANCE:g})")
    print(f"first loss cpu {cpu_losses[common[0]]:.6f} {args.device} {dev_losses[common[0]]:.6f}; "
          f"last cpu {cpu_losses[common[-1]]:.6f} {args.device} {dev_losses[common[-1]]:.6f}")
    print(f"samples/s: {args.device} {dev_rate:.1f} vs cpu {cpu_rate:.1f} "
          f"({dev_rate / cpu_rate if cpu_rate else float('nan'):.2f}x)")
    if worst > TOLERANCE:
        print("FAIL: losses differ beyond the tolerance")
        return 1
    print("gpu check: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
