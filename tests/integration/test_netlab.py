"""Real hosts: the coordinator, workers and relays each in a network
namespace of their own (deploy/net-lab), two workers behind two different
NAT routers, TLS everywhere, the README's multi-machine steps as written.

- The demo job trains across the lab as far as it does on loopback (the
  loss drop within 10%).
- The public stage-0 worker cannot dial the NATed stage 1, so stage 1 dials
  it; stages 1 and 2 are both behind NAT, so their link goes through a
  relay; status says so.
- Killing that relay is survived: the pair is re-linked through the other.
- Afterwards none of the lab's namespaces is left.
- Two pipelines on four hosts, three behind NAT: a stage's replicas that
  cannot reach each other meet for the outer sync through the relay, and
  every stage's replicas end on the same weights.
- On loopback: a worker started with a wrong --advertise is told why in one
  line at join and status says it is not reachable.

Needs root for the lab (CI runs as root); without it those tests skip and
say why.
"""
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "deploy", "net-lab"))
from cluster import Cluster, Process, binary, job_path, wait_for, free_port  # noqa: E402
import netlab  # noqa: E402

STEPS = 40
COORD_PORT = 7070


def lab_job(directory):
    """The demo job, shortened: same model, data, optimizer and schedule."""
    with open(job_path("gpt-tiny.textproto")) as f:
        text = f.read()
    text = text.replace("steps: 300", f"steps: {STEPS}").replace("eval_every: 50", "eval_every: 20")
    path = os.path.join(directory, "gpt-lab.textproto")
    with open(path, "w") as f:
        f.write(text)
    return path


def loss_drop(metrics):
    steps = [m for m in metrics if not m.get("eval")]
    first = steps[0]["loss"]
    last = sum(m["loss"] for m in steps[-5:]) / 5
    return first, last, first - last


# These tests check who dials whom (or which relay joins them) between the
# neighbours of a known plan: the workers in join order.
JOIN_ORDER = ["--planner=join-order"]


class LabCluster:
    """A coordinator, workers and relays on the hosts of a Lab."""

    def __init__(self, lab, job, directory, flags=()):
        self.lab = lab
        self.job = job
        self.dir = directory
        self.flags = list(flags)
        self.processes = {}
        self.coordinator_host = "coord"
        self.coordinator_address = f"{lab.address('coord')}:{COORD_PORT}"

    def start(self, name, host, args):
        process = Process(self.lab.prefix(host) + args, os.path.join(self.dir, f"{name}.log"))
        self.processes[name] = process
        return process

    def start_coordinator(self):
        state = os.path.join(self.dir, "state")
        self.start("coordinator", "coord", [
            binary("geotrain-coordinator"), f"--listen={self.coordinator_address}",
            f"--tls_san={self.lab.address('coord')}", f"--job={self.job}", f"--state_dir={state}",
            *self.flags])
        self.admin = os.path.join(state, "tls", "admin.credential")
        wait_for(lambda: os.path.exists(self.admin) and self.ctl("status").returncode == 0, 30,
                 "the coordinator in the lab")

    def ctl(self, *args):
        return self.lab.run("coord", [binary("geotrain-ctl"), *args,
                                      f"--coordinator={self.coordinator_address}",
                                      f"--admin_credential={self.admin}", "--timeout_ms=3000"],
                            capture_output=True, text=True, timeout=30)

    def token(self, name, role="worker"):
        out = self.ctl("token", "create", f"--name={name}", "--uses=1", f"--role={role}")
        if out.returncode != 0:
            raise RuntimeError(out.stderr)
        return out.stdout.strip()

    def start_worker(self, name, host, advertise):
        return self.start(name, host, [
            binary("geotrain-worker"), f"--coordinator={self.coordinator_address}",
            "--listen=0.0.0.0:7001", f"--advertise={advertise}", "--device=cpu", "--threads=1",
            f"--name={name}", f"--token={self.token(name)}",
            f"--state_dir={os.path.join(self.dir, name + '-state')}"])

    def start_relay(self, name, host):
        address = f"{self.lab.address(host)}:7400"
        return self.start(name, host, [
            binary("geotrain-relay"), f"--coordinator={self.coordinator_address}",
            f"--listen={address}", f"--advertise={address}", f"--name={name}",
            f"--token={self.token(name, role='relay')}"])

    def status(self):
        out = self.ctl("status", "--json")
        if out.returncode != 0:
            raise RuntimeError(out.stderr)
        return json.loads(out.stdout)

    def metrics(self):
        path = os.path.join(self.dir, "state", "metrics.jsonl")
        if not os.path.exists(path):
            return []
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]

    def dump_logs(self):
        return "\n".join(f"==== {name}\n{p.log()[-3500:]}" for name, p in self.processes.items())

    def close(self):
        for p in self.processes.values():
            p.stop(grace=3)


@contextlib.contextmanager
def lab_run(test, lab, cluster):
    """A test's processes in `lab`: every log printed if it fails; the
    processes and the lab gone after, and no namespace left behind."""
    try:
        yield cluster
    except Exception:
        print(cluster.dump_logs())
        raise
    finally:
        cluster.close()
        lab.down()
    test.assertEqual(lab.namespaces(), [], "the lab left namespaces behind")


