#!/usr/bin/env python3
"""Runs a whole geotrain job on this machine with every pipeline link shaped
like a WAN link by geotrain-linkem.

Worker k listens on a port of its own, and a relay in front of it (delay and
rate in each direction) is what every peer dials: each worker gets
--route=<worker k>=<relay k> for all k. Links are dialled by the upstream
stage, so every stage-to-stage link passes exactly one relay, whichever
stages the planner assigns. Control traffic to the coordinator is not shaped.

  deploy/wan-lab/wan_job.py --job=deploy/jobs/gpt-tiny.textproto --workers=3 \\
      --profile=home-100mbit [--coordinator_flag=--activation_codec=int8 ...]

Prints progress while it runs and, at the end, samples/s over the steady
state (the first quarter of the steps skipped), the loss, and each link's
codec, bytes and goodput. Logs stay in --workdir (a temporary dir by default).
"""
import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def free_ports(count):
    """`count` distinct ports that were free a moment ago (all bound at
    once, so that none is handed out twice)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class WanJob:
    """A coordinator, `workers` workers and one relay per worker."""

    def __init__(self, job, workers, shaping, coordinator_flags=(), worker_flags=(),
                 bin_dir=None, workdir=None, threads=1):
        self.bin_dir = bin_dir or os.path.join(ROOT, "build", "bin")
        self.dir = workdir or tempfile.mkdtemp(prefix="geotrain-wan-")
        os.makedirs(self.dir, exist_ok=True)
        self.job = job
        self.num_workers = workers
        self.shaping = list(shaping)  # geotrain-linkem flags
        self.coordinator_flags = list(coordinator_flags)
        self.worker_flags = list(worker_flags)
        self.threads = threads
        self.processes = []
        ports = free_ports(1 + 2 * workers)
        self.port = ports[0]
        self.listen_ports = ports[1:1 + workers]
        self.relay_ports = ports[1 + workers:]

    def _start(self, name, args):
        log = open(os.path.join(self.dir, f"{name}.log"), "wb")
        p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True)
        p.name = name
        p.log_file = log
        self.processes.append(p)
        return p

    def _bin(self, name):
        return os.path.join(self.bin_dir, name)

    def start(self):
        self.coordinator = self._start("coordinator", [
            self._bin("geotrain-coordinator"), f"--listen=127.0.0.1:{self.port}",
            f"--job={self.job}", f"--state_dir={os.path.join(self.dir, 'state')}",
            "--exit_when_done", "--insecure"] + self.coordinator_flags)
        listen, relays = self.listen_ports, self.relay_ports
        for k in range(self.num_workers):
            self._start(f"linkem{k}", [self._bin("geotrain-linkem"),
                                       f"--listen=127.0.0.1:{relays[k]}",
                                       f"--target=127.0.0.1:{listen[k]}"] + self.shaping)
        routes = ",".join(f"127.0.0.1:{listen[k]}=127.0.0.1:{relays[k]}"
                          for k in range(self.num_workers))
        self.workers = [self._start(f"w{k}", [
            self._bin("geotrain-worker"), f"--coordinator=127.0.0.1:{self.port}",
            f"--listen=127.0.0.1:{listen[k]}", "--device=cpu", f"--threads={self.threads}",
            f"--name=w{k}", f"--route={routes}", "--insecure"] + self.worker_flags)
            for k in range(self.num_workers)]
        return self

    def status(self):
        out = subprocess.run([self._bin("geotrain-ctl"), "status",
                              f"--coordinator=127.0.0.1:{self.port}", "--json",
                              "--timeout_ms=3000", "--insecure"], capture_output=True, text=True, timeout=30)
        return json.loads(out.stdout) if out.returncode == 0 else None

    def metrics(self):
        path = os.path.join(self.dir, "state", "metrics.jsonl")
        if not os.path.exists(path):
            return []
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]

    def wait(self, timeout, progress=True):
        """Waits for the job to end; returns the last status seen while it ran."""
        deadline = time.monotonic() + timeout
        last_status, last_print = None, 0
        while time.monotonic() < deadline:
            for p in self.workers:
                if p.poll() not in (None, 0):
                    raise RuntimeError(f"{p.name} exited with {p.returncode}; see {self.dir}")
            if self.coordinator.poll() is not None:
                if self.coordinator.returncode != 0:
                    raise RuntimeError(f"the coordinator failed; see {self.dir}")
                return last_status
            status = self.status()
            if status and status.get("workers"):
                last_status = status
                if progress and time.monotonic() - last_print > 5:
                    last_print = time.monotonic()
                    print(f"  step {status.get('step', 0)}/{status.get('steps')}  "
                          f"loss {status.get('loss', 0):.3f}  "
                          f"samples/s {status.get('samples_per_s', 0):.1f}", flush=True)
            time.sleep(0.5)
        raise TimeoutError(f"the job did not finish in {timeout} s; see {self.dir}")

    def steady_samples_per_s(self):
        steps = [m for m in self.metrics() if not m.get("eval")]
        if len(steps) < 4:
            return 0.0
        first = steps[len(steps) // 4]
        last = steps[-1]
        return (int(last["samples"]) - int(first["samples"])) / (last["time_s"] - first["time_s"])

    def close(self):
        for p in self.processes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.processes:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            p.log_file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", default=os.path.join(ROOT, "deploy", "jobs", "gpt-tiny.textproto"))
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--profile", help="a geotrain-linkem profile, e.g. home-100mbit")
    parser.add_argument("--delay_ms", type=float)
    parser.add_argument("--rate_mbit", type=float)
    parser.add_argument("--coordinator_flag", action="append", default=[],
                        help="passed to the coordinator, e.g. --coordinator_flag=--steps=50")
    parser.add_argument("--threads", type=int, default=1, help="LibTorch threads per worker")
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--workdir")
    args = parser.parse_args()
    shaping = []
    if args.profile:
        shaping.append(f"--profile={args.profile}")
    if args.delay_ms is not None:
        shaping.append(f"--delay_ms={args.delay_ms}")
    if args.rate_mbit is not None:
        shaping.append(f"--rate_mbit={args.rate_mbit}")
    if not shaping:
        parser.error("give --profile or --delay_ms/--rate_mbit")
    with WanJob(args.job, args.workers, shaping, args.coordinator_flag,
                bin_dir=os.path.join(args.build, "bin"), workdir=args.workdir,
                threads=args.threads) as job:
        print(f"logs in {job.dir}; links shaped with {' '.join(shaping)}", flush=True)
        status = job.start().wait(args.timeout)
        print(f"steady samples/s {job.steady_samples_per_s():.1f}")
        steps = [m for m in job.metrics() if not m.get("eval")]
        if steps:
            print(f"loss {steps[0]['loss']:.3f} -> {steps[-1]['loss']:.3f} over {len(steps)} steps")
        for w in (status or {}).get("workers", []):
            for link in w.get("links", []):
                print(f"  {w['name']} {link['direction']:>10} -> {link['peer']}: {link['codec']}, "
                      f"{int(link['bytes_sent']) / 1e6:.1f} MB sent "
                      f"(ratio {link.get('compression_ratio', 1):.2f}), "
                      f"goodput {link.get('goodput_bps', 0) / 1e6:.1f} Mb/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
