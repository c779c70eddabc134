"""Failures, stragglers and churn on real processes: standbys take over
lost stages, stages restore from checkpoints, a coordinator restarts on its
state directory, and a SIGTERM'd worker hands its stage over.

The job is a small GPT (5 layers over 3 stages, sync schedule) with a
checkpoint every 5 steps and the default 5 s lease.
"""
import os
import random
import signal
import statistics
import tempfile
import threading
import time
import unittest

import sys

from cluster import BIN_DIR, SOURCE_DIR, Cluster, wait_for

sys.path.insert(0, os.path.join(SOURCE_DIR, "deploy", "wan-lab"))
import wan_job  # noqa: E402

JOB = """
name: "ft-gpt"
gpt { context: 32 d_model: 64 heads: 4 blocks: 3 mlp_ratio: 4 }
text { paths: "/usr/share/games/fortunes" validation_fraction: 0.05 }
optimizer { kind: KIND_ADAMW lr: 0.002 weight_decay: 0.01 }
schedule: SCHEDULE_SYNC
steps: %(steps)d
microbatches: 4
microbatch_size: 16
seed: 3
min_workers: 3
max_stages: 3
eval_every: 0
eval_batches: 2
checkpoint_every: 5
"""


def write_job(directory, steps):
    path = os.path.join(directory, "job.textproto")
    with open(path, "w") as f:
        f.write(JOB % {"steps": steps})
    return path


def loss_margin(steps):
    """Mean loss of the first 5 steps minus that of the last 10."""
    losses = [m["loss"] for m in steps]
    return statistics.mean(losses[:5]) - statistics.mean(losses[-10:])


class FaultCluster(Cluster):
    """A Cluster that starts its workers under fresh names."""

    def __init__(self, steps, coordinator_flags=()):
        super().__init__(None, coordinator_flags)
        self.job = write_job(self.dir, steps)
        self.names = 0
        self.by_name = {}
        self.killed = set()

    def start(self, workers, until_step):
        """A coordinator and `workers` workers, trained up to `until_step`."""
        self.start_coordinator()
        for _ in range(workers):
            self.add_worker()
        self.wait_step(until_step, 120)
        return self

    def __exit__(self, kind, value, traceback):
        if kind is not None:  # a failing test shows what every process said
            print(self.dump_logs())
        return super().__exit__(kind, value, traceback)

    def kill(self, name):
        self.by_name[name].popen.kill()
        self.killed.add(name)

    def wait_done(self, timeout):
        """Waits for the job to finish; a worker this test did not kill
        exiting non-zero is a failure."""
        def done():
            for name, p in self.by_name.items():
                if name not in self.killed and p.popen.poll() not in (None, 0):
                    raise RuntimeError(f"{name} exited with {p.popen.returncode}:\n"
                                       + p.log()[-3000:])
            return self.status()["state"] == "done"
        wait_for(done, timeout, "the job to finish", interval=0.5)

    def add_worker(self):
        name = f"w{self.names}"
        self.names += 1
        self.by_name[name] = self.start_worker(name)
        return name

    def stage_workers(self, status=None):
        status = status or self.status()
        return {w["stage"]: w["name"] for w in status["workers"]
                if w["stage"] >= 0 and w["state"] == "WORKER_STATE_TRAINING"}

    def step(self):
        return int(self.status()["step"])

    def wait_step(self, step, timeout):
        return wait_for(lambda: self.step() >= step and self.step(), timeout,
                        f"step {step}", interval=0.1)


