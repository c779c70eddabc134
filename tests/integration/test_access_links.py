"""The network planner on the links people have: every worker's host behind
a port of its own, shaped with tbf both ways (a home connection, a VM's
NIC), in a lab of network namespaces (deploy/net-lab). A middle worker's one
port carries both of its links. The demo job, shortened, async-stash with
codecs up to int8 allowed, 3 workers; the same job twice in one run, with
--planner=join-order and --planner=network.

- Each worker measures its port with its peers at once (AccessProbeTask):
  `geotrain-ctl network` shows it, near the tbf rate.
- The network plan's explanation says where two links share a port, and its
  predicted samples/s is within 25% of what it measured.
- It trains faster than the join-order plan, measured in the same run.

Needs root for the lab (CI runs as root); without it the test skips and says
why.
"""
import json
import os
import re
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "deploy", "net-lab"))
from cluster import binary, job_path, wait_for  # noqa: E402
from test_netlab import LabCluster, by_name, lab_run  # noqa: E402
import netlab  # noqa: E402

RATE_MBIT = 20
STEPS = 150
CODEC_FLAGS = ["--schedule=async-stash", "--activation_codec=int8", "--gradient_codec=int8"]


def access_job(directory):
    """The demo job (model, data, optimizer), shorter and without evaluation
    in the measured stretch."""
    with open(job_path("gpt-tiny.textproto")) as f:
        text = f.read()
    text = text.replace("steps: 300", f"steps: {STEPS}").replace("eval_every: 50", "eval_every: 0")
    path = os.path.join(directory, "gpt-access.textproto")
    with open(path, "w") as f:
        f.write(text)
    return path


class PlannerLabCluster(LabCluster):
    """A LabCluster whose coordinator runs with the given planner flags."""

    def __init__(self, lab, job, directory, flags):
        super().__init__(lab, job, directory)
        self.flags = flags

    def start_coordinator(self):
        state = os.path.join(self.dir, "state")
        self.start("coordinator", "coord", [
            binary("geotrain-coordinator"), f"--listen={self.coordinator_address}",
            f"--tls_san={self.lab.address('coord')}", f"--job={self.job}", f"--state_dir={state}",
            *self.flags])
        self.admin = os.path.join(state, "tls", "admin.credential")
        wait_for(lambda: os.path.exists(self.admin) and self.ctl("status").returncode == 0, 30,
                 "the coordinator in the lab")


def steady_rate(metrics, since_s):
    """Samples per second over the steps logged after `since_s` of training
    (the last plan's), skipping its first fifth (links opening, windows
    filling)."""
    steps = [m for m in metrics if not m.get("eval") and m["time_s"] >= since_s]
    if len(steps) < 10:
        return None
    first = steps[len(steps) // 5]
    last = steps[-1]
    return (last["samples"] - first["samples"]) / (last["time_s"] - first["time_s"])


class AccessLinkTest(unittest.TestCase):
    def run_planner(self, directory, name, planner):
        """One run of the job with `planner` in a fresh lab; returns what it
        measured and predicted."""
        job = access_job(directory)
        workdir = os.path.join(directory, name)
        os.makedirs(workdir)
        hosts = [{"name": "coord"}] + [{"name": f"w{i}", "rate": f"{RATE_MBIT}mbit"}
                                       for i in range(3)]
        lab = netlab.Lab(f"ac{os.getpid() % 1000}{name[0]}", {"hosts": hosts})
        lab.up()
        cluster = PlannerLabCluster(lab, job, workdir, [f"--planner={planner}", *CODEC_FLAGS])
        result = {}
        with lab_run(self, lab, cluster):
            cluster.start_coordinator()
            for i in range(3):
                worker = f"w{i}"
                cluster.start_worker(worker, worker, f"{lab.address(worker)}:7001")
                wait_for(lambda: worker in by_name(cluster.status()), 90, f"{worker} to join")
            last_status = {}
            training = {}  # the last status seen while training (standbys leave at the end)

            def done():
                last_status.update(cluster.status())
                if last_status["state"] == "training":
                    training.update(last_status)
                    if planner == "network" and "network" not in result:
                        result["network"] = cluster.ctl("network").stdout
                return last_status["state"] == "done"

            wait_for(done, 600, f"the {planner} run to finish", interval=2)
            result["prediction"] = last_status.get("prediction", {})
            result["explain"] = cluster.ctl("plan", "--explain").stdout
            result["workers"] = by_name(training)
            events = last_status.get("events", [])
            result["events"] = [f"{e['kind']}: {e.get('detail', '')}" for e in events
                                if e["kind"] in ("planned", "replanned")]
            # The last plan's start in training seconds (the metrics' clock
            # starts at the first plan; the events' at the coordinator's).
            plans = [e for e in events if e["kind"] in ("planned", "replanned")]
            plan_started = plans[-1]["time_s"] - plans[0]["time_s"] if plans else 0.0
            result["samples_per_s"] = steady_rate(cluster.metrics(), plan_started)
        return result

    def test_the_network_planner_counts_a_shared_port(self):
        why = netlab.lab_unavailable()
        if why:
            self.skipTest(f"no network lab here: {why}")
        directory = tempfile.mkdtemp(prefix="geotrain-access-")
        join = self.run_planner(directory, "join", "join-order")
        network = self.run_planner(directory, "network", "network")
        for name, r in (("join-order", join), ("network", network)):
            print(f"==== {name}: {r['samples_per_s']} samples/s measured, prediction "
                  f"{json.dumps(r['prediction'])}")
            print("\n".join(r["events"]))
        print(network.get("network", "(no status while training)"))
        print(network["explain"])

        # Every worker's port measured, near the tbf rate.
        for worker in ("w0", "w1", "w2"):
            w = network["workers"][worker]
            for direction in ("uplink_bps", "downlink_bps"):
                self.assertGreater(w.get(direction, 0), 0.6 * RATE_MBIT * 1e6, (worker, w))
                self.assertLess(w.get(direction, 0), 1.5 * RATE_MBIT * 1e6, (worker, w))
        self.assertIn("ACCESS LINK", network.get("network", ""))

        measured = network["samples_per_s"]
        self.assertIsNotNone(measured, "the network run logged too few steps")
        prediction = network["prediction"]
        self.assertEqual(prediction.get("planner"), "network")
        predicted = 1.0 / prediction["time_per_sample_s"]
        print(f"network plan: predicted {predicted:.1f} samples/s, measured {measured:.1f} "
              f"({measured / predicted:.2f}x); join order measured {join['samples_per_s']:.1f}")
        self.assertLess(abs(measured - predicted), 0.25 * predicted,
                        f"predicted {predicted:.1f}, measured {measured:.1f} samples/s\n"
                        f"{network['explain']}")
        self.assertGreater(measured, join["samples_per_s"],
                           f"network {measured:.1f} vs join order {join['samples_per_s']:.1f}")


if __name__ == "__main__":
    unittest.main()
