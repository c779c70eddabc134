"""One certified worker that misbehaves, beside honest ones (issue 32).

The hostile worker (geotrain-misbehaving-worker) is a real worker with a
real certificate from a real token; its pipeline sends through a
misbehaving wrapper and it uses its own key on the side. For each
misbehaviour on the list the job must either make a step or re-plan
within two leases, every time, for the whole watch; and no false claim
may end the job or move its progress.

What is measured: the status (step, epoch) every 0.3 s; the longest time
in which neither the step nor the epoch changed, from the first moment the
hostile worker misbehaved. The bound is two leases plus a re-planned
pipeline's start on this 2-core machine (SLACK_S)."""
import glob
import json
import os
import re
import signal
import time
import unittest

from cluster import Cluster, Process, binary, job_path, wait_for

LEASE_S = 5.0  # the fmnist-mlp job's lease_ms
SLACK_S = 6.0
WATCH_S = 40.0
CLAIM_STEP = 100000  # the job's last step (--steps), what false claims name


# Join order: the hostile worker holds the stage its join position gives it,
# and the standby is the worker that joined last.
JOIN_ORDER = ["--planner=join-order"]


class HostileWorkerTest(unittest.TestCase):
    def beside(self, misbehave, position, after=40):
        """Three stages; the hostile worker joins `position`-th (so holds
        that stage), one honest standby joins last. Returns the samples,
        the last status and the hostile worker's id."""
        c = Cluster(job_path("fmnist-mlp.textproto"),
                    ["--min_workers=3", f"--steps={CLAIM_STEP}", *JOIN_ORDER], secure=True)
        self.addCleanup(c.close)
        c.start_coordinator()
        token = c.create_token("--uses=5", "--name=volunteers")
        hostile = None
        for i in range(4):
            if i == position:
                args = [binary("geotrain-misbehaving-worker"), f"--coordinator={c.address}",
                        "--listen=127.0.0.1:0", "--name=hostile", f"--token={token}",
                        f"--state_dir={os.path.join(c.dir, 'hostile-state')}",
                        f"--misbehave={misbehave}", f"--after={after}",
                        f"--claim_step={CLAIM_STEP}"]
                hostile = Process(args, os.path.join(c.dir, "hostile.log"), name="hostile")
                c.workers.append(hostile)
            else:
                c.start_worker(f"w{i}", extra=[f"--token={token}"])
            # Join order is stage order: each joins before the next starts.
            wait_for(lambda: len(c.status()["workers"]) == i + 1, 60, f"worker {i} to join")
        hostile_id = next(w["id"] for w in c.status()["workers"] if w["name"] == "hostile")
        wait_for(lambda: int(c.status()["step"]) >= 3, 120, "training")
        first = wait_for(lambda: "hostile:" in hostile.log() and time.monotonic(), 90,
                         "the hostile worker to misbehave")
        samples = []
        while time.monotonic() - first < WATCH_S:
            s = c.status()
            samples.append((time.monotonic(), int(s["step"]), int(s["epoch"]), s["state"]))
            time.sleep(0.3)
        status = c.status()
        longest, since = 0.0, first
        for (t0, step0, epoch0, _), (t1, step1, epoch1, _) in zip(samples, samples[1:]):
            if step1 != step0 or epoch1 != epoch0:
                longest = max(longest, t1 - since)
                since = t1
        longest = max(longest, samples[-1][0] - since)
        kinds = [e["kind"] for e in status.get("events", [])]
        print(f"{misbehave}: steps {samples[0][1]} -> {samples[-1][1]}, epochs "
              f"{samples[0][2]} -> {samples[-1][2]}, longest stretch without a step or a "
              f"re-plan {longest:.1f} s (bound {2 * LEASE_S + SLACK_S:.0f} s); events {kinds}",
              flush=True)
        self.assertLessEqual(longest, 2 * LEASE_S + SLACK_S, c.dump_logs())
        self.assertGreater(samples[-1][1], samples[0][1], "no progress over the watch")
        self.assertNotEqual(status["state"], "done", "a false claim ended the job")
        self.assertLess(int(status["step"]), CLAIM_STEP)
        return samples, status, hostile_id, hostile

    def test_fake_done(self):
        _, status, hostile_id, hostile = self.beside("fake_done", position=1)
        self.assertIn("done refused", hostile.log())
        # Its neighbour refused the DONE frame: a re-plan followed.
        self.assertGreater(int(status["epoch"]), 1)

    def test_fake_final_step(self):
        _, status, _, hostile = self.beside("fake_final_step", position=2)
        self.assertIn("step report refused", hostile.log())

    def test_hijack_link_with_its_own_key(self):
        _, status, _, hostile = self.beside("hijack_link", position=1)
        # Refused without an answer; the real link went on (no re-plan).
        self.assertIn("hostile: second link to", hostile.log())
        self.assertNotIn("in epoch 1: answered", hostile.log())
        self.assertIn("key_in_use_twice", [e["kind"] for e in status.get("events", [])])

    def test_repeated_link_drops(self):
        _, status, hostile_id, _ = self.beside("drop_links", position=1)
        hostile = next(w for w in status["workers"] if w["id"] == hostile_id)
        self.assertEqual(hostile["stage"], -1, "the worker that keeps dropping is out")
        self.assertTrue(hostile.get("suspected"), hostile)

    def test_stalled_stream(self):
        _, status, hostile_id, _ = self.beside("stall", position=1)
        hostile = next(w for w in status["workers"] if w["id"] == hostile_id)
        self.assertEqual(hostile["stage"], -1, "the staller is out")