class StandbyTakeoverTest(unittest.TestCase):
    def test_recovery_time_after_killing_a_middle_stage(self):
        """kill -9 of stage 1, five times, with a standby joined before each
        kill: time from the kill to the first step completed on the new
        plan."""
        with FaultCluster(steps=100000).start(workers=4, until_step=10) as c:
            recovery = []
            for kill in range(5):
                status = c.status()
                victim = c.stage_workers(status)[1]
                epoch, step = int(status["epoch"]), int(status["step"])
                killed_at = time.monotonic()
                c.kill(victim)

                def resumed():
                    s = c.status()
                    return int(s["epoch"]) > epoch and int(s["step"]) > step + 1
                wait_for(resumed, 30, f"training after kill {kill + 1}", interval=0.05)
                recovery.append(time.monotonic() - killed_at)
                print(f"kill {kill + 1} of {victim}: next step after {recovery[-1]:.1f} s",
                      flush=True)
                fresh = c.add_worker()  # the machine comes back, as a standby
                wait_for(lambda: any(w["name"] == fresh and
                                     w["state"] == "WORKER_STATE_STANDBY"
                                     for w in c.status()["workers"]), 30, "a standby")
                c.wait_step(int(c.status()["step"]) + 3, 60)
            status = c.status()
        median = statistics.median(recovery)
        print(f"recovery over {len(recovery)} kills: median {median:.1f} s, "
              f"max {max(recovery):.1f} s, all {[round(r, 1) for r in recovery]}")
        self.assertLessEqual(median, 10)
        self.assertLessEqual(max(recovery), 15)
        kinds = [e["kind"] for e in status["events"]]
        for kind in ("lost", "replanned", "restored", "restore"):
            self.assertIn(kind, kinds)

    def test_without_standby_the_layers_are_repartitioned(self):
        with FaultCluster(steps=100000).start(workers=3, until_step=8) as c:
            status = c.status()
            c.kill(c.stage_workers(status)[2])
            wait_for(lambda: len(c.stage_workers()) == 2 and
                     c.step() > int(status["step"]) + 2, 40, "training on 2 stages")
            status = c.status()
        stages = sorted((w["layer_begin"], w["layer_end"]) for w in status["workers"]
                        if w["state"] == "WORKER_STATE_TRAINING")
        self.assertEqual(stages[0][0], 0)
        self.assertEqual(stages[-1][1], 5)
        self.assertEqual(stages[0][1], stages[1][0])
        replans = [e["detail"] for e in status["events"] if e["kind"] == "replanned"]
        self.assertTrue(any("re-partitioned" in d for d in replans), replans)


