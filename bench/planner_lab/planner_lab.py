#!/usr/bin/env python3
"""The network planner against join order on real processes: 6 workers in 3
emulated regions on loopback, every ordered pair of workers behind a
geotrain-linkem relay of its own (worker i reaches worker j only through
relay i->j, by --route), so links inside a region and between regions differ
the way the planner's matrix says: 5 ms one way and 400 Mb/s inside a region;
between regions 40 ms / 200 Mb/s (r0-r1), 60 ms / 150 Mb/s (r1-r2) and
100 ms / 100 Mb/s (r0-r2). Workers join round-robin over the regions (the
adversarial order: join order crosses between regions at every hop).

  bench/planner_lab/planner_lab.py [--steps=40] [--schedule=sync] [--slow_link]

Runs the same job twice in one sitting, --planner=join-order then
--planner=network, and prints per run the plan, the steady samples/s (the
first quarter of the steps skipped), and the planner's predicted time per
sample against the measured one. --slow_link: in the network run, the
plan's slowest link is slowed to a tenth of its rate after a third of the
steps (linkem's SIGHUP), and the events show what the coordinator did.
Logs stay in --workdir.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "deploy", "wan-lab"))
from wan_job import free_ports  # noqa: E402

REGION_OF = [0, 1, 2, 0, 1, 2]  # join order: round-robin over the regions
INTRA = (5.0, 400.0)  # one-way ms, Mb/s
INTER = {(0, 1): (40.0, 200.0), (1, 2): (60.0, 150.0), (0, 2): (100.0, 100.0)}


def shape(i, j):
    a, b = sorted((REGION_OF[i], REGION_OF[j]))
    return INTRA if a == b else INTER[(a, b)]


class Lab:
    def __init__(self, args, planner, workdir):
        self.args = args
        self.planner = planner
        self.dir = os.path.join(workdir, planner)
        os.makedirs(self.dir, exist_ok=True)
        self.bin = args.bin_dir
        self.processes = []
        n = len(REGION_OF)
        ports = free_ports(1 + n + n * (n - 1))
        self.coordinator_port = ports[0]
        self.worker_ports = ports[1:1 + n]
        relay_ports = iter(ports[1 + n:])
        self.relay_port = {(i, j): next(relay_ports) for i in range(n) for j in range(n) if i != j}
        self.settings = {}

    def spawn(self, name, argv):
        log = open(os.path.join(self.dir, name + ".log"), "w")
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.processes.append((name, p))
        return p

    def ctl(self, *args):
        out = subprocess.run([os.path.join(self.bin, "geotrain-ctl"), *args, "--insecure",
                              f"--coordinator=127.0.0.1:{self.coordinator_port}"],
                             capture_output=True, text=True, timeout=30)
        return out

    def status(self):
        out = self.ctl("status", "--json")
        return json.loads(out.stdout) if out.returncode == 0 else None

    def start(self):
        n = len(REGION_OF)
        self.spawn("coordinator", [
            os.path.join(self.bin, "geotrain-coordinator"), "--insecure",
            f"--listen=127.0.0.1:{self.coordinator_port}", f"--job={self.args.job}",
            f"--state_dir={os.path.join(self.dir, 'state')}", f"--planner={self.planner}",
            f"--min_workers={n}", f"--steps={self.args.steps}",
            f"--schedule={self.args.schedule}"])
        for (i, j), port in self.relay_port.items():
            delay, rate = shape(i, j)
            settings = os.path.join(self.dir, f"relay-{i}-{j}.settings")
            with open(settings, "w") as f:
                f.write(f"delay_ms={delay} rate_mbit={rate}\n")
            self.settings[(i, j)] = settings
            self.spawn(f"relay-{i}-{j}", [
                os.path.join(self.bin, "geotrain-linkem"), f"--listen=127.0.0.1:{port}",
                f"--target=127.0.0.1:{self.worker_ports[j]}", f"--delay_ms={delay}",
                f"--rate_mbit={rate}", f"--settings_file={settings}"])
        time.sleep(0.5)
        for i in range(n):
            routes = ",".join(f"127.0.0.1:{self.worker_ports[j]}=127.0.0.1:{self.relay_port[(i, j)]}"
                              for j in range(n) if j != i)
            self.spawn(f"w{i}", [
                os.path.join(self.bin, "geotrain-worker"), "--insecure",
                f"--coordinator=127.0.0.1:{self.coordinator_port}",
                f"--listen=127.0.0.1:{self.worker_ports[i]}", f"--name=r{REGION_OF[i]}-w{i}",
                "--threads=1", f"--route={routes}"])
            time.sleep(0.7)  # join in this order

    def reshape(self, i, j, factor):
        delay, rate = shape(i, j)
        for pair in ((i, j), (j, i)):
            with open(self.settings[pair], "w") as f:
                f.write(f"delay_ms={delay} rate_mbit={rate * factor}\n")
            name = f"relay-{pair[0]}-{pair[1]}"
            for proc_name, p in self.processes:
                if proc_name == name:
                    p.send_signal(signal.SIGHUP)

    def stop(self):
        for _, p in reversed(self.processes):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.time() + 10
        for _, p in self.processes:
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()

    def metrics(self):
        path = os.path.join(self.dir, "state", "metrics.jsonl")
        try:
            with open(path) as f:
                return [json.loads(l) for l in f if l.strip()]
        except FileNotFoundError:
            return []


def worker_index(name):
    return int(name.split("-w")[1])


def run(args, planner, workdir):
    lab = Lab(args, planner, workdir)
    lab.start()
    start = time.time()
    prediction = None
    plan = None
    slowed = False
    last_print = 0
    try:
        while time.time() - start < args.timeout:
            time.sleep(2)
            status = lab.status()
            if status is None:
                if lab.processes[0][1].poll() is not None:
                    break  # the coordinator exited: the job is done
                continue
            if status["state"] == "training" and status.get("prediction"):
                prediction = status["prediction"]
                stages = sorted((w for w in status["workers"] if w["stage"] >= 0),
                                key=lambda w: w["stage"])
                plan = [w["name"] for w in stages]
            step = status.get("step", 0)
            if time.time() - last_print > 10:
                print(f"  [{planner}] {time.time() - start:5.0f}s step {step}/{args.steps} "
                      f"{status.get('samples_per_s', 0):.1f} samples/s", flush=True)
                last_print = time.time()
            if args.slow_link and planner == "network" and not slowed and plan and \
                    step >= args.steps // 3 and len(plan) > 1:
                # The plan's slowest link (between regions, if it crosses).
                pairs = [(worker_index(x), worker_index(y)) for x, y in zip(plan, plan[1:])]
                a, b = min(pairs, key=lambda p: shape(*p)[1])
                plan_names = {worker_index(n): n for n in plan}
                lab.reshape(a, b, 0.1)
                slowed = True
                slowed_at = time.time()
                print(f"  [{planner}] step {step}: link {plan_names[a]} <-> {plan_names[b]} "
                      f"slowed from {shape(a, b)[1]:.0f} to {shape(a, b)[1] / 10:.0f} Mb/s",
                      flush=True)
            if status["state"] == "done":
                break
        events = []
        final = lab.status()
        stage_figures = []
        if final:
            events = [e for e in final.get("events", [])
                      if e["kind"] in ("planned", "replanned", "replan_considered")]
            for w in sorted((w for w in final["workers"] if w["stage"] >= 0),
                            key=lambda w: w["stage"]):
                links = w.get("links", [])
                compute = max([l.get("compute_s_per_microbatch", 0) for l in links] or [0])
                link_s = max([l.get("link_s_per_microbatch", 0) for l in links] or [0])
                stage_figures.append(f"stage {w['stage']} {w['name']}: measured compute "
                                     f"{1e3 * compute:.1f} ms, link {1e3 * link_s:.1f} ms per "
                                     f"microbatch, bubble {w.get('bubble_fraction', 0):.2f}")
        network = lab.ctl("network").stdout
        explain = lab.ctl("plan", "--explain").stdout
    finally:
        lab.stop()
    steps = [m for m in lab.metrics() if not m.get("eval")]
    result = {"planner": planner, "plan": plan, "prediction": prediction, "events": events,
              "network": network, "explain": explain, "stages": stage_figures}
    if len(steps) >= 8:
        first = steps[len(steps) // 4]
        last = steps[-1]
        result["samples_per_s"] = (last["samples"] - first["samples"]) / (last["time_s"] - first["time_s"])
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", default=os.path.join(ROOT, "deploy", "jobs", "gpt-tiny.textproto"))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--schedule", default="sync")
    parser.add_argument("--slow_link", action="store_true")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--bin_dir", default=os.path.join(ROOT, "build", "bin"))
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    workdir = args.workdir or tempfile.mkdtemp(prefix="geotrain-planner-lab-")
    print(f"planner lab: {len(REGION_OF)} workers, regions {REGION_OF} (join order), "
          f"{args.schedule}, {args.steps} steps of {os.path.basename(args.job)}; logs in {workdir}",
          flush=True)
    results = [run(args, planner, workdir) for planner in ("join-order", "network")]
    print()
    print(f"{'planner':<11} {'samples/s':>10} {'predicted ms/sample':>20} {'measured':>9} "
          f"{'error':>7}  plan")
    for r in results:
        measured = r.get("samples_per_s")
        predicted = r["prediction"]["time_per_sample_s"] if r["prediction"] else None
        error = (predicted * measured - 1) if measured and predicted else None
        print(f"{r['planner']:<11} {measured or 0:>10.1f} "
              f"{(predicted or 0) * 1e3:>20.3f} {(1e3 / measured) if measured else 0:>9.3f} "
              f"{(error or 0):>+7.0%}  {' -> '.join(r['plan'] or [])}")
    join, network = results
    if join.get("samples_per_s") and network.get("samples_per_s"):
        print(f"\nnetwork / join-order samples/s: {network['samples_per_s'] / join['samples_per_s']:.2f}x")
    for r in results:
        print(f"\n{r['planner']}: " + "\n  ".join([""] + r["stages"]))
        print(r["explain"])
    print("\nthe network run's plan:\n" + network["explain"])
    print("its link matrix:\n" + network["network"])
    for e in network["events"]:
        print(f"  {e['time_s']:7.1f}s {e['kind']}: {e['detail']}")


if __name__ == "__main__":
    main()