class CheckpointPoisoningTest(unittest.TestCase):
    def test_a_revoked_workers_poisoned_checkpoint_is_never_restored(self):
        """Issue 32: the primary of a stage uploaded its layers with every
        weight times -8 at a step ahead of the job; after it was revoked it
        was still the newest checkpoint, and the next restore took it
        (training loss 2.65 before, 20.81 after).

        Here an honest worker holds stage 1 first; the hostile one, a
        standby, takes the stage when that worker dies, uploads the poisoned
        layers, trains on and is revoked. The next restore of the stage must
        come from the honest worker's checkpoint."""
        c = Cluster(job_path("fmnist-mlp.textproto"),
                    ["--min_workers=3", f"--steps={CLAIM_STEP}", *JOIN_ORDER], secure=True)
        self.addCleanup(c.close)
        c.start_coordinator()
        token = c.create_token("--uses=5", "--name=volunteers")
        for i in range(4):
            if i == 3:
                hostile = Process(
                    [binary("geotrain-misbehaving-worker"), f"--coordinator={c.address}",
                     "--listen=127.0.0.1:0", "--name=hostile", f"--token={token}",
                     f"--state_dir={os.path.join(c.dir, 'hostile-state')}",
                     "--misbehave=poison_checkpoint"],
                    os.path.join(c.dir, "hostile.log"), name="hostile")
                c.workers.append(hostile)
            else:
                c.start_worker(f"w{i}", extra=[f"--token={token}"])
            wait_for(lambda: len(c.status()["workers"]) == i + 1, 60, f"worker {i} to join")
        hostile_id = next(w["id"] for w in c.status()["workers"] if w["name"] == "hostile")
        # The honest worker dies only once its layers are stored: a step
        # count alone does not say so (uploads run beside training, which
        # here makes 130 steps a second; one CI run killed it at step 30
        # before any upload of its layer had landed, and the stage then
        # rightly started from the seed, with no restore to check).
        honest_status = next(w for w in c.status()["workers"] if w["name"] == "w1")
        honest_layers = range(honest_status["layer_begin"], honest_status["layer_end"])
        self.assertTrue(honest_layers, honest_status)

        def stored(layer):
            return glob.glob(os.path.join(c.dir, "state", "checkpoints", f"layer-{layer:04d}",
                                          "step-*.ckpt"))
        wait_for(lambda: all(stored(layer) for layer in honest_layers), 120,
                 "honest checkpoints of stage 1")
        honest = next(p for p in c.workers if p.name == "w1")
        honest.stop(signal.SIGKILL)
        poisoned = wait_for(
            lambda: re.search(r"poisoned checkpoint of layers \[(\d+),\d+\) at step (\d+): "
                              r"accepted", hostile.log()), 120, "the poisoned upload")
        layer, step = int(poisoned.group(1)), int(poisoned.group(2))
        # The job goes on past the poisoned step, so honest checkpoints of
        # lower steps are all there is besides it.
        wait_for(lambda: int(c.status()["step"]) > step + 20, 120, "steps past the poisoned one")
        loss_before = float(c.status()["loss"])
        events_path = os.path.join(c.dir, "state", "events.log")

        def all_events():
            with open(events_path) as f:
                return [json.loads(line) for line in f if line.strip()]
        c.ctl("status")  # (the log is written off the caller's thread: let it catch up)
        earlier = len(all_events())
        out = c.ctl("worker", "revoke", hostile_id)
        self.assertEqual(out.returncode, 0, out.stderr)

        def events():  # since the revoke
            return all_events()[earlier:]
        wait_for(lambda: any(e["kind"] == "checkpoints_quarantined" for e in events()), 30,
                 "the quarantine")
        try:
            restore = wait_for(
                lambda: next((e for e in events() if e["kind"] == "restore"
                              and e["detail"].startswith(f"layer {layer} from step")), None),
                60, f"a restore of layer {layer}")
        except TimeoutError:
            # What happened instead, for the post-mortem (a fresh run once
            # timed out here and passed on every rerun).
            for e in events():
                print(f"  {e.get('time_s', 0):.1f} {e['kind']} {e.get('worker', '')} "
                      f"{e.get('detail', '')[:200]}", flush=True)
            print(c.ctl("status").stdout, flush=True)
            raise
        restored_step = int(restore["detail"].rsplit(" ", 1)[1])
        after = int(c.status()["step"])
        wait_for(lambda: int(c.status()["step"]) > after + 30, 120, "training after the restore")
        loss_after = float(c.status()["loss"])
        print(f"poisoned layer {layer} at step {step}; restored from step {restored_step}; "
              f"loss {loss_before:.3f} before the revoke, {loss_after:.3f} after", flush=True)
        self.assertLess(restored_step, step)
        uploaders = {e["detail"] for e in events() if e["kind"] == "restore"}
        self.assertTrue(uploaders, "a restore after the revoke")
        self.assertTrue(os.listdir(os.path.join(c.dir, "state", "checkpoints", "quarantine")))
        self.assertLess(loss_after, 2 * loss_before + 0.5, "the restore took poisoned weights")


if __name__ == "__main__":
    unittest.main(verbosity=2)