def by_name(status):
    return {w["name"]: w for w in status.get("workers", [])}


class NetLabTest(unittest.TestCase):
    def test_nat_relay_and_dial_direction(self):
        why = netlab.lab_unavailable()
        if why:
            self.skipTest(f"no network lab here: {why}")
        directory = tempfile.mkdtemp(prefix="geotrain-lab-")
        job = lab_job(directory)

        # The reference: the same job on loopback (TLS too).
        os.makedirs(os.path.join(directory, "loopback"))
        with Cluster(job, JOIN_ORDER, secure=True,
                     workdir=os.path.join(directory, "loopback")) as c:
            c.start_coordinator()
            for i in range(3):
                token = c.create_token(f"--name=w{i}")
                c.start_worker(f"w{i}", extra=[f"--token={token}"])
                wait_for(lambda: len(c.status().get("workers", [])) > i, 60, f"w{i} to join")
            try:
                c.wait_done(timeout=300)
            except Exception:
                print(c.dump_logs())
                raise
            reference = loss_drop(c.metrics())
        print(f"loopback: loss {reference[0]:.4f} -> {reference[1]:.4f} (drop {reference[2]:.4f})")

        lab = netlab.Lab(f"it{os.getpid() % 10000}", {"hosts": [
            {"name": "coord"}, {"name": "w0"}, {"name": "relay1"}, {"name": "relay2"},
            {"name": "w1", "nat": "home1"}, {"name": "w2", "nat": "home2"}]})
        namespaces_before = set(lab.namespaces())
        self.assertEqual(namespaces_before, set())
        lab.up()
        cluster = LabCluster(lab, job, directory, JOIN_ORDER)
        with lab_run(self, lab, cluster):
            cluster.start_coordinator()
            relays = {name: cluster.start_relay(name, name) for name in ("relay1", "relay2")}
            wait_for(lambda: sum(w["role"] == "relay" for w in cluster.status()["workers"]) == 2,
                     60, "both relays to join")
            # Join order decides stage order: w0 (public), then w1 and w2
            # behind their routers, each advertising its home address, as a
            # volunteer who has not set up a port forward would.
            for name in ("w0", "w1", "w2"):
                cluster.start_worker(name, name, f"{lab.address(name)}:7001")
                wait_for(lambda: name in by_name(cluster.status()), 90, f"{name} to join")

            status = wait_for(lambda: (lambda s: s if s["state"] == "training" and s.get("links")
                                       else None)(cluster.status()), 120, "a plan with links")
            workers = by_name(status)
            self.assertTrue(workers["w0"]["reachable"], workers["w0"])
            for name in ("w1", "w2"):
                self.assertFalse(workers[name]["reachable"], workers[name])
                self.assertIn("--advertise", workers[name]["reachability"])
            for name in ("relay1", "relay2"):
                self.assertEqual(workers[name]["role"], "relay")
                self.assertTrue(workers[name]["reachable"], workers[name])
            links = {(l["upstream_worker"], l["downstream_worker"]): l for l in status["links"]}
            ids = {n: w["id"] for n, w in workers.items()}
            first = links[(ids["w0"], ids["w1"])]
            second = links[(ids["w1"], ids["w2"])]
            self.assertEqual(first["dialer"], "downstream", first)
            self.assertEqual(second["dialer"], "relay", second)
            used = next(n for n in relays if ids[n] == second["relay_worker"])
            spare = next(n for n in relays if n != used)
            table = cluster.ctl("status").stdout
            print(table)
            self.assertIn("downstream", table)
            self.assertIn(f"relay {second['relay_worker']} at", table)
            # The one-line explanation a NATed worker gets at join.
            warning = [line for line in cluster.processes["w1"].log().splitlines()
                       if "not reachable at" in line]
            self.assertTrue(warning, cluster.processes["w1"].log()[-2000:])
            self.assertIn("--advertise=HOST:PORT", warning[0])

            # Training goes through the relay; then the relay dies.
            wait_for(lambda: cluster.status()["step"] >= 12, 240, "step 12 across the lab",
                     interval=0.5)
            epoch = cluster.status()["epoch"]
            relays[used].popen.send_signal(signal.SIGKILL)
            print(f"killed {used} at step {cluster.status()['step']}")

            def relinked():
                s = cluster.status()
                for l in s.get("links", []):
                    if l["dialer"] == "relay" and s["epoch"] > epoch:
                        return l["relay_worker"] == ids[spare] and s
                return None

            wait_for(relinked, 120, f"the relayed link to move to {spare}", interval=0.5)
            wait_for(lambda: cluster.status()["state"] == "done", 400, "the job to finish",
                     interval=1)
            lab_drop = loss_drop(cluster.metrics())
            print(f"lab: loss {lab_drop[0]:.4f} -> {lab_drop[1]:.4f} (drop {lab_drop[2]:.4f})")
            self.assertLess(abs(lab_drop[2] - reference[2]), 0.10 * reference[2],
                            f"loss drop in the lab {lab_drop[2]:.4f} vs loopback {reference[2]:.4f}")
            events = [e["kind"] for e in cluster.status()["events"]]
            self.assertIn("replanned", events)


