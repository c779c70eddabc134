"""Compressed activations and gradients on real links: wire bytes per
sample of the demo job under each codec, against none."""
import os
import re
import sys
import tempfile
import time
import unittest

from cluster import BIN_DIR, SOURCE_DIR, Cluster, Process, binary, job_path, wait_for

sys.path.insert(0, os.path.join(SOURCE_DIR, "deploy", "wan-lab"))
import wan_job  # noqa: E402

# Wide activations, little compute: link-bound on a 100 Mb/s link.
LINK_BOUND_JOB = """
name: "adaptive-mlp"
mlp { hidden: 512 hidden: 512 hidden: 512 }
fashion_mnist { dir: "/usr/share/datasets/fashion-mnist" }
optimizer { kind: KIND_ADAMW lr: 0.0005 }
schedule: SCHEDULE_ASYNC_STASH
steps: 100000
microbatches: 4
microbatch_size: 256
in_flight: 16
min_workers: 3
eval_every: 0
eval_batches: 1
activation_codec: CODEC_INT4
gradient_codec: CODEC_INT4
adaptive: true
"""


def wire_bytes(test, codec):
    # Join order: 3 stages, 4 link ends, each with the job's codec (the
    # network planner may use fewer stages and weaker codecs).
    with Cluster(job_path("gpt-tiny.textproto"),
                 ["--steps=6", "--planner=join-order", f"--activation_codec={codec}",
                  f"--gradient_codec={codec}"]) as c:
        status = c.train(3, timeout=300).status()
        sent = raw = 0
        for w in status["workers"]:
            for link in w["links"]:
                test.assertEqual(link["codec"], codec)
                test.assertIn(link["direction"], ("upstream", "downstream"))
                test.assertTrue(link["peer"].startswith("127.0.0.1:"))
                sent += int(link["bytes_sent"])
                raw += int(link["raw_bytes_sent"])
                test.assertGreater(link["goodput_bps"], 0)
        test.assertEqual(len([l for w in status["workers"] for l in w["links"]]), 4)
        samples = int(status["samples"])
        return sent / samples, raw / samples, status["loss"]


class CodecWireTest(unittest.TestCase):
    def test_wire_bytes_per_sample(self):
        results = {codec: wire_bytes(self, codec) for codec in ("none", "fp16", "int8", "int4")}
        none = results["none"][0]
        for codec, (sent, raw, loss) in results.items():
            print(f"{codec:5s}: {sent:10.0f} wire bytes/sample ({sent / none:.3f}x of none), "
                  f"raw {raw:.0f}, loss after 6 steps {loss:.3f}")
        self.assertLessEqual(results["fp16"][0] / none, 0.51)
        self.assertLessEqual(results["int8"][0] / none, 0.27)
        self.assertLess(results["int4"][0], results["int8"][0])
        for codec in ("fp16", "int8", "int4"):  # it still trains
            self.assertLess(results[codec][2], 5.0)

    # That int8 trains like none over a whole run is checked in
    # test_convergence.py, beside the sync run it compares with.