class ChaosTest(unittest.TestCase):
    STEPS = 240

    def run_job(self, chaos):
        rng = random.Random(7)
        # Join order: the witnesses below should stay in the pipeline from
        # the first failure to the end. The network planner may re-plan a
        # healthy worker out to a standby (one CI run's witness ended as a
        # standby, LEFT), which is its right but not what this measures;
        # so may this planner, more rarely (another's did).
        with FaultCluster(steps=self.STEPS, coordinator_flags=["--planner=join-order"]) as c:
            c.start_coordinator()
            for _ in range(5):  # 3 stages and 2 standbys
                c.add_worker()
            stopped = None
            rss_early = {}
            witness = None
            if chaos:
                for fraction in (0.15, 0.35, 0.55):
                    c.wait_step(int(self.STEPS * fraction), 120)
                    status = c.status()
                    if not rss_early:
                        # Witnesses: the stage workers before any failure
                        # (standbys then hold no stage: their memory grows
                        # when they take one). Stage 0's is spared by the
                        # chaos; its pipeline is torn down and rebuilt at
                        # every re-plan.
                        staged = set(c.stage_workers(status).values())
                        witness = c.stage_workers(status)[0]
                        rss_early = {w["name"]: int(w["rss_bytes"])
                                     for w in status["workers"] if w["name"] in staged}
                    victim = rng.choice(sorted(set(c.stage_workers(status).values()) -
                                               {witness}))
                    c.kill(victim)
                    print(f"step {status['step']}: kill -9 {victim}", flush=True)
                    c.add_worker()
                c.wait_step(int(self.STEPS * 0.7), 120)
                status = c.status()
                stopped = rng.choice(sorted(set(c.stage_workers(status).values()) -
                                            {witness}))
                print(f"step {status['step']}: SIGSTOP {stopped} for 10 s", flush=True)
                c.by_name[stopped].popen.send_signal(signal.SIGSTOP)
                time.sleep(10)  # the disruption itself lasts 10 s
                c.by_name[stopped].popen.send_signal(signal.SIGCONT)
            c.wait_done(timeout=170)
            status = c.status()
            steps = c.steps()
            for name, p in c.by_name.items():
                if name in c.killed:
                    continue
                self.assertIn(p.popen.poll(), (None, 0), f"{name} crashed:\n{p.log()[-2000:]}")
            spared = {name: rss for name, rss in rss_early.items()
                      if name not in c.killed and name != stopped}
            return steps, status, spared

    def test_training_survives_kills_and_a_stop(self):
        start = time.monotonic()
        calm_steps, _, _ = self.run_job(chaos=False)
        chaos_steps, status, rss_early = self.run_job(chaos=True)
        print(f"both runs took {time.monotonic() - start:.0f} s")
        numbers = [int(m["step"]) for m in chaos_steps]
        self.assertEqual(numbers, sorted(set(numbers)), "a step number repeated or went back")
        self.assertEqual(numbers[-1], self.STEPS)
        calm, chaos = loss_margin(calm_steps), loss_margin(chaos_steps)
        print(f"loss drop: undisturbed {calm:.3f}, with failures {chaos:.3f} "
              f"({chaos / calm - 1:+.1%})")
        self.assertGreater(calm, 0)
        self.assertLessEqual(abs(chaos / calm - 1), 0.10)
        kinds = [e["kind"] for e in status["events"]]
        self.assertGreaterEqual(kinds.count("replanned"), 4)
        # The memory of a worker that trained from before the first failure
        # did not grow. Which ones stay in the pipeline to the end is the
        # re-plans' choice (a CI run's stage-0 worker ended as a standby,
        # LEFT, even with the join-order planner): one of those spared by
        # the chaos that finished the job if any did, else one spared that
        # trained through the failures and was planned out later (its last
        # heartbeat's figure).
        spared = [w for w in status["workers"] if w["name"] in rss_early]
        self.assertTrue(spared, (rss_early, status["workers"]))
        final = next((w for w in spared if w["state"] == "WORKER_STATE_DONE"), spared[0])
        witness = final["name"]
        growth = int(final["rss_bytes"]) / rss_early[witness] - 1
        print(f"{witness} ({final['state']}): RSS {growth:+.1%} from the first failure to the "
              "end")
        self.assertLess(growth, 0.25)
        self.assertGreater(int(status["dropped_microbatches"]), 0)


class CoordinatorRestartTest(unittest.TestCase):
    def test_kill_and_restart_the_coordinator(self):
        with FaultCluster(steps=150) as c:
            c.start_coordinator()
            port = c.port
            for _ in range(3):
                c.add_worker()
            c.wait_step(40, 120)
            before = c.status()
            index_before = before["checkpoint_steps"]
            self.assertTrue(all(s >= 0 for s in index_before), index_before)
            c.coordinator.popen.kill()
            c.coordinator.stop()  # reaps it and closes its log
            time.sleep(2)  # the workers train on without it meanwhile
            c.start_coordinator(port=port)
            after = c.status()
            # It took over the persisted progress (saved at every step;
            # reports sent while it was down are lost, not replayed).
            self.assertGreaterEqual(int(after["step"]), int(before["step"]))
            self.assertEqual(int(after["epoch"]), int(before["epoch"]))
            for layer, step in enumerate(after["checkpoint_steps"]):
                self.assertGreaterEqual(step, index_before[layer])
            c.wait_done(timeout=170)
            status = c.status()
            numbers = [int(m["step"]) for m in c.steps()]
        self.assertEqual(numbers, sorted(set(numbers)), "a step number repeated or went back")
        self.assertEqual(numbers[-1], 150)
        kinds = [e["kind"] for e in status["events"]]
        self.assertIn("recovered", kinds)
        self.assertEqual(int(status["epoch"]), int(before["epoch"]) + 1)  # + the job_done plan


