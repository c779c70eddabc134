"""Verification on real processes (issue 35): the cheap check on every
microbatch, and spot checks during a job.

Six workers form three pipelines of two stages (test_pipelines' job, over
TLS). One of them is geotrain-misbehaving-worker with
--misbehave=scale_outputs: after its first messages it multiplies every
activation or gradient it sends by 10, re-encodes it and commits to it as
its own, so every link check passes. Its neighbour measures the size of
what it received; the coordinator holds that against the same stage in the
other two pipelines and must name the hostile worker, and only it, a
suspect. The honest runs of test_pipelines check the other side: no
suspect at all.

SpotCheckTest runs the same job with `verification { fraction }`: after
each committed step the coordinator draws, with a key no worker holds,
which computations a replica of the stage in another pipeline recomputes
from the logged evidence. The hostile worker multiplies its gradients by
1.05, or adds 1% noise, or flips their sign - too little for the cheap
check - and logs what it really sent, so its evidence holds together; the
recomputation must find it out, a second verifier confirm it, and the
coordinator evict it and revoke its certificate, while every audit of an
honest worker passes."""
import json
import os
import re
import time
import unittest
import urllib.request

from cluster import Process, binary, wait_for
from test_pipelines import PipelinesCluster

HONEST_MESSAGES = 20  # what the hostile worker sends honestly first


def hostile_worker(c, token, *flags):
    """geotrain-misbehaving-worker named "hostile" joining `c` with `token`
    and `flags`; added to c.workers."""
    process = Process([binary("geotrain-misbehaving-worker"), f"--coordinator={c.address}",
                       "--listen=127.0.0.1:0", "--name=hostile", f"--token={token}",
                       f"--state_dir={os.path.join(c.dir, 'hostile-state')}", *flags],
                      os.path.join(c.dir, "hostile.log"), name="hostile")
    c.workers.append(process)
    return process


class OutputNormsTest(unittest.TestCase):
    def test_scaled_outputs_make_their_sender_the_only_suspect(self):
        with PipelinesCluster(400, 8, streaming=False, secure=True) as c:
            c.start_coordinator()
            token = c.create_token("--uses=6", "--name=six")
            for i in range(5):
                c.start_worker(f"w{i}", extra=[f"--token={token}"])
                wait_for(lambda: len(c.status()["workers"]) == i + 1, 60, f"worker {i} to join")
            hostile = hostile_worker(c, token, "--misbehave=scale_outputs", "--factor=10",
                                     f"--after={HONEST_MESSAGES}")
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


SPOT_CHECK_FRACTION = 0.05
HONEST_STEPS = 400