class AdaptiveCodecTest(unittest.TestCase):
    def test_link_bound_links_step_up_and_say_why(self):
        workdir = tempfile.mkdtemp(prefix="geotrain-adaptive-")
        job_file = os.path.join(workdir, "job.textproto")
        with open(job_file, "w") as f:
            f.write(LINK_BOUND_JOB)
        # Join order: 3 stages, 4 link ends, as the assertions need. The
        # network planner may run this MLP on two stages, with a spare, when
        # one worker's layer timings at join come out slow.
        with wan_job.WanJob(job_file, 3, ["--delay_ms=5", "--rate_mbit=100"],
                            coordinator_flags=["--planner=join-order"], bin_dir=BIN_DIR,
                            workdir=workdir) as job:
            job.start()

            def stepped_up():
                status = job.status()
                links = [l for w in (status or {}).get("workers", []) for l in w.get("links", [])]
                stronger = [l for l in links if l["codec"] != "none"]
                return links if len(links) == 4 and len(stronger) >= 2 else None

            try:
                links = wait_for(stepped_up, 180, "links to leave codec none", interval=1)
            except TimeoutError:
                print(job.status())
                raise
        for link in links:
            print(f"{link['direction']:>10} {link['codec']:>5}, measured "
                  f"{link.get('link_rate_bps', 0) / 1e6:.1f} Mb/s: {link['codec_reason']}")
            self.assertTrue(link["adaptive"])
            self.assertIn("codec_reason", link)
        stepped = [l for l in links if l["codec"] != "none"]
        for link in stepped:
            self.assertIn(link["codec"], ("fp16", "int8", "int4"))
            # The peer measured the relay's rate (100 Mb/s) within 25%.
            self.assertLess(abs(link["link_rate_bps"] / 100e6 - 1), 0.25, link)
        self.assertTrue(any("link-bound" in l["codec_reason"] for l in links))

    def test_compute_bound_links_stay_uncompressed(self):
        # Join order: adaptive codecs are its per-link choice, on 3 stages.
        with Cluster(job_path("gpt-tiny.textproto"),
                     ["--steps=20", "--planner=join-order", "--adaptive",
                      "--activation_codec=int4", "--gradient_codec=int4"]) as c:
            status = c.train(3, timeout=300).status()
        links = [l for w in status["workers"] for l in w["links"]]
        self.assertEqual(len(links), 4)
        for link in links:
            self.assertTrue(link["adaptive"])
            self.assertEqual(link["codec"], "none", link)
            self.assertIn("compute-bound", link["codec_reason"])