class DrainTest(unittest.TestCase):
    def test_sigterm_hands_the_stage_to_a_standby(self):
        with FaultCluster(steps=100000).start(workers=4, until_step=12) as c:
            status = c.status()
            leaving = c.stage_workers(status)[1]
            c.by_name[leaving].popen.send_signal(signal.SIGTERM)
            self.assertEqual(c.by_name[leaving].popen.wait(timeout=30), 0)
            step = int(status["step"])
            wait_for(lambda: c.step() > step + 3, 40, "training after the drain")
            status = c.status()
        events = status["events"]
        drain = [e for e in events if e["kind"] == "drain"]
        self.assertEqual(len(drain), 1, events)
        self.assertIn("saved at step", drain[0]["detail"])
        saved_step = int(drain[0]["detail"].split("saved at step ")[1].split(";")[0])
        restores = [e for e in events if e["kind"] == "restore"
                    and e["time_s"] > drain[0]["time_s"]]
        self.assertTrue(restores, events)
        # The standby restored what the drain saved: no update lost.
        for e in restores:
            self.assertEqual(int(e["detail"].split("from step ")[1]), saved_step, e)
        left = [w for w in status["workers"] if w["name"] == leaving][0]
        self.assertEqual(left["state"], "WORKER_STATE_LEFT")


class CorruptCheckpointTest(unittest.TestCase):
    def test_a_corrupt_checkpoint_is_passed_over(self):
        with FaultCluster(steps=100000).start(workers=4, until_step=12) as c:
            status = c.status()
            victim = c.stage_workers(status)[1]
            begin = [w for w in status["workers"] if w["name"] == victim][0]["layer_begin"]
            layer_dir = os.path.join(c.dir, "state", "checkpoints", f"layer-{begin:04d}")
            # Stopped first, so that it uploads nothing newer, and corrupted
            # before the kill: the coordinator re-plans within milliseconds
            # of a neighbour's link_lost, and a corruption written after the
            # kill came after the restore (a fresh-clone run saw that).
            c.by_name[victim].popen.send_signal(signal.SIGSTOP)
            # A complete checkpoint: an upload cut short leaves a partial
            # step-N.ckpt.tmpK beside them.
            newest = sorted(n for n in os.listdir(layer_dir) if n.endswith(".ckpt"))[-1]
            with open(os.path.join(layer_dir, newest), "r+b") as f:
                f.seek(100)
                f.write(b"\xde\xad\xbe\xef")
            c.kill(victim)
            wait_for(lambda: any(e["kind"] == "restore" and e["time_s"] > status["elapsed_s"]
                                 for e in c.status()["events"]), 40, "the restore")
            events = c.status()["events"]
        corrupt = [e for e in events if e["kind"] == "checkpoint_corrupt"]
        self.assertTrue(corrupt, events)
        self.assertIn(newest, corrupt[0]["detail"])
        restore = [e for e in events if e["kind"] == "restore" and f"layer {begin} " in
                   e["detail"] + " "][-1]
        newest_step = int(newest.split("-")[1].split(".")[0])
        self.assertLess(int(restore["detail"].split("from step ")[1]), newest_step)


