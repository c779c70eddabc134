"""Bad input gets a clear error, a non-zero exit where it is fatal, and
loses nothing where it is not."""
import os
import subprocess
import tempfile
import time
import unittest

from cluster import Cluster, Process, binary, free_port, job_path, wait_for


def run(args, timeout=30):
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


class BadJobFileTest(unittest.TestCase):
    CASES = {
        "syntax.textproto": ('name: "x"\ngpt { context: }\n', "2:"),
        "unknown_field.textproto": ('name: "x"\nmodle { }\n', "modle"),
        "inconsistent.textproto": (
            'gpt { context: 8 d_model: 10 heads: 4 blocks: 1 }\ntext {}\nsteps: 3\n',
            "multiple of heads"),
        "no_steps.textproto": ('mlp { hidden: 8 }\nfashion_mnist {}\n', "steps"),
        # Absurd sizes are refused before anything is allocated or planned.
        "million_blocks.textproto": (
            'gpt { context: 8 d_model: 16 heads: 2 blocks: 1000000 }\ntext {}\nsteps: 3\n',
            "blocks at most"),
        "huge_microbatch.textproto": (
            'mlp { hidden: 8 }\nfashion_mnist {}\nsteps: 3\nmicrobatch_size: 1073741824\n',
            "microbatch_size at most"),
        "wide_activation.textproto": (
            'gpt { context: 4096 d_model: 4096 heads: 8 blocks: 1 }\ntext {}\nsteps: 3\n'
            'microbatch_size: 1024\n', "over 1 GiB"),
        "eval_batches.textproto": (
            'mlp { hidden: 8 }\nfashion_mnist {}\nsteps: 3\neval_batches: 2000000000\n',
            "eval_batches at most"),
        "outer_topk.textproto": (
            'mlp { hidden: 8 }\nfashion_mnist {}\nsteps: 3\nouter { codec: CODEC_TOPK }\n',
            "outer.codec CODEC_TOPK"),
        "outer_replicas.textproto": (
            'mlp { hidden: 8 }\nfashion_mnist {}\nsteps: 3\nschedule: SCHEDULE_ASYNC_STASH\n'
            'replicas: 2\nouter { }\n',
            "do not mix"),
        "outer_momentum.textproto": (
            'mlp { hidden: 8 }\nfashion_mnist {}\nsteps: 3\nouter { momentum: 1.5 }\n',
            "outer.momentum"),
    }

    def test_coordinator_names_file_and_problem(self):
        d = tempfile.mkdtemp(prefix="geotrain-badjob-")
        for name, (text, fragment) in self.CASES.items():
            path = os.path.join(d, name)
            with open(path, "w") as f:
                f.write(text)
            out = run([binary("geotrain-coordinator"), "--listen=127.0.0.1:0",
                       f"--job={path}", f"--state_dir={d}/state"])
            self.assertNotEqual(out.returncode, 0, name)
            self.assertIn(path, out.stderr, name)
            self.assertIn(fragment, out.stderr, name)

    def test_job_file_that_is_not_a_regular_file_or_too_big(self):
        start = time.monotonic()
        out = run([binary("geotrain-coordinator"), "--job=/dev/zero", "--listen=127.0.0.1:0",
                   f"--state_dir={tempfile.mkdtemp()}"])
        self.assertNotEqual(out.returncode, 0)
        self.assertIn("/dev/zero is not a regular file", out.stderr)
        self.assertNotIn("bad_alloc", out.stderr)
        big = os.path.join(tempfile.mkdtemp(), "big.textproto")
        with open(big, "w") as f:
            f.write("# " + "x" * (2 << 20) + "\n")
        out = run([binary("geotrain-coordinator"), f"--job={big}", "--listen=127.0.0.1:0",
                   f"--state_dir={tempfile.mkdtemp()}"])
        self.assertNotEqual(out.returncode, 0)
        self.assertIn("larger than", out.stderr)
        self.assertLess(time.monotonic() - start, 20)

    def test_missing_job_file(self):
        out = run([binary("geotrain-coordinator"), "--job=/nonexistent/j.textproto"])
        self.assertNotEqual(out.returncode, 0)
        self.assertIn("/nonexistent/j.textproto", out.stderr)

    def test_flag_override_that_breaks_the_job(self):
        out = run([binary("geotrain-coordinator"), "--listen=127.0.0.1:0",
                   f"--job={job_path('gpt-tiny.textproto')}", "--schedule=bogus",
                   f"--state_dir={tempfile.mkdtemp()}"])
        self.assertNotEqual(out.returncode, 0)
        self.assertIn("bogus", out.stderr)