class SpotCheckTest(unittest.TestCase):
    def run_adversary(self, misbehave, extra=(), workers=6, position=5, stage=1, plan_at=None,
                      tamper_mark="hostile: scaling", caught_by="microbatch", confirmed=True):
        """The hostile worker joins `position`-th of `workers` and must
        hold `stage` (join order places it). The first plan is made when
        `plan_at` workers (all, by default) have joined: with a standby,
        before it joins, since the planner leaves the slowest out and the
        hostile worker may measure slowest. `confirmed`: two verifiers fail
        one of its audits; otherwise it is evicted for the weight syncs it
        claims (its update audits unverifiable)."""
        with PipelinesCluster(100000, 8, streaming=False, secure=True,
                              workers=plan_at or workers) as c:
            with open(c.job, "a") as f:
                f.write(f"verification {{ fraction: {SPOT_CHECK_FRACTION} }}\n")
            c.coordinator_flags.append("--metrics_listen=127.0.0.1:0")
            c.start_coordinator()
            token = c.create_token(f"--uses={workers}", "--name=volunteers")
            hostile = None
            for i in range(workers):
                if i == position:
                    hostile = hostile_worker(c, token, f"--misbehave={misbehave}",
                                             "--consistent_log", f"--after={HONEST_MESSAGES}",
                                             *extra)
                else:
                    c.start_worker(f"w{i}", extra=[f"--token={token}"])
                wait_for(lambda: len(c.status()["workers"]) == i + 1, 60, f"worker {i} to join")
            wait_for(lambda: tamper_mark in hostile.log(), 300,
                     "the hostile worker to tamper", interval=0.5)
            status = c.status()
            mine = next(w for w in status["workers"] if w["name"] == "hostile")
            # Stage 1 (the last) is audited on its gradients, stage 0 on
            # its activations (its input: data the verifier loads itself).
            self.assertEqual(int(mine["stage"]), stage, status["workers"])
            started, start_step = time.monotonic(), int(status["step"])
            events_path = os.path.join(c.dir, "state", "events.log")

            def events():
                with open(events_path) as f:
                    return [json.loads(line) for line in f if line.strip()]

            def evicted():
                c.ctl("status")  # the log is written off the caller's thread
                return next((e for e in events() if e["kind"] == "audit_evicted"), None)

            try:
                eviction = wait_for(evicted, 180, "an audit_evicted event", interval=0.5)
            except Exception:
                print(c.dump_logs())
                raise
            after = c.status()
            log = events()
            kinds = [e["kind"] for e in log]
            passed = [e for e in log if e["kind"] == "audit_passed"]
            failed = [e for e in log if e["kind"] == "audit_failed"]
            # The job rolled back, from the step it was evicted at, to before
            # the step of the audit that caught it, and never past the last
            # audit of the hostile worker that passed: of its outputs, or
            # caught in an update, of its updates (docs/verification.md,
            # "Rollback"). It lies only on float32 messages, so one that
            # "lies on every message" passes audits of those its codec
            # encoded otherwise.
            rollback = wait_for(
                lambda: next((e for e in events() if e["kind"] == "rolled_back"), None), 30,
                "the rollback")
            undone = re.search(r"from step (\d+) to step (\d+)", rollback["detail"])
            self.assertIsNotNone(undone, rollback)
            caught_at = int(re.search(r", step (\d+),", eviction["detail"]).group(1))
            self.assertLess(int(undone.group(2)), caught_at, (rollback, eviction))
            vouching = [int(re.search(r", step (\d+),", e["detail"]).group(1)) for e in log
                        if e["kind"] == "audit_passed" and " of hostile " in e["detail"] and
                        (caught_by == "microbatch" or caught_by in e["detail"])]
            self.assertLessEqual(int(undone.group(2)), max(vouching, default=0),
                                 (rollback, vouching))
            print(f"{misbehave}: evicted after {time.monotonic() - started:.1f} s, steps "
                  f"{start_step} -> {undone.group(1)}, rolled back to step {undone.group(2)}; "
                  f"audits passed {len(passed)}, failed "
                  f"{len(failed)}, disputed {kinds.count('audit_disputed')}, expired "
                  f"{kinds.count('audit_expired')}: {eviction['detail'][:400]}", flush=True)
            self.assertEqual(eviction["worker"], "hostile", eviction)
            # Which kind of audit caught it: an output's ("microbatch M") or
            # an update's ("the update after step S").
            self.assertIn(f", {caught_by}", eviction["detail"])
            self.assertEqual([e["worker"] for e in log if e["kind"] == "audit_evicted"],
                             ["hostile"])
            # Two verifiers failed it; every failure was of the hostile one.
            # Or none did: far more of its update audits than its job's
            # outer steps explain were unverifiable, each by two verifiers.
            if confirmed:
                self.assertGreaterEqual(len(failed), 2)
            else:
                self.assertEqual(failed, [])
                self.assertIn("update audits had weight syncs between, far more",
                              eviction["detail"])
                unverifiable = [e for e in log if e["kind"] == "audit_unverifiable" and
                                " of hostile " in e["detail"]]
                self.assertGreaterEqual(len(unverifiable), 8, unverifiable)
            for e in failed:
                self.assertIn("audit", e["detail"])
                self.assertIn(" of hostile ", e["detail"], e)
            self.assertNotIn("audit_disputed", kinds)
            # Out of the plan, its certificate denied from now on; the job
            # goes on.
            self.assertIn("revoked", kinds)
            wait_for(lambda: all(w["name"] != "hostile" or int(w["stage"]) == -1
                                 for w in c.status()["workers"]), 60, "a plan without it")
            wait_for(lambda: int(c.status()["step"]) > int(after["step"]) + 20, 120,
                     "training after the eviction")
            # What an operator sees: status, geotrain-ctl and Prometheus.
            final = c.status()
            audits = final["audits"]
            failures = 1 if confirmed else 0
            self.assertEqual(int(audits.get("failed", 0)), failures, audits)
            self.assertGreater(int(audits["passed"]), 0, audits)
            for w in final["workers"]:
                self.assertEqual(int(w.get("audits_failed", 0)),
                                 failures if w["name"] == "hostile" else 0, w)
            text = c.ctl("status").stdout
            self.assertIn("spot checks (fraction 0.05)", text)
            if confirmed:
                self.assertIn("FAILED SPOT CHECK", text)
            url = wait_for(lambda: re.search(r"metrics: (http://\S+/metrics)", c.coordinator.log()),
                           10, "the coordinator's metrics address").group(1)
            metrics = urllib.request.urlopen(url, timeout=5).read().decode()
            self.assertRegex(metrics, rf'geotrain_audits_total\{{outcome="failed"\}} {failures}\b')
            self.assertRegex(metrics, r'geotrain_audits_total\{outcome="passed"\} [1-9]')
            return passed

    def test_honest_workers_on_mixed_kernels_pass_every_audit(self):
        """Six honest workers, half of them on OpenBLAS's generic Prescott
        kernel (the others on this CPU's own): every audit passes; none
        fails, disputes or evicts."""
        with PipelinesCluster(HONEST_STEPS, 8, streaming=False, secure=True) as c:
            with open(c.job, "a") as f:
                f.write(f"verification {{ fraction: {SPOT_CHECK_FRACTION} }}\n")
            c.start_coordinator()
            token = c.create_token("--uses=6", "--name=six")
            for i in range(6):
                env = dict(os.environ, OPENBLAS_CORETYPE="Prescott") if i % 2 else None
                c.start_worker(f"w{i}", extra=[f"--token={token}"], env=env)
                wait_for(lambda: len(c.status()["workers"]) == i + 1, 60, f"worker {i} to join")
            try:
                c.wait_done(timeout=600)
            except Exception:
                print(c.dump_logs())
                raise
            # The last audits settle within a heartbeat or two of the end.
            time.sleep(3)
            status = c.status()
            kernels = {w["blas"].rsplit("core ", 1)[-1] for w in status["workers"]}
            self.assertEqual(len(kernels), 2, kernels)  # Prescott and this CPU's
            audits = status["audits"]
            print(f"honest, kernels {sorted(kernels)}, {HONEST_STEPS} steps: {audits}", flush=True)
            self.assertGreater(int(audits.get("passed", 0)), 20, audits)
            for outcome in ("failed", "verifiers_caught", "disputes"):
                self.assertEqual(int(audits.get(outcome, 0)), 0, audits)
            kinds = [e["kind"] for e in c.status().get("events", [])]
            self.assertNotIn("audit_evicted", kinds)
            self.assertNotIn("audit_failed", kinds)

    def test_scaled_gradients_are_caught_by_recomputation(self):
        self.run_adversary("scale_outputs", ["--factor=1.05"])

    def test_gradients_times_ten_are_caught(self):
        """x10 is also what the cheap check sees (it makes the worker a
        suspect, audited at 10x f); the recomputation evicts it."""
        self.run_adversary("scale_outputs", ["--factor=10"])

    def test_a_skipped_layer_is_caught(self):
        """Stage 1 (layers 1 and 2) leaves out layer 1 (64 to 64) from its
        21st forward pass on, through a hook in its runtime: its messages
        and log are true to what it ran, so only the recomputation, with
        every layer of the weights it committed to, finds it out."""
        self.run_adversary("skip_layer", ["--layer=0"],
                           tamper_mark="tampering: leaving out layer 1")

    def test_skipped_updates_are_caught_by_an_update_audit(self):
        """From its 21st update on, stage 1 drops its gradients and
        publishes its weights unchanged as each next version. Its outputs
        stay true to the weights it holds and commits to, so output audits
        pass them; an update audit replays a step from the neighbours'
        logged messages on the weights and optimizer state before it and
        finds the weights after it are not what the update makes. The job
        rolls back to before its last passed update audit, not its last
        passed output audit."""
        self.run_adversary("skip_updates", tamper_mark="tampering: skipping every update",
                           caught_by="the update after step")

    def test_a_skipper_that_claims_weight_syncs_is_evicted_for_them(self):
        """As above, and at each update it skips it publishes its weights
        twice and counts the second as a weight sync, as if an outer step
        came between: its update audits are unverifiable, never failed,
        and no recomputation can catch it. Its job makes an outer step
        every 8 steps; the coordinator evicts it once far more of its
        update audits were unverifiable than that explains
        (UnverifiableUpdatesUnexplained)."""
        self.run_adversary("dodge_updates", tamper_mark="tampering: skipping every update",
                           caught_by="the update after step", confirmed=False)

    def test_a_liar_on_a_quarter_of_its_microbatches_is_caught(self):
        """It lies (x1.05) only on the microbatches it guesses go unchecked,
        one in four; the draw's key is the coordinator's, so an audit of
        it finds a lie one time in four, and it is evicted all the same."""
        self.run_adversary("scale_outputs", ["--factor=1.05", "--lie_every=4"])

    def test_noisy_gradients_are_caught(self):
        self.run_adversary("noise", ["--noise=0.01"])

    def test_flipped_gradients_are_caught(self):
        self.run_adversary("flip_gradients")

    def test_a_lying_verifier_is_outvoted_and_evicted(self):
        """Three pipelines and a standby; the hostile worker trains
        honestly on stage 1 but fails every audit it verifies. The second
        verifier passes it and the third (the standby, or the remaining
        pipeline) settles it: the liar is evicted, the worker it accused
        is not, and no honest worker is recorded as failing."""
        # The plan is made at the sixth join, the hostile worker's, so that
        # it holds a stage; the seventh is the standby. (A plan of all
        # seven leaves the slowest out, and the hostile worker may measure
        # slowest: a standby is asked to verify only when no pipeline can,
        # and never failed anything.)
        with PipelinesCluster(100000, 8, streaming=False, secure=True, workers=6) as c:
            with open(c.job, "a") as f:
                f.write(f"verification {{ fraction: {SPOT_CHECK_FRACTION} }}\n")
            c.start_coordinator()
            token = c.create_token("--uses=7", "--name=volunteers")
            for i in range(7):
                if i == 5:
                    hostile_worker(c, token, "--misbehave=lie_as_verifier")
                else:
                    c.start_worker(f"w{i}", extra=[f"--token={token}"])
                wait_for(lambda: len(c.status()["workers"]) == i + 1, 60, f"worker {i} to join")
            events_path = os.path.join(c.dir, "state", "events.log")

            def events():
                c.ctl("status")  # the log is written off the caller's thread
                with open(events_path) as f:
                    return [json.loads(line) for line in f if line.strip()]

            try:
                eviction = wait_for(
                    lambda: next((e for e in events() if e["kind"] == "audit_evicted"), None),
                    180, "an audit_evicted event", interval=0.5)
            except Exception:
                print(c.dump_logs())
                raise
            log = events()
            status = c.status()
            print(f"lying verifier: {eviction['worker']} evicted: {eviction['detail'][:300]}; "
                  f"audits {status['audits']}", flush=True)
            self.assertEqual(eviction["worker"], "hostile", eviction)
            self.assertIn("outvoted", eviction["detail"])
            self.assertEqual([e["worker"] for e in log if e["kind"] == "audit_evicted"],
                             ["hostile"])
            # A lying verifier computed nothing the job used: no rollback.
            self.assertNotIn("rolled_back", [e["kind"] for e in log])
            self.assertEqual(int(status["audits"].get("failed", 0)), 0, status["audits"])
            self.assertGreaterEqual(int(status["audits"]["verifiers_caught"]), 1)
            for w in status["workers"]:
                self.assertEqual(int(w.get("audits_failed", 0)), 0, w)

    def test_scaled_activations_of_stage_0_are_caught(self):
        self.run_adversary("scale_outputs", ["--factor=1.05"], position=4, stage=0)

    def test_two_pipelines_confirm_with_a_standby(self):
        """Two pipelines and a standby: the other pipeline's worker of the
        stage is the first verifier, the standby the second."""
        self.run_adversary("scale_outputs", ["--factor=1.05"], workers=5, position=3, plan_at=4)


