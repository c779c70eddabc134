"""TLS on (the default): join tokens, worker certificates, revocation.

A worker with a valid token joins and trains; one with no token, a wrong,
expired, revoked, used-up or viewer token, or a token made for another CA is
refused with UNAUTHENTICATED or PERMISSION_DENIED and a message that says
which; a revoked worker is out within one lease and cannot come back; tokens
and worker identities survive a coordinator restart."""
import os
import re
import subprocess
import time
import unittest

from cluster import Cluster, binary, job_path, wait_for

LEASE_S = 5.0  # the fmnist-mlp job's lease_ms


def refused_join(c, token, name, extra=()):
    """Runs a worker that must fail to join; returns its output."""
    args = [binary("geotrain-worker"), f"--coordinator={c.address}", "--listen=127.0.0.1:0",
            "--device=cpu", "--threads=1", f"--name={name}", "--join_timeout_s=10",
            *([f"--token={token}"] if token is not None else []), *extra]
    out = subprocess.run(args, capture_output=True, text=True, timeout=60,
                         stdin=subprocess.DEVNULL)
    return out


class TokenTest(unittest.TestCase):
    def test_tokens_admit_and_refuse(self):
        with Cluster(job_path("fmnist-mlp.textproto"), ["--min_workers=2", "--steps=100000"],
                     secure=True) as c:
            c.start_coordinator()
            token = c.create_token("--uses=2", "--name=pair", "--ttl=1h")
            self.assertRegex(token, r"^gt1\.[a-z0-9]{6}\.[a-z0-9]{32}\.[0-9a-f]{64}$")
            for i in range(2):
                c.start_worker(f"w{i}", extra=[f"--token={token}"])
            wait_for(lambda: c.status()["step"] >= 3, 120, "training with TLS")
            status = c.status()
            self.assertTrue(status["security"].startswith("tls, CA sha256:"), status["security"])
            token_id = token.split(".")[1]
            self.assertEqual({w["token_id"] for w in status["workers"]}, {token_id})

            listed = c.ctl("token", "list")
            self.assertEqual(listed.returncode, 0, listed.stderr)
            row = next(line for line in listed.stdout.splitlines() if line.startswith(token_id))
            self.assertIn("pair", row)
            self.assertIn("used up", row)
            self.assertIn("w0,w1", row)

            id_, secret, fingerprint = token.split(".")[1:]
            cases = {
                "no token": (None, "UNAUTHENTICATED", "no credential"),
                "used up": (token, "PERMISSION_DENIED", "used up"),
                "wrong secret": (f"gt1.{id_}.{'a' * 32}.{fingerprint}", "UNAUTHENTICATED",
                                 "wrong secret"),
                "unknown id": (f"gt1.zzzzzz.{secret}.{fingerprint}", "UNAUTHENTICATED",
                               "not known"),
                "another CA": (f"gt1.{id_}.{secret}.{'0' * 64}", "UNAUTHENTICATED",
                               "presents no CA with fingerprint"),
                "malformed": ("hello", "INVALID_ARGUMENT", "not a geotrain join token"),
            }
            expiring = c.create_token("--ttl=1s", "--name=short")
            revoked = c.create_token("--name=gone")
            out = c.ctl("token", "revoke", revoked.split(".")[1])
            self.assertEqual(out.returncode, 0, out.stderr)
            viewer = c.create_token("--role=viewer", "--name=watch")
            time.sleep(1.5)
            cases["expired"] = (expiring, "PERMISSION_DENIED", "expired")
            cases["revoked"] = (revoked, "PERMISSION_DENIED", "was revoked")
            cases["viewer token"] = (viewer, "PERMISSION_DENIED", "viewer token")
            for what, (text, code, fragment) in cases.items():
                out = refused_join(c, text, f"bad-{what.replace(' ', '-')}")
                self.assertNotEqual(out.returncode, 0, what)
                self.assertIn(code, out.stderr, f"{what}: {out.stderr[-800:]}")
                self.assertIn(fragment, out.stderr, f"{what}: {out.stderr[-800:]}")

            # Status needs a credential; a viewer token is enough, and only for status.
            anonymous = c.ctl("status", credentials=[])
            self.assertNotEqual(anonymous.returncode, 0)
            self.assertIn("no credential", anonymous.stderr)
            watched = c.ctl("status", "--brief", credentials=[f"--token={viewer}"])
            self.assertEqual(watched.returncode, 0, watched.stderr)
            self.assertIn("training", watched.stdout)
            denied = c.ctl("token", "create", credentials=[f"--token={viewer}"])
            self.assertNotEqual(denied.returncode, 0)
            self.assertRegex(denied.stderr, "admin credential")
            # Training went on through all of it.
            before = c.status()["step"]
            wait_for(lambda: c.status()["step"] > before, 60, "more steps")