class FlagRangeTest(unittest.TestCase):
    """Flags out of range are errors, not silently ignored or wrapped."""

    def test_out_of_range_flags_are_refused(self):
        # The coordinator's flag, and what its error must say.
        coordinator_cases = [
            ("--listen=127.0.0.1:99999", "--listen"),
            ("--steps=-5", "--steps"),
            ("--seed=-1", "--seed"),
            ("--min_workers=-2", "--min_workers"),
            ("--planner=fastest", "--planner"),
            ("--in_flight=33", "in_flight must be in [0, 32]"),
            ("--in_flight=-1", "in_flight must be in [0, 32]"),
            ("--update_every=0", "update_every must be > 0"),
            ("--max_stages=-1", "max_stages must be >= 0"),
            ("--max_stages=4097", "max_stages at most 4096"),
            ("--update_every=3", "must divide microbatches"),
            ("--straggler_patience=10ms", "--straggler_patience: at least 100ms"),
            ("--straggler_patience=-5s", "--straggler_patience: at least 100ms"),
        ]
        coordinator = [binary("geotrain-coordinator"),
                       f"--job={job_path('fmnist-mlp.textproto')}"]
        cases = [(coordinator + [flag], fragment) for flag, fragment in coordinator_cases] + [
            ([binary("geotrain-worker"), "--threads=-3", "--insecure"], "--threads"),
            ([binary("geotrain-worker"), "--checkpoint_upload_mbit=-5", "--insecure"],
             "--checkpoint_upload_mbit"),
            ([binary("geotrain-worker"), "--checkpoint_upload_mbit=nan", "--insecure"],
             "--checkpoint_upload_mbit"),
            ([binary("geotrain-worker"), "--listen=127.0.0.1:70000", "--insecure"], "--listen"),
            ([binary("geotrain-worker"), "--coordinator=nowhere", "--insecure"], "--coordinator"),
            # Issue 32: a half IPv6 literal was taken as HOST:PORT.
            ([binary("geotrain-worker"), "--coordinator=[::1", "--insecure"],
             "an IPv6 host is a whole address in brackets"),
            ([binary("geotrain-worker"), "--listen=[::1:7000", "--insecure"], "--listen"),
            ([binary("geotrain-ctl"), "status", "--coordinator=127.0.0.1:0", "--insecure"],
             "--coordinator"),
        ]
        for args, fragment in cases:
            out = run(args + [f"--state_dir={tempfile.mkdtemp()}"]
                      if "coordinator" in os.path.basename(args[0]) and "ctl" not in args[0]
                      else args)
            self.assertEqual(out.returncode, 2, (args, out.stderr))
            self.assertIn(fragment, out.stderr, args)


class UnknownFlagTest(unittest.TestCase):
    def test_every_binary_refuses_unknown_flags(self):
        for name in ("geotrain-coordinator", "geotrain-worker", "geotrain-ctl", "geotrain-linkem"):
            out = run([binary(name), "--no_such_flag=1"])
            self.assertNotEqual(out.returncode, 0, name)
            self.assertIn("no_such_flag", out.stderr, name)


class UnreachableCoordinatorTest(unittest.TestCase):
    def test_worker_retries_with_backoff_then_joins(self):
        port = free_port()
        d = tempfile.mkdtemp(prefix="geotrain-unreachable-")
        worker = Process([binary("geotrain-worker"), f"--coordinator=127.0.0.1:{port}",
                          "--listen=127.0.0.1:0", "--device=cpu", "--threads=1",
                          "--name=patient", "--insecure"], os.path.join(d, "worker.log"))
        coordinator = None
        try:
            wait_for(lambda: worker.log().count("cannot reach coordinator") >= 2, 30,
                     "two logged join attempts")
            self.assertIn(f"127.0.0.1:{port}", worker.log())
            self.assertIn("retrying in", worker.log())
            self.assertTrue(worker.alive())
            coordinator = Process([binary("geotrain-coordinator"), f"--listen=127.0.0.1:{port}",
                                   f"--job={job_path('fmnist-mlp.textproto')}",
                                   "--min_workers=2", f"--state_dir={d}/state", "--insecure"],
                                  os.path.join(d, "coordinator.log"))
            wait_for(lambda: "joined" in worker.log(), 30, "the worker to join")
        finally:
            worker.stop()
            if coordinator:
                coordinator.stop()

    def test_worker_gives_up_after_join_timeout(self):
        port = free_port()
        start = time.monotonic()
        out = run([binary("geotrain-worker"), f"--coordinator=127.0.0.1:{port}",
                   "--listen=127.0.0.1:0", "--device=cpu", "--join_timeout_s=2", "--insecure"],
                  timeout=60)
        self.assertNotEqual(out.returncode, 0)
        self.assertIn(f"cannot reach coordinator at 127.0.0.1:{port}", out.stderr)
        self.assertLess(time.monotonic() - start, 30)


class CtlTest(unittest.TestCase):
    def test_status_against_nothing_fails_within_deadline(self):
        port = free_port()
        start = time.monotonic()
        out = run([binary("geotrain-ctl"), "status", f"--coordinator=127.0.0.1:{port}",
                   "--timeout_ms=1500", "--insecure"])
        elapsed = time.monotonic() - start
        self.assertNotEqual(out.returncode, 0)
        self.assertIn(f"127.0.0.1:{port}", out.stderr)
        self.assertLess(elapsed, 1.5 + 3.0)

    def test_usage_error(self):
        out = run([binary("geotrain-ctl"), "frobnicate"])
        self.assertEqual(out.returncode, 2)
        self.assertIn("usage", out.stderr)


class DeviceTest(unittest.TestCase):
    def test_unknown_device_is_refused(self):
        out = run([binary("geotrain-worker"), "--device=tpu", "--coordinator=127.0.0.1:1",
                   "--insecure"])
        self.assertNotEqual(out.returncode, 0)
        self.assertIn("--device=tpu", out.stderr)


class RouteTest(unittest.TestCase):
    def test_malformed_route_is_refused(self):
        for spec in ("127.0.0.1:9000", "127.0.0.1:9000=nowhere", "a=b=c",
                     "127.0.0.1:1=127.0.0.1:2,127.0.0.1:1=127.0.0.1:3"):
            out = run([binary("geotrain-worker"), f"--route={spec}", "--coordinator=127.0.0.1:1"])
            self.assertEqual(out.returncode, 2, spec)
            self.assertIn("--route", out.stderr, spec)


if __name__ == "__main__":
    unittest.main(verbosity=2)
