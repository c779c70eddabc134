"""Real coordinator and worker processes training over gRPC on loopback."""
import json
import os
import subprocess
import unittest

from cluster import Cluster, binary, job_path, wait_for


class PipelineTest(unittest.TestCase):
    def test_three_workers_train_and_report_status(self):
        # Join order: every worker holds a stage (the network planner may
        # leave one as a standby), whose status this test reads.
        with Cluster(job_path("gpt-tiny.textproto"),
                     ["--steps=15", "--min_workers=3", "--planner=join-order"]) as c:
            c.start_coordinator()
            waiting = c.status()
            self.assertEqual(waiting["state"], "waiting")
            # w0 and w1 take a fair share of the host's CPUs; w2 has its
            # OpenBLAS core set by the user, which the worker must keep.
            c.start_worker("w0", ["--threads=0"])
            c.start_worker("w1", ["--threads=0"])
            c.start_worker("w2", env={"OPENBLAS_CORETYPE": "Prescott"})
            try:
                c.wait_done(timeout=180)
            except Exception:
                print(c.dump_logs())
                raise
            status = c.status()
            self.assertEqual(status["state"], "done")
            self.assertEqual(status["step"], 15)
            self.assertEqual(sorted(w["name"] for w in status["workers"]), ["w0", "w1", "w2"])
            self.assertEqual(sorted(w["stage"] for w in status["workers"]), [0, 1, 2])
            for w in status["workers"]:
                self.assertEqual(w["state"], "WORKER_STATE_DONE")
                self.assertEqual(w["device"], "cpu")
                self.assertGreater(w["gflops"], 0)
                self.assertLess(w["layer_begin"], w["layer_end"])
                self.assertTrue(w["blas"], w)
                self.assertGreaterEqual(w["threads"], 1)
            by_name = {w["name"]: w for w in status["workers"]}
            cpus = len(os.sched_getaffinity(0))
            for name in ("w0", "w1"):
                reason = by_name[name]["threads_reason"]
                # Other suites' workers may share the host: read the count.
                self.assertRegex(reason, r"^fair share: \d+ CPUs? / \d+ workers on this host$")
                workers = int(reason.split("/ ")[1].split()[0])
                self.assertGreaterEqual(workers, 3, reason)
                self.assertEqual(by_name[name]["threads"], max(1, cpus // workers), reason)
            self.assertEqual(by_name["w2"]["threads"], 1)
            self.assertEqual(by_name["w2"]["threads_reason"], "--threads")
            if "OpenBLAS" in by_name["w2"]["blas"]:
                self.assertTrue(by_name["w2"]["blas"].endswith("core Prescott"), by_name["w2"])
                self.assertNotIn("OPENBLAS_CORETYPE", by_name["w2"].get("environment", ""))
            if "OMP_WAIT_POLICY" not in os.environ:
                for w in status["workers"]:
                    self.assertIn("OMP_WAIT_POLICY=PASSIVE set by geotrain", w["environment"])
            # Stages cover the model's 6 layers contiguously.
            ranges = sorted((w["layer_begin"], w["layer_end"]) for w in status["workers"])
            self.assertEqual(ranges[0][0], 0)
            self.assertEqual(ranges[-1][1], 6)
            for a, b in zip(ranges, ranges[1:]):
                self.assertEqual(a[1], b[0])
            kinds = [e["kind"] for e in status["events"]]
            for kind in ("joined", "planned", "job_done"):
                self.assertIn(kind, kinds)

            steps = c.steps()
            self.assertEqual([m["step"] for m in steps], list(range(1, 16)))
            for m in steps:
                for key in ("loss", "samples", "time_s"):
                    self.assertIn(key, m)
            self.assertEqual(steps[-1]["samples"], 15 * 4 * 16)
            self.assertLess(steps[-1]["loss"], steps[0]["loss"])
            evals = c.evals()
            self.assertEqual(len(evals), 1)
            self.assertEqual(evals[0]["step"], 15)
            self.assertGreater(evals[0]["val_loss"], 0)

            table = c.ctl("status")
            self.assertEqual(table.returncode, 0, table.stderr)
            for text in ("gpt-tiny", "STAGE", "GFLOP/s", "w0", "done", "BLAS", "THREADS",
                         "fair share"):
                self.assertIn(text, table.stdout)
            # A summary first; pages and filters on request.
            self.assertIn("members 3: 3 done", table.stdout)
            self.assertIn("stages 0 [0,", table.stdout)
            page = c.ctl("status", "--page_size=1")
            self.assertEqual(page.returncode, 0, page.stderr)
            self.assertIn("showing 1 of the 3 matching members; next page: --page_token=1",
                          page.stdout)
            last = c.ctl("status", "--stage=2", "--json")
            self.assertEqual(last.returncode, 0, last.stderr)
            shown = json.loads(last.stdout)
            self.assertEqual([w["stage"] for w in shown["workers"]], [2])
            self.assertEqual(shown["workers_total"], 3)
            bad = c.ctl("status", "--page_token=nonsense")
            self.assertNotEqual(bad.returncode, 0)
            self.assertIn("page_token", bad.stderr)
            for w in c.workers:
                w.popen.wait(timeout=30)
                self.assertEqual(w.popen.returncode, 0, w.log()[-2000:])
            self.assertTrue(os.path.exists(os.path.join(c.dir, "state", "plan.textproto")))

    def test_sync_pipeline_matches_single_process(self):
        """The sync schedule over 3 workers gives the same per-step losses as 1."""
        losses = {}
        for workers in (1, 3):
            with Cluster(job_path("gpt-tiny.textproto"),
                         ["--steps=12", f"--min_workers={workers}", "--seed=5"]) as c:
                c.train(workers, timeout=180)
                self.assertEqual(len(c.status()["workers"]), workers)
                losses[workers] = [m["loss"] for m in c.steps()]
        self.assertEqual(len(losses[1]), 12)
        self.assertEqual(len(losses[3]), 12)
        for step, (one, three) in enumerate(zip(losses[1], losses[3]), start=1):
            self.assertLessEqual(abs(one - three) / abs(one), 1e-4,
                                 f"step {step}: 1 worker {one}, 3 workers {three}")
        print("per-step losses, 1 worker vs 3 workers:")
        for step, (one, three) in enumerate(zip(losses[1], losses[3]), start=1):
            print(f"  step {step:2d}: {one:.7f} {three:.7f}")

    def test_async_schedule_reports_stage_figures(self):
        # Join order: both workers hold a stage. The network planner may run
        # this small MLP on one worker and keep the other as a spare (a fresh
        # run under load did), and a spare reports no schedule.
        with Cluster(job_path("fmnist-mlp.textproto"),
                     ["--steps=3000", "--schedule=async-stash", "--planner=join-order"]) as c:
            c.start_coordinator()
            for i in range(2):
                c.start_worker(f"w{i}")
            # Figures while training, from the heartbeats.
            def busy():
                s = c.status()
                # Heartbeats come every second: wait for ones sent mid-run.
                fresh = all(int(w["microbatches"]) > 0 and w["microbatches_per_s"] > 0
                            for w in s["workers"] if w["stage"] >= 0)
                return s if s["step"] >= 200 and s["state"] == "training" and fresh else None
            try:
                status = wait_for(busy, 120, "training to be under way")
            except Exception:
                print(c.dump_logs())
                raise
            for w in status["workers"]:
                for key in ("weight_versions", "staleness_max", "bubble_fraction",
                            "microbatches_per_s", "weight_bytes", "staleness_mean"):
                    self.assertIn(key, w)
                self.assertEqual(w["schedule"], "async-stash")
                self.assertGreaterEqual(w["weight_versions"], 1)
                self.assertLessEqual(w["max_weight_versions"], 2, "W = 2 stages")
                self.assertGreater(int(w["weight_bytes"]), 0)
                self.assertGreaterEqual(w["bubble_fraction"], 0)
                self.assertLessEqual(w["bubble_fraction"], 1)
                self.assertGreater(w["microbatches_per_s"], 0)
            stage0 = next(w for w in status["workers"] if w["stage"] == 0)
            last = next(w for w in status["workers"] if w["stage"] == 1)
            self.assertEqual(int(stage0["staleness_max"]), 1, "one update between F and B")
            self.assertEqual(int(last["staleness_max"]), 0, "the last stage runs F and B at once")
            table = c.ctl("status")
            for text in ("SCHEDULE", "STALE_MAX", "BUBBLE", "async-stash"):
                self.assertIn(text, table.stdout)
            c.wait_done(timeout=120)
            for w in c.status()["workers"]:
                self.assertEqual(w["weight_versions"], 1, "stashed versions freed at the end")

    def test_standby_worker_is_reported(self):
        with Cluster(job_path("fmnist-mlp.textproto"),
                     ["--steps=100000", "--min_workers=2"]) as c:
            c.start_coordinator()
            for i in range(2):
                c.start_worker(f"w{i}")
            wait_for(lambda: c.status()["state"] == "training", 60, "a plan")
            spare = c.start_worker("spare")

            def spare_status():
                for w in c.status()["workers"]:
                    if w["name"] == "spare":
                        return w
                return None

            joined = wait_for(spare_status, 60, "the spare to join")
            self.assertEqual(joined["state"], "WORKER_STATE_STANDBY")
            self.assertEqual(joined["stage"], -1)
            self.assertEqual(c.status()["state"], "training")
            wait_for(lambda: "standby" in spare.log(), 30, "the spare to log standby")
            # A standby stopped by SIGTERM leaves cleanly; training goes on.
            spare.stop()
            self.assertEqual(spare.popen.returncode, 0, spare.log()[-2000:])
            self.assertEqual(spare_status()["state"], "WORKER_STATE_LEFT")
            self.assertEqual(c.status()["state"], "training")

    def test_network_planner_measures_and_explains(self):
        with Cluster(job_path("gpt-tiny.textproto"),
                     ["--steps=100000", "--planner=network"]) as c:
            c.start_coordinator()
            for i in range(3):
                c.start_worker(f"w{i}")
            wait_for(lambda: c.status()["state"] == "training", 60, "a plan")

            # Every worker measures its two peers (RTT and rate, Stage.Measure).
            def measured():
                links = [l for l in c.status().get("network", [])
                         if "probe" in l["source"] and l["rtt_s"] > 0]
                return links if len(links) >= 6 else None

            links = wait_for(measured, 60, "the link matrix to fill")
            for link in links:
                self.assertLess(link["rtt_s"], 0.5, link)  # loopback
                self.assertGreater(link["rate_bps"], 1e6, link)
            table = c.ctl("network")
            self.assertEqual(table.returncode, 0, table.stderr)
            print(table.stdout)
            # The pairs, then (after a blank line) each worker's port.
            pairs, _, ports = table.stdout.partition("\n\n")
            rows = [l for l in pairs.splitlines()[1:] if l.split() and "probe" in l.split()[-1]]
            self.assertGreaterEqual(len(rows), 6)
            # Each port measured with both peers at once before the first plan.
            self.assertIn("ACCESS LINK", ports)
            self.assertEqual(len([l for l in ports.splitlines()[1:] if l.strip()]), 3, ports)
            for w in c.status()["workers"]:
                self.assertGreater(w.get("uplink_bps", 0), 1e6, w["name"])
                self.assertGreater(w.get("downlink_bps", 0), 1e6, w["name"])
            out = c.ctl("plan", "--explain")
            status = c.status()
        self.assertEqual(out.returncode, 0, out.stderr)
        print(out.stdout)
        prediction = status["prediction"]
        self.assertEqual(prediction["planner"], "network")
        self.assertTrue(prediction["exact"])  # 3 workers: an exhaustive search
        self.assertGreater(prediction["time_per_sample_s"], 0)
        self.assertGreaterEqual(prediction["in_flight"], 1)
        stages = [w for w in status["workers"] if w["stage"] >= 0]
        lines = out.stdout.splitlines()
        self.assertIn("predicted", lines[0])
        self.assertIn("bound:", lines[0])
        # One line per stage with its compute, each followed by why.
        stage_lines = [l for l in lines if l.strip().startswith("stage ")]
        self.assertEqual(len(stage_lines), len(stages))
        self.assertEqual(len([l for l in lines if "why:" in l]), len(stages))
        for line in stage_lines:
            self.assertIn("compute", line)


if __name__ == "__main__":
    unittest.main(verbosity=2)
