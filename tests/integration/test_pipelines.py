"""Several pipelines with an outer optimizer, on real processes.

Six workers join a job with `max_stages: 2` and an `outer { }` block: the
planner forms three pipelines of two stages. Each pipeline trains on its own
share of the data; every H steps the replicas of each stage reduce their
pseudo-gradients (int8, error feedback) through the stage's reducer over the
same authenticated links as activations, and apply the same Nesterov outer
step. At the end every stage's three replicas hold bit-identical weights,
which each worker logs as a SHA-256 digest.
"""
import json
import os
import re
import signal
import subprocess
import time
import unittest

from cluster import Cluster
from test_operations import test_python

JOB = """
name: "pipelines-mlp"
mlp { hidden: 64 hidden: 64 }
fashion_mnist { }
optimizer { kind: KIND_ADAMW lr: 0.002 }
schedule: SCHEDULE_%(schedule)s
steps: %(steps)d
microbatches: 4
microbatch_size: 16
seed: 11
min_workers: 6
max_stages: 2
eval_every: 0
eval_batches: 2
outer { inner_steps: %(inner_steps)d lr: 0.7 momentum: 0.9 codec: CODEC_INT8 streaming: %(streaming)s %(outer_extra)s}
"""

DRAWN = re.compile(r"data drawn in plan epoch (\d+): indices (\d+) to (\d+) every (\d+)")
# With outer.split_batch and an uneven split: "..., N a step in blocks of B".
DRAWN_SPLIT = re.compile(r"data drawn in plan epoch (\d+): indices (\d+) to (\d+) every (\d+)"
                         r"(?:, (\d+) a step in blocks of (\d+))?")


def drawn_indices(first, last, stride, per_block, block):
    """The indices a stage 0 drew, from its log line: every `stride` from
    `first`, or `per_block` of them from each `block` where its share of a
    step is not a whole block."""
    if not per_block:
        return set(range(first, last + 1, stride))
    out = set()
    start = first
    while start <= last:
        out.update(i for i in range(start, start + per_block * stride, stride) if i <= last)
        start += block
    return out

FINAL = re.compile(r"outer sync of stage (\d+): (\d+) rounds applied; final weights sha256 "
                   r"([0-9a-f]{64}), outer weights sha256 ([0-9a-f]{64})")


class PipelinesCluster(Cluster):
    def __init__(self, steps, inner_steps, streaming, schedule="SYNC", secure=False,
                 workers=6, max_pipelines=0, planner="join-order", split_batch=False):
        # Join order by default: its plan (R = workers / 2 pipelines of
        # max_stages 2) is what most of these tests check against.
        super().__init__(None, [f"--planner={planner}"], secure=secure)
        self.job = f"{self.dir}/job.textproto"
        text = JOB % {"steps": steps, "inner_steps": inner_steps,
                      "streaming": "true" if streaming else "false", "schedule": schedule,
                      "outer_extra": (f"max_pipelines: {max_pipelines} " if max_pipelines else "")
                      + ("split_batch: true " if split_batch else "")}
        with open(self.job, "w") as f:
            f.write(text.replace("min_workers: 6", f"min_workers: {workers}"))

    def finals(self, workers=None):
        """{stage: [(rounds, weights digest, outer digest) of each worker]}."""
        by_stage = {}
        for p in workers if workers is not None else self.workers:
            found = FINAL.findall(p.log())
            if not found:
                raise AssertionError(f"{p.name} logged no final digest:\n{p.log()[-3000:]}")
            stage, rounds, weights, outer = found[-1]
            by_stage.setdefault(int(stage), []).append((int(rounds), weights, outer))
        return by_stage


