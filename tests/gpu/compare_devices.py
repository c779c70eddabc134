#!/usr/bin/env python3
"""Trains the demo job under `sync` with 3 workers on the CPU and then on
--device (workers sharing it), and checks that the per-step losses agree
within a relative 1e-3 (LibTorch keeps TF32 off for fp32 matmuls by default,
so the remaining differences are summation order). Prints samples/s of both.

Then the spot checks across devices (issue 35): two pipelines of two
stages with `verification { fraction: 0.05 }` over TLS, pipeline 0 on
--device and pipeline 1 on the CPU, so that each pipeline's computations
are recomputed on the other's device; in CPU mode pipeline 1 runs
OpenBLAS's generic kernel instead. With --other_bin_dir, pipeline 1's
workers are another build's (tests/run.sh: Debian's LibTorch beside the
wheel's). Every worker is honest: no audit may fail, no verifier be
caught and nobody be evicted, some audits must pass, and at most one
verdict in 10,000 audits drawn (one in a short run) may fail: with two
pipelines a failed first verdict has no second verifier to overturn it.

Exits non-zero on any difference beyond the tolerance, a failed audit or a
failed run.

  GEOTRAIN_BIN_DIR=build-wheel/bin tests/gpu/compare_devices.py --device=cuda:0
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "integration"))
import cluster  # noqa: E402
from test_pipelines import PipelinesCluster  # noqa: E402

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


def audit_line(status):
    audits = status.get("audits", {})
    return (f"audits drawn {audits.get('drawn', 0)}, passed {audits.get('passed', 0)}, failed "
            f"{audits.get('failed', 0)}, verifiers caught {audits.get('verifiers_caught', 0)}, "
            f"undecided {audits.get('undecided', 0)}, disputes {audits.get('disputes', 0)}")


def check_audits(device, steps, other_bin_dir, minutes=0):
    """The honest spot-check run (see above), `steps` long or, with
    `minutes`, that long (a progress line a minute): returns a line of
    figures and whether it passed."""
    started = time.monotonic()
    if minutes > 0:
        steps = 5_000_000
    with PipelinesCluster(steps, 8, streaming=False, secure=True, workers=4) as c:
        with open(c.job, "a") as f:
            f.write("verification { fraction: 0.05 }\n")
        c.start_coordinator()
        token = c.create_token("--uses=4", "--name=gpu-check")
        # Join order: w0 and w1 are pipeline 0, w2 and w3 pipeline 1.
        for i in range(4):
            other = i >= 2
            env = None
            if other and device == "cpu":
                env = dict(os.environ, OPENBLAS_CORETYPE="Prescott")
            worker_binary = None
            if other and other_bin_dir:
                worker_binary = os.path.join(other_bin_dir, "geotrain-worker")
            c.start_worker(f"w{i}", [f"--token={token}", f"--device={'cpu' if other else device}",
                                     "--threads=0"], env=env, worker_binary=worker_binary)
            cluster.wait_for(lambda: len(c.status()["workers"]) == i + 1, 120,
                             f"worker {i} to join")
        try:
            if minutes > 0:
                while time.monotonic() - started < minutes * 60:
                    time.sleep(60)
                    status = c.status()
                    rss = max(int(w.get("rss_bytes", 0)) for w in status["workers"])
                    print(f"  {(time.monotonic() - started) / 60:.0f} min: step {status['step']}, "
                          f"{audit_line(status)}; largest worker RSS {rss / 2**20:.0f} MiB",
                          flush=True)
                    if any(p.popen.poll() is not None for p in c.workers):
                        raise RuntimeError("a worker exited")
            else:
                c.wait_done(timeout=900)
        except Exception:
            print(c.dump_logs())
            raise
        c.ctl("status")  # the events log is written off the caller's thread
        status = c.status()
        steps = int(status["step"])
        with open(os.path.join(c.dir, "state", "events.log")) as f:
            kinds = [json.loads(line)["kind"] for line in f if line.strip()]
    audits = status.get("audits", {})
    count = lambda key: int(audits.get(key, 0))  # noqa: E731
    devices = sorted({f"{w['device']}/{w.get('blas', '')}" for w in status["workers"]})
    line = (f"{steps} steps in {time.monotonic() - started:.0f} s on {devices}"
            + (f", pipeline 1 from {other_bin_dir}" if other_bin_dir else "")
            + f": {audit_line(status)}; failed verdicts {kinds.count('audit_failed')}, "
            f"evictions {kinds.count('audit_evicted')}")
    # A failed verdict is an honest worker one verifier short of eviction
    # (with two pipelines there is no second to ask). Across the two
    # builds, early in training, they are rare (2 in the first 70,000
    # audits of a 30-minute run) but they grow as the MLP overtrains (37 in
    # 139,000 by its end: still to fix, docs/verification.md); so at most
    # one per 10,000 drawn (one in the short run CI makes), where a wrong
    # tolerance fails thousands.
    ok = (count("passed") > 0 and count("failed") == 0 and count("verifiers_caught") == 0
          and count("disputes") == 0 and "audit_evicted" not in kinds
          and kinds.count("audit_failed") <= max(1, count("drawn") // 10000))
    return line, ok


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--audit_steps", type=int, default=400,
                        help="steps of the honest spot-check run (0: skip it)")
    parser.add_argument("--other_bin_dir", default="",
                        help="another build's bin directory for pipeline 1's workers")
    parser.add_argument("--audit_minutes", type=float, default=0,
                        help="run the spot-check job this long instead of --audit_steps")
    parser.add_argument("--audits_only", action="store_true",
                        help="skip the loss comparison")
    args = parser.parse_args()
    if args.audits_only:
        line, ok = check_audits(args.device, args.audit_steps, args.other_bin_dir,
                                args.audit_minutes)
        print(f"spot checks, pipeline 0 on {args.device} and pipeline 1 on cpu: {line}")
        return 0 if ok else 1

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
    if args.audit_steps > 0:
        line, ok = check_audits(args.device, args.audit_steps, args.other_bin_dir,
                                args.audit_minutes)
        print(f"spot checks, pipeline 0 on {args.device} and pipeline 1 on cpu: {line}")
        if not ok:
            print("FAIL: an honest run failed, disputed or evicted on a spot check")
            return 1
    print("gpu check: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