END_STEPS = 1500


class AdversaryToTheEndTest(unittest.TestCase):
    """Two pipelines and a standby train END_STEPS steps with spot checks,
    twice: once all honest, once with pipeline 1's last stage flipping the
    sign of its gradients (the most damaging of the issue's adversaries: its
    pipeline climbs the loss while the other descends) from its 21st
    message until it is evicted and the standby takes its place. The
    adversary must be evicted within the stated 500 steps, the job rolled
    back to a step at or before its first lie (docs/verification.md,
    "Rollback"), and the job must train to its end with a validation loss
    within the issue's 2% of the clean run's. (Before the rollback, the
    adversary's run ended 19-27% above it.)"""

    def run_job(self, hostile):
        # The plan is made at the fourth join, the hostile worker's, so
        # that it holds pipeline 1's last stage (the planner leaves the
        # slowest of five out, and it may measure slowest); the fifth is
        # the standby.
        with PipelinesCluster(END_STEPS, 8, streaming=False, secure=True, workers=4) as c:
            with open(c.job) as f:
                job = f.read()
            # The validation loss over 800 images, not 32: a figure to
            # compare two runs by.
            job = job.replace("eval_batches: 2", "eval_batches: 50")
            with open(c.job, "w") as f:
                f.write(job + f"verification {{ fraction: {SPOT_CHECK_FRACTION} }}\n")
            c.start_coordinator()
            token = c.create_token("--uses=5", "--name=volunteers")
            for i in range(5):
                if hostile and i == 3:
                    # It lies from its first message. Honest first, it
                    # passed audits and the job trusted it to them; when the
                    # fifth join remade the plan late (a loaded machine),
                    # its count of honest messages began again, it passed
                    # audits past the first checkpoints, and the job rolled
                    # back to one of those. Restoring at a step other than
                    # the seed gives pipeline 1 pipeline 0's optimizer state,
                    # and that run ended 5.2% off the clean one
                    # (docs/verification.md, "Rollback").
                    hostile_worker(c, token, "--misbehave=flip_gradients", "--consistent_log",
                                   "--after=0")
                else:
                    c.start_worker(f"w{i}", extra=[f"--token={token}"])
                wait_for(lambda: len(c.status()["workers"]) == i + 1, 60, f"worker {i} to join")
            events_path = os.path.join(c.dir, "state", "events.log")

            def events():
                with open(events_path) as f:
                    return [json.loads(line) for line in f if line.strip()]

            # The committed step when the hostile worker started lying, as
            # an operator watching would see it.
            lying_at = None
            deadline = time.monotonic() + 600
            try:
                while True:
                    status = c.status()
                    if hostile and lying_at is None and "hostile: scaling" in next(
                            p for p in c.workers if p.name == "hostile").log():
                        lying_at = int(status["step"])
                    if status["state"] == "done":
                        break
                    for p in c.workers:  # the hostile one is revoked and may exit
                        if p.name != "hostile" and p.popen.poll() not in (None, 0):
                            raise RuntimeError(f"{p.name} exited with {p.popen.returncode}")
                    self.assertLess(time.monotonic(), deadline, "the job did not finish")
                    time.sleep(0.25)
            except Exception:
                print(c.dump_logs())
                raise
            evals = [m for m in c.evals() if int(m["step"]) == END_STEPS]
            self.assertTrue(evals, c.evals())
            val_loss = sum(float(m["val_loss"]) for m in evals) / len(evals)
            return val_loss, events(), lying_at

    def test_the_adversary_is_evicted_and_the_job_trains_to_its_end(self):
        clean_loss, clean_events, _ = self.run_job(hostile=False)
        self.assertNotIn("audit_evicted", [e["kind"] for e in clean_events])
        self.assertNotIn("rolled_back", [e["kind"] for e in clean_events])
        loss, events, lying_at = self.run_job(hostile=True)
        evictions = [e for e in events if e["kind"] == "audit_evicted"]
        self.assertEqual([e["worker"] for e in evictions], ["hostile"], evictions)
        self.assertIsNotNone(lying_at)
        # The rollback names the committed step it undid (when the
        # adversary was evicted) and the step it went back to.
        rollbacks = [e for e in events if e["kind"] == "rolled_back"]
        self.assertEqual(len(rollbacks), 1, rollbacks)
        # Every worker that held a stage through it discarded its weights.
        restores = {e["worker"] for e in events if e["kind"] == "rollback_restore"}
        self.assertGreaterEqual(len(restores), 3, restores)
        undone = re.search(r"from step (\d+) to step (\d+)", rollbacks[0]["detail"])
        self.assertIsNotNone(undone, rollbacks[0])
        evicted_at, back_to = int(undone.group(1)), int(undone.group(2))
        print(f"flip_gradients to the end: lying from step {lying_at}, evicted at step "
              f"{evicted_at} of {END_STEPS} and rolled back to step {back_to}; validation "
              f"loss {loss:.4f} against {clean_loss:.4f} clean "
              f"({100 * (loss / clean_loss - 1):+.2f}%)", flush=True)
        # The bound the docs state: evicted within 500 steps of its first
        # lie (about 5 s of this job; heartbeats, not steps, pace audits).
        self.assertLess(evicted_at - lying_at, 500)
        # Back to before its first lie: no audit of its could pass since.
        # (lying_at is the committed step polled after its log said so,
        # which may trail the step it lied in by one.)
        self.assertLessEqual(back_to, lying_at + 1)
        # And the lies' effect is gone: the issue's 2%.
        self.assertLess(abs(loss / clean_loss - 1), 0.02)


if __name__ == "__main__":
    unittest.main()