class PlannedCodecTest(unittest.TestCase):
    """In this suite because it runs alone (RUN_SERIAL): the plan it needs
    (3 stages over 2) follows from layer timings measured at join, which
    other suites' processes on the same 2 cores distort (a CI-like run beside
    them got a 2-stage plan on the fast pair, with no slow link to compress).
    """

    def _train_with_a_slow_link(self, job_file):
        """Trains the job on w0, w1 and w2 (w2 behind relays) until every
        planned link carried messages: (status, links, plan --explain,
        ports), or None when fewer than 3 stages were planned."""
        # Workers' and relays' ports all distinct (3 + 4 relays): ports
        # taken one at a time may come back twice.
        spare_ports = wan_job.free_ports(3 + 4)
        ports = {f"w{i}": spare_ports.pop() for i in range(3)}
        relays = {}
        with Cluster(job_file,
                     ["--steps=100000", "--planner=network", "--min_workers=3",
                      "--activation_codec=int8", "--gradient_codec=int8"]) as c:
            for a in ports:
                for b in ports:
                    if a != b and "w2" in (a, b):
                        relays[(a, b)] = spare_ports.pop()
                        c.workers.append(Process(
                            [binary("geotrain-linkem"), f"--listen=127.0.0.1:{relays[(a, b)]}",
                             f"--target=127.0.0.1:{ports[b]}", "--delay_ms=5",
                             "--rate_mbit=30"],
                            os.path.join(c.dir, f"relay-{a}-{b}.log")))
            c.start_coordinator()

            def links_with_codecs():
                status = c.status()
                if status["state"] != "training":
                    return None
                links = [(w["name"], l) for w in status["workers"] for l in w.get("links", [])
                         if int(l.get("messages_sent", 0)) > 0]
                if len({w["stage"] for w in status["workers"] if w["stage"] >= 0}) < 3:
                    return "fewer stages"
                return (status, links) if len(links) >= 4 else None

            try:
                for name, port in ports.items():
                    routes = ",".join(f"127.0.0.1:{ports[b]}=127.0.0.1:{relays[(name, b)]}"
                                      for b in ports if (name, b) in relays)
                    worker = c.start_worker(name,
                                            [f"--listen=127.0.0.1:{port}", f"--route={routes}"])
                    # One at a time: layer timings taken by three workers at
                    # once on 2 cores measure contention (a run timed blocks
                    # from 2.3 to 4.0 ms and the planner rightly chose 2
                    # stages). A liveness bound, generous for a loaded CI
                    # machine (one CI run took over 60 s for w2).
                    def timed(worker=worker, name=name):
                        if not worker.alive():
                            raise RuntimeError(f"{name} exited with {worker.popen.returncode}")
                        return "layer timings per sample" in worker.log()
                    wait_for(timed, 120, f"{name}'s layer timings")
                trained = wait_for(links_with_codecs, 120, "training on all links")
            except Exception:
                print(c.dump_logs())
                raise
            if trained == "fewer stages":
                print(c.ctl("plan", "--explain").stdout)
                return None
            status, links = trained
            out = c.ctl("plan", "--explain")
        return status, links, out, ports

    def test_network_planner_compresses_only_the_slow_links(self):
        # w2 reaches and is reached through geotrain-linkem at 30 Mb/s (a
        # relay per ordered pair, by --route, probes included); w0 <-> w1 is
        # plain loopback. Any 3-stage order has one fast and one slow link:
        # with int8 allowed, the plan compresses the slow one only. The demo
        # GPT with 9 blocks (11 layers) so that 3 stages beat 2 clearly
        # whatever the machine's speed: sync's objective is (M + p - 1) T*,
        # 6 x 3 blocks against 5 x 5 blocks (0.72x) where the stages set
        # the pace. With 7 blocks it was 6 x 3 against 5 x 4 (0.9x) before
        # the RTTs, and at 20 Mb/s int8's 53 ms per microbatch exceeded the
        # 3 blocks' compute on a fast day: the planner rightly chose 2
        # stages. At 40 Mb/s int8 took about 27 ms per microbatch, raw
        # about 105 ms, against 44 ms for 3 blocks at 0.9 ms per sample; but
        # in a fresh-clone run the machine timed 3 blocks at 126 ms, past
        # raw's 102 ms, and the plan rightly kept the slow link raw. At 30
        # Mb/s (raw about 140 ms, int8 about 37 ms) both of those days fall
        # between the two.
        with open(job_path("gpt-tiny.textproto")) as f:
            job = f.read().replace("blocks: 4", "blocks: 9")
        self.assertIn("blocks: 9", job)
        job_file = os.path.join(tempfile.mkdtemp(prefix="geotrain-codecs-"), "gpt-9.textproto")
        with open(job_file, "w") as f:
            f.write(job)
        # A worker timed while another's probes hit its core (2 cores, three
        # workers) can read twice as slow as it is (5.7 ms a block against
        # 2.5 in a fresh-clone run), and the planner then rightly leaves it
        # out: 2 stages, and no fast link to check. Such a plan is tried
        # once more with fresh processes; the checks below are unchanged.
        for attempt in range(2):
            planned = self._train_with_a_slow_link(job_file)
            if planned is not None:
                break
            print(f"attempt {attempt + 1}: planned fewer than 3 stages; again", flush=True)
        self.assertIsNotNone(planned, "fewer than 3 stages planned twice")
        status, links, out, ports = planned
        print(out.stdout)
        stages = sorted((w["stage"], w["name"]) for w in status["workers"] if w["stage"] >= 0)
        self.assertEqual(len(stages), 3, stages)
        # The plan's own figures: T* and, per stage with a link downstream,
        # that link's time per microbatch at the codec it chose.
        t_star = float(re.search(r"T\* ([\d.]+) ms per microbatch", out.stdout).group(1))
        planned_link_ms = {
            m.group(1): float(m.group(2))
            for m in re.finditer(r"stage \d+\s+layers \[\d+,\d+\)\s+(w\d)\s+compute\s+"
                                 r"[\d.]+ ms\s+link\s+([\d.]+) ms", out.stdout)}
        address_of = {f"127.0.0.1:{port}": name for name, port in ports.items()}
        for name, link in links:
            peer = address_of.get(link["peer"], link["peer"])
            slow = "w2" in (name, peer)
            print(f"{name} -> {peer} ({link['direction']}): {link['codec']}, "
                  f"{link['codec_reason']}")
            if slow and link["codec"] == "none":
                # Raw is right only where the stages' compute, not this
                # link, sets the pace: a machine running several times
                # slower than usual (a fresh-clone run timed 2 blocks at
                # 238 ms a microbatch against raw's 140 ms at 30 Mb/s).
                upstream_end = name if link["direction"] == "downstream" else peer
                self.assertLessEqual(planned_link_ms[upstream_end], t_star, (name, link))
                print(f"  raw: {planned_link_ms[upstream_end]:.1f} ms against T* "
                      f"{t_star:.1f} ms (compute-bound on this machine today)")
            elif not slow:
                self.assertEqual(link["codec"], "none", (name, link))
            self.assertEqual(link["codec_reason"], "chosen by the plan for this link")


if __name__ == "__main__":
    unittest.main(verbosity=2)