PIPELINES_JOB = """
name: "pipelines-lab"
mlp { hidden: 64 hidden: 64 }
fashion_mnist { }
optimizer { kind: KIND_ADAMW lr: 0.002 }
schedule: SCHEDULE_ASYNC_STASH
steps: 24
microbatches: 4
microbatch_size: 16
seed: 7
min_workers: 4
max_stages: 2
eval_every: 0
eval_batches: 2
outer { inner_steps: 4 codec: CODEC_INT8 streaming: true }
"""


class NatPipelinesTest(unittest.TestCase):
    def test_replicas_behind_nat_sync_through_a_relay(self):
        """Two pipelines of two stages on four hosts, three of them behind
        NAT routers of their own: each stage's replicas meet for the outer
        sync through the relay when neither can be reached, and every
        stage's replicas end on the same weights."""
        why = netlab.lab_unavailable()
        if why:
            self.skipTest(f"no network lab here: {why}")
        directory = tempfile.mkdtemp(prefix="geotrain-lab-")
        job = os.path.join(directory, "pipelines.textproto")
        with open(job, "w") as f:
            f.write(PIPELINES_JOB)
        hosts = ["n1", "pub", "n2", "n3"]
        lab = netlab.Lab(f"ip{os.getpid() % 10000}", {"hosts": [
            {"name": "coord"}, {"name": "relay1"}, {"name": "pub"},
            {"name": "n1", "nat": "home1"}, {"name": "n2", "nat": "home2"},
            {"name": "n3", "nat": "home3"}]})
        lab.up()
        cluster = LabCluster(lab, job, directory, JOIN_ORDER)
        with lab_run(self, lab, cluster):
            cluster.start_coordinator()
            cluster.start_relay("relay1", "relay1")
            wait_for(lambda: any(w["role"] == "relay" for w in cluster.status()["workers"]),
                     60, "the relay to join")
            for name in hosts:
                cluster.start_worker(name, name, f"{lab.address(name)}:7001")
                wait_for(lambda: name in by_name(cluster.status()), 90, f"{name} to join")
            status = wait_for(lambda: (lambda s: s if s["state"] == "training" and s.get("links")
                                       else None)(cluster.status()), 120, "a plan with links")
            self.assertEqual(int(status.get("pipelines", 1)), 2, status)
            workers = {w["id"]: w for w in status["workers"]}
            outer = [l for l in status["links"]
                     if workers[l["upstream_worker"]]["stage"]
                     == workers[l["downstream_worker"]]["stage"]]
            print(cluster.ctl("status").stdout)
            # One outer link per stage; the four hosts pair up, and only one
            # is public, so at least one pair meets at the relay.
            self.assertEqual(len(outer), 2, status["links"])
            self.assertIn("relay", [l["dialer"] for l in outer], outer)
            wait_for(lambda: cluster.status()["state"] == "done", 400, "the job to finish",
                     interval=1)
            final = re.compile(r"outer sync of stage (\d+): (\d+) rounds applied; final weights "
                               r"sha256 ([0-9a-f]{64})")
            by_stage = {}
            for name in hosts:
                found = final.findall(cluster.processes[name].log())
                self.assertTrue(found, cluster.processes[name].log()[-2000:])
                stage, rounds, digest = found[-1]
                by_stage.setdefault(int(stage), []).append((int(rounds), digest))
            print(f"final digests by stage: {by_stage}")
            for stage, replicas in by_stage.items():
                self.assertEqual(len(replicas), 2, by_stage)
                self.assertEqual(len({d for _, d in replicas}), 1, by_stage)
                self.assertTrue(all(r == 6 for r, _ in replicas), by_stage)
            first, last, drop = loss_drop(cluster.metrics())
            print(f"lab pipelines: loss {first:.4f} -> {last:.4f}")
            self.assertGreater(drop, 0.3)


class WrongAdvertiseTest(unittest.TestCase):
    def test_wrong_advertise_is_explained_at_join(self):
        with Cluster(job_path("gpt-tiny.textproto"), secure=True) as c:
            c.start_coordinator()
            token = c.create_token("--name=lost")
            closed = free_port()  # nothing listens there
            worker = c.start_worker("lost", extra=[f"--token={token}",
                                                   f"--advertise=127.0.0.1:{closed}"])
            wait_for(lambda: "not reachable at" in worker.log(), 60, "the join's explanation")
            lines = [l for l in worker.log().splitlines() if "not reachable at" in l]
            self.assertEqual(len(lines), 1, lines)
            self.assertIn(f"127.0.0.1:{closed}", lines[0])
            self.assertIn("--advertise=HOST:PORT", lines[0])
            self.assertIn(f"forward TCP port {closed}", lines[0])
            status = c.status()
            lost = by_name(status)["lost"]
            self.assertFalse(lost["reachable"], lost)
            self.assertIn("could not dial", lost["reachability"])
            table = c.ctl("status").stdout
            self.assertIn("not reachable:", table)


if __name__ == "__main__":
    unittest.main()
