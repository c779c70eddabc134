"""Verification on real processes (issue 35): the cheap check on every
microbatch.

Six workers form three pipelines of two stages (test_pipelines' job, over
TLS). One of them is geotrain-misbehaving-worker with
--misbehave=scale_outputs: after its first messages it multiplies every
activation or gradient it sends by 10, re-encodes it and commits to it as
its own, so every link check passes. Its neighbour measures the size of
what it received; the coordinator holds that against the same stage in the
other two pipelines and must name the hostile worker, and only it, a
suspect. The honest runs of test_pipelines check the other side: no
suspect at all."""
import os
import time
import unittest

from cluster import Process, binary, wait_for
from test_pipelines import PipelinesCluster

HONEST_MESSAGES = 20  # what the hostile worker sends honestly first


class OutputNormsTest(unittest.TestCase):
    def test_scaled_outputs_make_their_sender_the_only_suspect(self):
        with PipelinesCluster(400, 8, streaming=False, secure=True) as c:
            c.start_coordinator()
            token = c.create_token("--uses=6", "--name=six")
            for i in range(5):
                c.start_worker(f"w{i}", extra=[f"--token={token}"])
                wait_for(lambda: len(c.status()["workers"]) == i + 1, 60, f"worker {i} to join")
            hostile = Process([binary("geotrain-misbehaving-worker"),
                               f"--coordinator={c.address}", "--listen=127.0.0.1:0",
                               "--name=hostile", f"--token={token}",
                               f"--state_dir={os.path.join(c.dir, 'hostile-state')}",
                               "--misbehave=scale_outputs", "--factor=10",
                               f"--after={HONEST_MESSAGES}"],
                              os.path.join(c.dir, "hostile.log"), name="hostile")
            c.workers.append(hostile)
            wait_for(lambda: "hostile: scaling" in hostile.log(), 300,
                     "the hostile worker to scale its outputs", interval=0.5)
            started = time.monotonic()
            start_step = int(c.status()["step"])

            def suspect_event():
                for e in c.status().get("events", []):
                    if e["kind"] == "output_norms_suspect":
                        return e
                return None

            try:
                event = wait_for(suspect_event, 120, "an output_norms_suspect event",
                                 interval=0.5)
            except Exception:
                print(c.dump_logs())
                raise
            status = c.status()
            print(f"suspect after {time.monotonic() - started:.1f} s, steps {start_step} -> "
                  f"{status['step']}: {event['worker']}: {event['detail']}", flush=True)
            self.assertEqual(event["worker"], "hostile", event)
            suspects = {w["name"]: [n["suspicion"] for n in w.get("output_norms", [])
                                    if n.get("suspicion")]
                        for w in status["workers"]}
            for name, why in suspects.items():
                if name == "hostile":
                    self.assertTrue(why, status["workers"])
                else:
                    self.assertFalse(why, f"{name} is a suspect: {why}")
            # The figures behind it: about 10x the median of its replicas.
            mine = next(w for w in status["workers"] if w["name"] == "hostile")
            norms = next(n for n in mine["output_norms"] if n.get("suspicion"))
            ratio = float(norms["rms"]) / float(norms["replicas_rms"])
            print(f"hostile's {norms['kind']}s: rms {float(norms['rms']):.4g}, replicas "
                  f"{float(norms['replicas_rms']):.4g} ({ratio:.1f}x)", flush=True)
            self.assertGreater(ratio, 3)
            out = c.ctl("status")
            self.assertIn("OUTPUTS SUSPECT", out.stdout)


if __name__ == "__main__":
    unittest.main()