class PipelinesTest(unittest.TestCase):
    def check_run(self, streaming, schedule="SYNC", secure=False, tensorboard=False):
        steps, inner = 24, 4
        with PipelinesCluster(steps, inner, streaming, schedule, secure) as c:
            logdir = os.path.join(c.dir, "tensorboard")
            if tensorboard:
                c.coordinator_flags.append(f"--tensorboard_dir={logdir}")
            c.start_coordinator()
            # With TLS each worker holds a certificate for its id, and the
            # replica links are authenticated as the pipeline links are.
            extra = [f"--token={c.create_token('--uses=6', '--name=six')}"] if secure else []
            for i in range(6):
                c.start_worker(f"w{i}", extra=extra)
            try:
                c.wait_done(timeout=600)
            except Exception:
                print(c.dump_logs())
                raise
            status = c.status()
            self.assertEqual(int(status.get("pipelines", 1)), 3, status)
            # The cheap check on every microbatch raised no suspect among
            # honest workers (test_verification has the hostile one).
            self.assertEqual(int(status.get("event_counts", {}).get("output_norms_suspect", 0)), 0,
                             [e for e in status.get("events", [])
                              if e["kind"] == "output_norms_suspect"])
            for w in status["workers"]:
                self.assertTrue(w.get("output_norms"), w)
                self.assertFalse([n for n in w["output_norms"] if n.get("suspicion")], w)
            pipelines = {}
            for w in status["workers"]:
                if w.get("stage", -1) >= 0:
                    pipelines.setdefault(int(w.get("pipeline", 0)), []).append(int(w["stage"]))
            self.assertEqual({p: sorted(s) for p, s in pipelines.items()},
                             {0: [0, 1], 1: [0, 1], 2: [0, 1]}, status["workers"])
            finals = c.finals()
            self.assertEqual(sorted(finals), [0, 1])
            for stage, replicas in finals.items():
                print(f"stage {stage}: {replicas}", flush=True)
                self.assertEqual(len(replicas), 3, replicas)
                # Every round applied, ending with the final one at the
                # last step, and the same bytes on every replica.
                self.assertTrue(all(r[0] == steps // inner for r in replicas), replicas)
                self.assertEqual(len({r[1] for r in replicas}), 1, replicas)
                self.assertEqual(len({r[2] for r in replicas}), 1, replicas)
            # The job's step is a global batch: every step counted once,
            # each with the samples of all three pipelines (the log's
            # samples are the run's so far).
            counted = c.steps()
            self.assertEqual([m["step"] for m in counted], list(range(1, steps + 1)))
            self.assertEqual([int(m["samples"]) for m in counted],
                             [3 * 4 * 16 * m["step"] for m in counted])
            # Each step's line has each pipeline's loss; the job's is their
            # samples-weighted mean (equal samples: the plain mean).
            for m in counted:
                self.assertEqual([p["pipeline"] for p in m["pipelines"]], [0, 1, 2], m)
                mean = sum(p["loss"] for p in m["pipelines"]) / 3
                self.assertAlmostEqual(m["loss"], mean, places=5)
            if tensorboard:
                c.coordinator.stop()  # everything written and closed
                out = subprocess.run([test_python(), os.path.join(os.path.dirname(__file__),
                                                                  "tensorboard_scalars.py"),
                                      logdir], capture_output=True, text=True, timeout=900)
                self.assertEqual(out.returncode, 0, out.stderr[-2000:])
                series = json.loads(out.stdout)
                for r in range(3):
                    points = series[f"pipeline/{r}/loss"]
                    self.assertEqual([p[0] for p in points], list(range(1, steps + 1)))
                    self.assertAlmostEqual(points[0][1], counted[0]["pipelines"][r]["loss"],
                                           places=4)

    def test_the_network_planner_chooses_the_pipelines(self):
        # Its own R and stages (max_stages 2 caps them), from the measured
        # layer times and links; the outer sync then ends every stage's
        # replicas on the same weights as with join order's plan.
        steps, inner = 24, 4
        with PipelinesCluster(steps, inner, streaming=True, schedule="ASYNC_STASH",
                              planner="network") as c:
            c.train(6)
            status = c.status()
            pipelines = int(status.get("pipelines", 1))
            print(status["prediction"]["explanation"], flush=True)
            self.assertEqual(status["prediction"]["planner"], "network")
            self.assertGreaterEqual(pipelines, 2, status["prediction"])
            # The planner's own R (every worker joined before the first plan).
            self.assertIn(f"pipeline {pipelines - 1}:", status["prediction"]["explanation"])
            finals = c.finals([p for p in c.workers if FINAL.search(p.log())])
            for stage, replicas in finals.items():
                print(f"stage {stage}: {replicas}", flush=True)
                self.assertEqual(len(replicas), pipelines, replicas)
                self.assertEqual(len({r[1] for r in replicas}), 1, replicas)
                self.assertEqual(len({r[2] for r in replicas}), 1, replicas)
            counted = c.steps()
            self.assertEqual([m["step"] for m in counted], list(range(1, steps + 1)))

    def test_split_pipelines_share_the_jobs_batch(self):
        # outer.split_batch: three pipelines share each step's 4
        # microbatches (2, 1 and 1), so a step is the job's batch, not
        # three times it; the lanes together draw each step's indices once.
        steps, inner = 24, 4
        with PipelinesCluster(steps, inner, streaming=True, schedule="ASYNC_STASH",
                              split_batch=True) as c:
            c.train(6)
            self.assertEqual(int(c.status().get("pipelines", 1)), 3)
            counted = c.steps()
            self.assertEqual([m["step"] for m in counted], list(range(1, steps + 1)))
            self.assertEqual([int(m["samples"]) for m in counted],
                             [4 * 16 * m["step"] for m in counted])
            for stage, replicas in c.finals().items():
                self.assertEqual(len(replicas), 3, replicas)
                self.assertEqual(len({r[1] for r in replicas}), 1, replicas)
            drawn = {}  # (worker, plan epoch): indices
            for p in c.workers:
                for epoch, first, last, stride, per_block, block in DRAWN_SPLIT.findall(p.log()):
                    drawn[(p.name, epoch)] = drawn_indices(int(first), int(last), int(stride),
                                                           int(per_block or 0), int(block or 0))
            self.assertGreaterEqual(len(drawn), 3, drawn)
            union = set()
            for name, indices in drawn.items():
                self.assertFalse(union & indices, f"{name} drew {sorted(union & indices)[:5]}")
                union |= indices
            self.assertEqual(union, set(range(4 * steps)))

    def test_blocking_rounds_leave_replicas_bit_identical(self):
        self.check_run(streaming=False, tensorboard=True)

    def test_streaming_rounds_over_tls_leave_replicas_bit_identical(self):
        self.check_run(streaming=True, schedule="ASYNC_STASH", secure=True)



class PipelineChurnTest(unittest.TestCase):
    """A lost worker stops only its own pipeline.

    Two pipelines of two stages. Pipeline 1's last stage is killed with
    SIGKILL mid-run: with no standby, pipeline 1 is dissolved, and pipeline
    0 goes on through the re-plan in the same sessions (its workers never
    end their pipeline). A newcomer, w4, then joins, and with pipeline 1's
    standing-by stage 0 forms pipeline 1 anew; pipeline 0 goes on through
    that too. The run
    ends with every stage's replicas bit-identical, every step of the job
    counted once, and no data index drawn twice by any stage 0, whatever
    its session (each logs what it drew).
    """

    def test_a_lost_worker_stops_only_its_own_pipeline(self):
        steps = 2500
        with PipelinesCluster(steps, 8, streaming=True, schedule="ASYNC_STASH", workers=4,
                              max_pipelines=2) as c:
            c.start_coordinator()
            for i in range(4):
                c.start_worker(f"w{i}")
            try:
                def coordinator_events(kind):
                    return c.coordinator.log().count(f"] event {kind}")

                def at_step(n):
                    status = c.status()
                    return status is not None and int(status.get("step", 0)) >= n
                deadline = time.monotonic() + 300
                while not at_step(40):
                    self.assertLess(time.monotonic(), deadline, "no step 40")
                    time.sleep(0.2)
                status = c.status()
                self.assertEqual(int(status.get("pipelines", 1)), 2, status)
                place = {(int(w.get("pipeline", 0)), int(w["stage"])): w["name"]
                         for w in status["workers"] if int(w.get("stage", -1)) >= 0}
                self.assertEqual(sorted(place), [(0, 0), (0, 1), (1, 0), (1, 1)], place)
                victim = next(p for p in c.workers if p.name == place[(1, 1)])
                victim.popen.send_signal(signal.SIGKILL)
                killed_at = int(c.status()["step"])
                victim.popen.wait()
                c.workers.remove(victim)  # its exit is the test's doing
                while coordinator_events("pipelines_continue") < 1:
                    self.assertLess(time.monotonic(), deadline, "pipeline 0 did not go on")
                    time.sleep(0.2)
                c.start_worker("w4")
                while coordinator_events("pipelines_continue") < 2:
                    self.assertLess(time.monotonic(), deadline, "no pipeline formed anew")
                    time.sleep(0.2)
                reformed_at = int(c.status()["step"])
                c.wait_done(timeout=600)
            except Exception:
                print(c.dump_logs())
                raise
            # The churn happened mid-run, not at its end.
            print(f"killed at step {killed_at}, pipeline 1 formed anew by step {reformed_at} "
                  f"of {steps}", flush=True)
            self.assertLess(reformed_at, steps - 100)
            log = c.coordinator.log()
            self.assertIn("dissolved", log)
            self.assertIn("formed from standbys", log)
            by_name = {p.name: p for p in c.workers}
            # Pipeline 0 never stopped: its sessions went on through both
            # re-plans.
            for name in (place[(0, 0)], place[(0, 1)]):
                text = by_name[name].log()
                self.assertNotIn("ending the current pipeline", text, name)
                self.assertGreaterEqual(text.count("this worker's pipeline goes on"), 2, name)
            # The stages' replicas end bit-identical (w3 is gone).
            finals = c.finals()
            for stage, replicas in finals.items():
                self.assertEqual(len(replicas), 2, (stage, replicas))
                self.assertEqual(len({r[1] for r in replicas}), 1, (stage, replicas))
            # Every step of the job once, in order.
            self.assertEqual([m["step"] for m in c.steps()], list(range(1, steps + 1)))
            # No index drawn twice: each stage-0 session's draws are an
            # arithmetic run; no two sessions' runs share an index.
            drawn = []
            for p in c.workers:
                for epoch, first, last, stride in DRAWN.findall(p.log()):
                    drawn.append((p.name, int(epoch),
                                  set(range(int(first), int(last) + 1, int(stride)))))
            self.assertGreaterEqual(len(drawn), 3, drawn)
            for i, (name_a, epoch_a, a) in enumerate(drawn):
                for name_b, epoch_b, b in drawn[i + 1:]:
                    self.assertFalse(a & b, f"{name_a} (epoch {epoch_a}) and {name_b} "
                                            f"(epoch {epoch_b}) drew {sorted(a & b)[:5]}")


if __name__ == "__main__":
    unittest.main()
