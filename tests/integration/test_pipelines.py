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
import subprocess
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
outer { inner_steps: %(inner_steps)d lr: 0.7 momentum: 0.9 codec: CODEC_INT8 streaming: %(streaming)s }
"""

FINAL = re.compile(r"outer sync of stage (\d+): (\d+) rounds applied; final weights sha256 "
                   r"([0-9a-f]{64}), outer weights sha256 ([0-9a-f]{64})")


class PipelinesCluster(Cluster):
    def __init__(self, steps, inner_steps, streaming, schedule="SYNC", secure=False):
        super().__init__(None, secure=secure)
        self.job = f"{self.dir}/job.textproto"
        with open(self.job, "w") as f:
            f.write(JOB % {"steps": steps, "inner_steps": inner_steps,
                           "streaming": "true" if streaming else "false",
                           "schedule": schedule})

    def finals(self):
        """{stage: [(rounds, weights digest, outer digest) of each worker]}."""
        by_stage = {}
        for p in self.workers:
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

    def test_blocking_rounds_leave_replicas_bit_identical(self):
        self.check_run(streaming=False, tensorboard=True)

    def test_streaming_rounds_over_tls_leave_replicas_bit_identical(self):
        self.check_run(streaming=True, schedule="ASYNC_STASH", secure=True)


if __name__ == "__main__":
    unittest.main()