class RevocationTest(unittest.TestCase):
    def test_revoked_worker_is_out_within_a_lease_and_cannot_reconnect(self):
        # Join order: the victim holds stage 1 of a pipeline of 3.
        with Cluster(job_path("fmnist-mlp.textproto"),
                     ["--min_workers=2", "--steps=100000", "--planner=join-order"],
                     secure=True) as c:
            c.start_coordinator()
            token = c.create_token("--uses=3", "--name=trio")
            state = {i: os.path.join(c.dir, f"w{i}-state") for i in range(3)}
            for i in range(3):
                c.start_worker(f"w{i}", extra=[f"--token={token}", f"--state_dir={state[i]}"])
            wait_for(lambda: c.status()["step"] >= 3, 120, "training")
            status = c.status()
            victim = next(w for w in status["workers"] if w["stage"] == 1)
            process = c.workers[int(victim["name"][1:])]
            self.assertTrue(os.path.exists(os.path.join(state[int(victim["name"][1:])],
                                                        "worker.credential")))
            revoked_at = time.monotonic()
            out = c.ctl("worker", "revoke", victim["id"])
            self.assertEqual(out.returncode, 0, out.stderr)

            def out_of_plan():
                w = next(w for w in c.status()["workers"] if w["id"] == victim["id"])
                return w["stage"] == -1 and w["state"] != "WORKER_STATE_TRAINING"
            wait_for(out_of_plan, LEASE_S, "the revoked worker out of the plan")
            wait_for(lambda: not process.alive(), LEASE_S + 10, "the revoked worker to exit")
            self.assertNotEqual(process.popen.returncode, 0)
            self.assertIn("PERMISSION_DENIED", process.log())
            self.assertLess(time.monotonic() - revoked_at, LEASE_S + 10)
            # The standby took over: training goes on.
            step = c.status()["step"]
            wait_for(lambda: c.status()["step"] > step + 2, 120, "training after the revoke")

            # Started again with its kept certificate, it is refused.
            again = refused_join(c, None, "again",
                                 [f"--state_dir={state[int(victim['name'][1:])]}"])
            self.assertNotEqual(again.returncode, 0)
            self.assertIn("PERMISSION_DENIED", again.stderr)
            self.assertIn(f"worker {victim['id']} was revoked", again.stderr)

    def test_tokens_and_identities_survive_a_restart(self):
        with Cluster(job_path("fmnist-mlp.textproto"), ["--min_workers=1", "--steps=100000"],
                     secure=True) as c:
            c.start_coordinator()
            token = c.create_token("--uses=1", "--name=once")
            kept = os.path.join(c.dir, "w0-state")
            c.start_worker("w0", extra=[f"--token={token}", f"--state_dir={kept}"])
            wait_for(lambda: c.status()["step"] >= 2, 120, "training")
            first_id = c.status()["workers"][0]["id"]
            c.workers[0].stop()
            c.coordinator.stop()
            c.start_coordinator(port=c.port)
            listed = c.ctl("token", "list")
            self.assertEqual(listed.returncode, 0, listed.stderr)
            self.assertRegex(listed.stdout, rf"{token.split('.')[1]}\s+once\s+worker\s+0\b")
            # No token this time: the kept certificate says who it is.
            step = c.status()["step"]
            again = c.start_worker("w0-again", extra=[f"--state_dir={kept}"])
            wait_for(lambda: f"rejoining as {first_id}" in again.log(), 30, "a rejoin by certificate")
            wait_for(lambda: f"joined {c.address} as {first_id}" in again.log(), 30,
                     "the join as the same worker")
            wait_for(lambda: c.status()["step"] > step + 1, 120, "training by the same worker")
            self.assertEqual([w["id"] for w in c.status()["workers"]], [first_id])


class TokenRevocationTest(unittest.TestCase):
    def test_revoking_a_token_revokes_its_workers(self):
        """Issue 32: revoking a token left every identity enrolled with it
        working (status, plan, rendezvous). By default they go with it."""
        with Cluster(job_path("fmnist-mlp.textproto"), ["--min_workers=2", "--steps=100000"],
                     secure=True) as c:
            c.start_coordinator()
            leaked = c.create_token("--uses=2", "--name=leaked")
            kept = c.create_token("--uses=1", "--name=kept")
            c.start_worker("w0", extra=[f"--token={leaked}"])
            c.start_worker("w1", extra=[f"--token={leaked}"])
            c.start_worker("w2", extra=[f"--token={kept}"])
            wait_for(lambda: c.status()["step"] >= 3, 120, "training")
            ids = {w["name"]: w["id"] for w in c.status()["workers"]}
            out = c.ctl("token", "revoke", leaked.split(".")[1])
            self.assertEqual(out.returncode, 0, out.stderr)
            listed = re.search(r"and the workers enrolled with it: (\S+)", out.stdout)
            self.assertTrue(listed, out.stdout)
            self.assertEqual(set(listed.group(1).split(",")), {ids["w0"], ids["w1"]})
            for name in ("w0", "w1"):
                process = next(p for p in c.workers if p.name == name)
                wait_for(lambda: not process.alive(), 2 * LEASE_S + 10, f"{name} to exit")
                self.assertIn("was revoked", process.log())
            status = c.status()
            self.assertTrue(all(w["stage"] == -1 for w in status["workers"]
                                if w["id"] in (ids["w0"], ids["w1"])))


class RelayRoleTest(unittest.TestCase):
    def test_only_a_relay_token_makes_a_relay_and_nothing_else(self):
        """Issue 32: any token holder could join as a relay and then drop or
        stall every link routed through it."""
        with Cluster(job_path("fmnist-mlp.textproto"), ["--min_workers=2", "--steps=100000"],
                     secure=True) as c:
            c.start_coordinator()
            worker_token = c.create_token("--name=volunteer")
            relay_token = c.create_token("--role=relay", "--name=relay")
            listed = c.ctl("token", "list")
            self.assertRegex(listed.stdout, rf"{relay_token.split('.')[1]}\s+relay\s+relay\b")
            out = subprocess.run(
                [binary("geotrain-relay"), f"--coordinator={c.address}",
                 "--listen=127.0.0.1:0", "--name=fake-relay", f"--token={worker_token}",
                 "--join_timeout_s=10"],
                capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
            self.assertNotEqual(out.returncode, 0)
            self.assertIn("PERMISSION_DENIED", out.stderr)
            self.assertIn("a relay needs a relay token", out.stderr)
            out = refused_join(c, relay_token, "relay-as-worker")
            self.assertNotEqual(out.returncode, 0)
            self.assertIn("may join only as a relay", out.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