class StragglerTest(unittest.TestCase):
    def test_a_straggler_is_reported_and_replaced_by_a_standby(self):
        """Stage 1's worker runs a tenth of the time (SIGSTOP 180 ms of
        every 200 ms, like a busy volunteer machine); its heartbeats and
        links stay alive, but it computes several times slower than its
        benchmark."""
        with FaultCluster(steps=100000).start(workers=4, until_step=10) as c:
            stop_cycling = threading.Event()
            status = c.status()
            slow = c.stage_workers(status)[1]
            pid = c.by_name[slow].popen.pid

            def cycle():
                while not stop_cycling.is_set():
                    os.kill(pid, signal.SIGSTOP)
                    time.sleep(0.18)
                    os.kill(pid, signal.SIGCONT)
                    time.sleep(0.02)
            try:
                threading.Thread(target=cycle, daemon=True).start()
                started = time.monotonic()

                def demoted():
                    s = c.status()
                    return s if slow not in c.stage_workers(s).values() else None
                # A liveness bound: 14 s here alone; a loaded CI machine
                # (two suites on 2 cores) once took over 60 s.
                status = wait_for(demoted, 150, "the straggler to be replaced", interval=0.5)
                took = time.monotonic() - started
            finally:  # let it run again, whatever happened
                stop_cycling.set()
                time.sleep(0.3)
                os.kill(pid, signal.SIGCONT)
            c.wait_step(int(status["step"]) + 5, 30)
            status = c.status()
        stragglers = [e for e in status["events"] if e["kind"] == "straggler"]
        print(f"straggler replaced {took:.1f} s after it slowed down: {stragglers[0]['detail']}")
        self.assertEqual(stragglers[0]["worker"], slow)
        self.assertIn("the slowest other stage", stragglers[0]["detail"])
        replaced = [w for w in status["workers"] if w["name"] == slow][0]
        self.assertEqual(replaced["state"], "WORKER_STATE_STANDBY")


class BlackholeTest(unittest.TestCase):
    def test_a_blackholed_link_is_detected_and_routed_around(self):
        """Every worker behind its own geotrain-linkem relay; the relay in
        front of stage 1 turns into a blackhole (accepts, acknowledges and
        drops everything, closes nothing). Whichever finds it first, the
        coordinator's progress watchdog (no step for two leases; stage 0
        has waited on stage 1, which waits on nobody) or stage 0's link
        keepalive (10 s ping, 5 s timeout), a standby takes stage 1."""
        workdir = tempfile.mkdtemp(prefix="geotrain-blackhole-")
        job_file = write_job(workdir, 100000)
        with wan_job.WanJob(job_file, 4, ["--delay_ms=0"], bin_dir=BIN_DIR,
                            workdir=workdir) as job:
            job.start()
            try:
                wait_for(lambda: int((job.status() or {}).get("step", 0)) >= 10, 120, "step 10")
                status = job.status()
                victim = [w for w in status["workers"] if w["stage"] == 1][0]["name"]
                relay = [p for p in job.processes if p.name == f"linkem{victim[1:]}"][0]
                epoch, step = int(status["epoch"]), int(status["step"])
                blackholed_at = float(status["elapsed_s"])  # coordinator time
                relay.send_signal(signal.SIGUSR1)  # blackhole on
                started = time.monotonic()

                def resumed():
                    s = job.status()
                    return s and int(s["epoch"]) > epoch and int(s["step"]) > step + 1 and s
                status = wait_for(resumed, 40, "training around the blackhole", interval=0.2)
                took = time.monotonic() - started
            except Exception:
                for name in os.listdir(workdir):
                    if name.endswith(".log"):
                        with open(os.path.join(workdir, name)) as f:
                            print(f"==== {name}\n{f.read()[-3000:]}")
                raise
        lost = [e for e in status["events"] if e["kind"] in ("link_lost", "stalled")]
        self.assertTrue(lost, status["events"])
        detected = lost[0]["time_s"] - blackholed_at
        print(f"blackhole detected after {detected:.1f} s by {lost[0]['kind']} (watchdog: two "
              f"leases; keepalive 10 s + timeout 5 s), "
              f"next step after {took:.1f} s")
        self.assertLessEqual(detected, 15 + 2)  # timer granularity and the report RPC
        self.assertLessEqual(took, 15 + 3)
        replaced = [w for w in status["workers"] if w["name"] == victim][0]
        self.assertEqual(replaced["stage"], -1)
        self.assertEqual(replaced["state"], "WORKER_STATE_STANDBY")  # alive, just cut off


if __name__ == "__main__":
    unittest.main(verbosity=2)
