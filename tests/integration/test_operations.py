"""Operating geotrain as a service: the standard gRPC health service on the
coordinator and on every worker (geotrain-ctl health, its C++ client), and
server reflection.

The job is a small GPT over 3 stages with a fourth worker as a standby, so
that a killed stage is taken over by a standby and its neighbours train
again after the re-plan.
"""
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.error
import urllib.parse
import urllib.request

from cluster import BIN_DIR, SOURCE_DIR, Cluster, Process, binary, wait_for

sys.path.insert(0, os.path.join(SOURCE_DIR, "deploy", "wan-lab"))
from wan_job import free_ports  # noqa: E402
from test_fault_tolerance import JOB as FAULT_JOB  # noqa: E402

# The fault-tolerance suite's job (a small GPT over 3 stages, a checkpoint
# every 5 steps), long enough never to end during a test.
JOB = FAULT_JOB % {"steps": 100000}


def job_in_new_dir(prefix, text):
    """A new work directory holding job.textproto with `text`: (dir, path)."""
    workdir = tempfile.mkdtemp(prefix=prefix)
    job = os.path.join(workdir, "job.textproto")
    with open(job, "w") as f:
        f.write(text)
    return workdir, job


def health(target, *flags):
    """geotrain-ctl health on `target`: (exit code, stdout + stderr)."""
    out = subprocess.run([binary("geotrain-ctl"), "health", f"--target={target}", "--insecure",
                          "--timeout_ms=2000", *flags], capture_output=True, text=True,
                         timeout=30, stdin=subprocess.DEVNULL)
    return out.returncode, out.stdout + out.stderr


class HealthWatch:
    """geotrain-ctl health --watch on `target`: every status the stream
    delivered, in order, with this process's monotonic time of arrival."""

    def __init__(self, target):
        self.changes = []
        self.process = subprocess.Popen(
            [binary("geotrain-ctl"), "health", f"--target={target}", "--insecure", "--watch"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            stdin=subprocess.DEVNULL)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.process.stdout:
            match = re.search(r": (SERVING|NOT_SERVING|UNKNOWN|SERVICE_UNKNOWN)$", line.strip())
            if match:
                self.changes.append((time.monotonic(), match.group(1)))

    def statuses(self):
        return [s for _, s in self.changes]

    def close(self):
        self.process.terminate()
        self.process.wait(timeout=10)


class HealthTest(unittest.TestCase):
    def test_transitions_follow_the_plan_and_the_links(self):
        """A worker is NOT_SERVING before a plan, SERVING while it trains,
        NOT_SERVING once a neighbour dies and until the re-plan, then
        SERVING again; the coordinator is SERVING once its state is
        recovered; both list their services through reflection."""
        workdir, job = job_in_new_dir("geotrain-health-", JOB)
        with Cluster(job, workdir=workdir) as c:
            c.start_coordinator()
            code, out = health(c.address)
            self.assertEqual(code, 0, out)
            self.assertIn("SERVING", out)
            code, out = health(c.address, "--service=geotrain.v1.Coordinator")
            self.assertEqual(code, 0, out)

            # Two of the three workers the job needs: no plan yet.
            for name in ("w0", "w1"):
                c.start_worker(name)
            addresses = wait_for(lambda: len(c.status()["workers"]) == 2 and {
                w["name"]: w["address"] for w in c.status()["workers"]}, 60, "two joined")
            for name, address in addresses.items():
                code, out = health(address)
                self.assertEqual(code, 1, f"{name} before a plan: {out}")
                self.assertIn("NOT_SERVING", out)
                code, out = health(address, "--live")
                self.assertEqual(code, 0, f"{name} --live: {out}")
            watches = {name: HealthWatch(address) for name, address in addresses.items()}
            try:
                c.start_worker("w2")
                wait_for(lambda: c.status()["state"] == "training" and c.status()["step"] > 3,
                         120, "training")
                c.start_worker("w3")  # the standby
                status = wait_for(lambda: len(c.status()["workers"]) == 4 and c.status(), 60,
                                  "the standby")
                stage_of = {w["name"]: w["stage"] for w in status["workers"]
                            if w.get("stage", -1) >= 0}
                self.assertEqual(sorted(stage_of.values()), [0, 1, 2], status["workers"])
                for name, address in {w["name"]: w["address"]
                                      for w in status["workers"]}.items():
                    code, out = health(address)
                    self.assertEqual(code, 0 if name in stage_of else 1, f"{name}: {out}")
                # Kill stage 1; its neighbours stop serving until the re-plan.
                middle = next(n for n, k in stage_of.items() if k == 1)
                neighbours = [n for n, k in stage_of.items() if k != 1 and n in watches]
                self.assertTrue(neighbours, stage_of)
                epoch = int(status["epoch"])
                for n in neighbours:
                    wait_for(lambda: watches[n].statuses()[-1:] == ["SERVING"], 30,
                             f"{n} SERVING on its watch")
                before_kill = {n: len(watches[n].statuses()) for n in neighbours}
                victim = next(p for p in c.workers if p.name == middle)
                victim.popen.kill()

                def served_again(n):
                    since = watches[n].statuses()[before_kill[n]:]
                    return "NOT_SERVING" in since and since[-1] == "SERVING"
                for n in neighbours:
                    wait_for(lambda: served_again(n), 90, f"{n} to stop serving and serve again")
                after = c.status()
                self.assertGreater(int(after["epoch"]), epoch)
                for n in neighbours:
                    seen = watches[n].statuses()
                    print(f"{n} (stage {stage_of[n]}) watched: {' -> '.join(seen)}", flush=True)
                    self.assertEqual(seen[0], "NOT_SERVING", seen)
                    self.assertIn("SERVING", seen)
                    # The worker says why at each change: it served again
                    # only under a newer plan than the one the kill ended.
                    log = next(p for p in c.workers if p.name == n).log()
                    lines = [l for l in log.splitlines() if "health: " in l]
                    print("  " + "\n  ".join(l.split("] ", 1)[-1] for l in lines), flush=True)
                    ended = [i for i, l in enumerate(lines)
                             if "NOT_SERVING" in l and f"epoch {epoch} ended" in l]
                    self.assertTrue(ended, lines)
                    later = [l for l in lines[ended[-1] + 1:] if "health: SERVING" in l]
                    self.assertTrue(later, lines)
                    served_epoch = int(re.search(r"plan epoch (\d+)", later[0]).group(1))
                    self.assertGreater(served_epoch, epoch, later[0])
            finally:
                for w in watches.values():
                    w.close()

    def test_reflection_lists_the_services(self):
        """Both daemons serve gRPC server reflection, and their health
        through PyPI's stock clients (grpcio-reflection,
        grpcio-health-checking) agrees with geotrain-ctl's."""
        workdir, job = job_in_new_dir("geotrain-reflect-", JOB)
        with Cluster(job, workdir=workdir) as c:
            c.start_coordinator()
            listed = reflection_services(c.address)
            for service in ("geotrain.v1.Coordinator", "geotrain.v1.Status", "geotrain.v1.Admin",
                            "grpc.health.v1.Health"):
                self.assertIn(service, listed)
            c.start_worker("w0")
            address = wait_for(lambda: c.status()["workers"] and
                               c.status()["workers"][0]["address"], 60, "w0")
            listed = reflection_services(address)
            for service in ("geotrain.v1.Stage", "grpc.health.v1.Health"):
                self.assertIn(service, listed)
            self.assertEqual(grpc_client("health", c.address), ["SERVING"])
            self.assertEqual(grpc_client("health", address), ["NOT_SERVING"])  # no plan
            self.assertEqual(grpc_client("health", address, "geotrain.v1.Stage"),
                             ["NOT_SERVING"])


class PrometheusTest(unittest.TestCase):
    def test_a_real_prometheus_scrapes_the_coordinator_and_every_worker(self):
        """Debian's prometheus server scrapes the coordinator and the 3
        workers of a live run; its HTTP API shows geotrain_job_step rising
        and each worker's per-link byte counters for every link it has."""
        workdir, job = job_in_new_dir("geotrain-prom-", JOB)
        # Port 0 everywhere (a port picked in advance may be taken by an
        # outgoing connection meanwhile); each daemon logs where it serves.
        web = f"127.0.0.1:{free_ports(1)[0]}"
        # Three stages, so two links: the network planner may leave one of
        # three equal CPU workers on this loaded machine as a standby (the
        # fresh run at 872c359 planned two stages), and this test is about
        # what Prometheus sees of every link, not about the plan.
        with Cluster(job, coordinator_flags=["--metrics_listen=127.0.0.1:0",
                                             "--planner=join-order"],
                     workdir=workdir) as c:
            c.start_coordinator()
            workers = [c.start_worker(f"w{k}", ["--metrics_listen=127.0.0.1:0"])
                       for k in range(3)]

            def served_at(process):
                if not process.alive():
                    raise RuntimeError(f"{process.name} exited:\n{process.log()[-2000:]}")
                match = re.search(r"metrics: http://(\S+)/metrics", process.log())
                return match and match.group(1)
            metrics = {"coordinator": wait_for(lambda: served_at(c.coordinator), 30,
                                               "the coordinator's metrics port")}
            for k, worker in enumerate(workers):
                metrics[f"w{k}"] = wait_for(lambda: served_at(worker), 60,
                                            f"w{k}'s metrics port")
            config = os.path.join(workdir, "prometheus.yml")
            with open(config, "w") as f:
                f.write("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
                        "scrape_configs:\n"
                        "  - job_name: geotrain-coordinator\n"
                        f"    static_configs: [{{targets: ['{metrics['coordinator']}']}}]\n"
                        "  - job_name: geotrain-worker\n"
                        "    static_configs: [{targets: [" +
                        ", ".join(f"'{metrics[f'w{k}']}'" for k in range(3)) + "]}]\n")
            server = Process(["prometheus", f"--config.file={config}",
                              f"--storage.tsdb.path={os.path.join(workdir, 'tsdb')}",
                              f"--web.listen-address={web}"],
                             os.path.join(workdir, "prometheus.log"), name="prometheus")
            try:
                def query(expression):
                    url = f"http://{web}/api/v1/query?" + urllib.parse.urlencode(
                        {"query": expression})
                    try:
                        with urllib.request.urlopen(url, timeout=5) as response:
                            body = json.load(response)
                    except OSError:
                        if not server.alive():
                            raise RuntimeError("prometheus exited:\n" + server.log()[-2000:])
                        return None
                    return body["data"]["result"] if body.get("status") == "success" else None

                def step():
                    for p in workers:
                        if not p.alive():
                            raise RuntimeError(f"{p.name} exited:\n{p.log()[-2000:]}")
                    result = query('geotrain_job_step{job="geotrain-coordinator"}')
                    return int(float(result[0]["value"][1])) if result else None
                first = wait_for(lambda: (step() or 0) > 0 and step(), 120,
                                 "prometheus to hold geotrain_job_step")
                later = wait_for(lambda: (step() or 0) > first + 2 and step(), 120,
                                 "geotrain_job_step to rise")
                print(f"prometheus: geotrain_job_step {first} -> {later}", flush=True)
                status = c.status()
                wanted = {(w["name"], l["peer"], l["direction"])
                          for w in status["workers"] for l in w["links"]}
                self.assertEqual(len(wanted), 4, status["workers"])  # 2 links x 2 directions

                def links_seen():
                    result = query('geotrain_link_sent_bytes_total{job="geotrain-worker",'
                                   'encoding="wire"}') or []
                    return {(r["metric"]["worker"], r["metric"]["peer"],
                             r["metric"]["direction"]) for r in result
                            if float(r["value"][1]) > 0}
                seen = wait_for(lambda: wanted <= links_seen() and links_seen(), 60,
                                "per-link byte counters for every link")
                print(f"prometheus: per-link wire byte counters for {len(seen)} link ends",
                      flush=True)
                for name in ("geotrain_link_received_bytes_total",
                             "geotrain_stage_compute_seconds_per_microbatch",
                             "geotrain_stage_bubble_ratio", "geotrain_link_rate_bytes_per_second",
                             "geotrain_link_codec_info", "geotrain_workers",
                             "geotrain_replans_total", "geotrain_failures_total",
                             "geotrain_job_samples_per_second", "geotrain_checkpoint_age_seconds"):
                    self.assertTrue(query(name), f"prometheus holds no {name}")
                up = query("up")
                self.assertEqual(len(up), 4, up)
                self.assertTrue(all(r["value"][1] == "1" for r in up), up)
            finally:
                server.stop()


# A short run with evaluations and a learning-rate schedule, so that every
# kind of curve has points that move.
CURVES_JOB = """
name: "curves-gpt"
gpt { context: 32 d_model: 64 heads: 4 blocks: 3 mlp_ratio: 4 }
text { paths: "/usr/share/games/fortunes" validation_fraction: 0.05 }
optimizer { kind: KIND_ADAMW lr: 0.002 weight_decay: 0.01 warmup_fraction: 0.2
            decay: DECAY_COSINE min_lr_fraction: 0.1 }
schedule: SCHEDULE_SYNC
steps: 40
microbatches: 4
microbatch_size: 16
seed: 3
min_workers: 3
max_stages: 3
eval_every: 10
eval_batches: 2
"""


class CurvesTest(unittest.TestCase):
    def test_tensorboard_reads_every_series_of_the_metrics_log(self):
        """--tensorboard_dir: the stock tensorboard package's
        EventAccumulator finds the training, evaluation, per-stage and
        per-link series, each with one point per step of the metrics log
        (the evaluations: one per evaluation line), and the training ones
        with the metrics log's values."""
        workdir, job = job_in_new_dir("geotrain-curves-", CURVES_JOB)
        logdir = os.path.join(workdir, "tensorboard")
        # Join order: the series checked below are a 3-stage plan's, and the
        # network planner may plan 2 stages of these 3 equal CPU workers
        # (it did in a fresh run: 2 stages and 2 link ends), as in the
        # Prometheus test above.
        with Cluster(job, coordinator_flags=[f"--tensorboard_dir={logdir}",
                                             "--planner=join-order"],
                     workdir=workdir) as c:
            c.train(3, timeout=600)
            c.coordinator.stop()  # everything written and closed
            steps, evals = c.steps(), c.evals()
        out = subprocess.run([test_python(), os.path.join(os.path.dirname(__file__),
                                                          "tensorboard_scalars.py"), logdir],
                             capture_output=True, text=True, timeout=120)
        self.assertEqual(out.returncode, 0, out.stderr[-2000:])
        series = json.loads(out.stdout)
        self.assertEqual([m["step"] for m in steps], list(range(1, 41)))
        self.assertEqual(len(evals), 4)
        logged = {"train/loss": [(m["step"], m["loss"]) for m in steps],
                  "train/samples_per_second": [(m["step"], m["samples_per_s"]) for m in steps],
                  "train/learning_rate": [(m["step"], m["lr"]) for m in steps],
                  "eval/loss": [(m["step"], m["val_loss"]) for m in evals]}
        for tag in sorted(series):
            print(f"{tag}: {len(series[tag])} points", flush=True)
        for tag, points in logged.items():
            got = series.get(tag, [])
            self.assertEqual([s for s, _ in got], [s for s, _ in points], tag)
            for (_, value), (_, figure) in zip(got, points):
                self.assertAlmostEqual(value, figure, delta=1e-5 * max(1.0, abs(figure)),
                                       msg=tag)  # a float32 of the logged figure
        # Every stage and every link of the 3-stage plan has its series, with
        # a point at every step of the metrics log.
        stage_tags = [f"stage{k}/{figure}" for k in range(3)
                      for figure in ("compute_seconds_per_microbatch", "bubble_fraction",
                                     "staleness_mean")]
        links = {tag.rsplit("/", 1)[0] for tag in series if tag.startswith("link/")}
        self.assertEqual(len(links), 4, links)  # 2 links x 2 directions
        link_tags = [f"{link}/{figure}" for link in links
                     for figure in ("goodput_bits_per_second", "compression_ratio")]
        self.assertEqual(set(series), set(logged) | set(stage_tags) | set(link_tags))
        for tag in stage_tags + link_tags:
            self.assertEqual([s for s, _ in series[tag]], list(range(1, 41)), tag)
        distinct = []
        for k in range(3):
            compute = [v for _, v in series[f"stage{k}/compute_seconds_per_microbatch"]]
            self.assertTrue(all(v > 0 for v in compute))
            distinct.append(len(set(compute)))
        # Written as heartbeats came during the run, not all at its end.
        print(f"distinct compute figures per stage: {distinct}", flush=True)
        self.assertGreater(max(distinct), 1)
        # The schedule: warm-up to the peak, cosine down to a tenth.
        lr = [v for _, v in series["train/learning_rate"]]
        self.assertAlmostEqual(max(lr), 0.002, delta=1e-6)
        self.assertAlmostEqual(lr[-1], 0.0002, delta=1e-6)
        self.assertLess(series["train/loss"][-1][1], series["train/loss"][0][1])


class StatusPageTest(unittest.TestCase):
    def test_headless_chromium_draws_a_live_run(self):
        """--http_listen with TLS on: the page loads in Debian's headless
        Chromium with a viewer token and draws one node per stage and a
        loss curve of more than one point from a live run; status.json and
        /metrics refuse requests without a valid viewer token."""
        import check_status_page_static as page_check
        browser = page_check.find_chromium(None)
        self.assertTrue(browser, "chromium not found (deploy/install-deps.sh installs it)")
        workdir, job = job_in_new_dir("geotrain-page-", JOB)
        with Cluster(job, coordinator_flags=["--http_listen=127.0.0.1:0"], workdir=workdir,
                     secure=True) as c:
            c.start_coordinator()
            match = wait_for(lambda: re.search(r"status page: (http://\S+/)", c.coordinator.log()),
                             30, "the status page's address")
            url = match.group(1)
            worker_token = c.create_token("--uses=4", "--name=page-workers")
            viewer = c.create_token("--role=viewer", "--name=page-viewer")
            for k in range(4):  # 3 stages and a standby
                c.start_worker(f"w{k}", extra=[f"--token={worker_token}"])
            status = wait_for(lambda: (lambda s: s if s["step"] >= 5 else None)(c.status()),
                              180, "5 steps")

            def get(path, token=None):
                request = urllib.request.Request(url.rstrip("/") + path)
                if token:
                    request.add_header("Authorization", f"Bearer {token}")
                try:
                    with urllib.request.urlopen(request, timeout=10) as response:
                        return response.status, response.read().decode()
                except urllib.error.HTTPError as e:
                    return e.code, e.read().decode()

            code, body = get("/")
            self.assertEqual(code, 200)
            self.assertIn("<!DOCTYPE html>", body)
            code, body = get("/status.json")
            self.assertEqual(code, 401, body)
            self.assertIn("viewer token", body)
            # Malformed; and a valid token of another role (unlimited uses,
            # so it is refused for its role, not for being used up).
            other_role = c.create_token("--name=page-not-a-viewer")
            for wrong in ("not-a-token", other_role):
                code, body = get("/status.json", wrong)
                self.assertEqual(code, 403, body)
            self.assertEqual(get("/metrics")[0], 401)
            code, body = get("/status.json", viewer)
            self.assertEqual(code, 200, body)
            view = json.loads(body)
            self.assertEqual(view["health"]["coordinator"], "SERVING")
            self.assertGreaterEqual(len(view["history"]["steps"]), 5)
            code, body = get("/metrics", viewer)
            self.assertEqual(code, 200)
            self.assertIn("geotrain_job_step", body)

            dom = page_check.Dom(page_check.chromium(browser, f"{url}#token={viewer}",
                                                     ["--dump-dom"]))
            stages = sorted({w["stage"] for w in c.status()["workers"] if w["stage"] >= 0})
            nodes = sorted(int(e["attrs"]["data-stage"]) for e in dom.by_class("stage"))
            loss_points = page_check.path_points(dom.by_id("loss-path"))
            throughput_points = page_check.path_points(dom.by_id("throughput-path"))
            workers_shown = [page_check.Dom.text(e) for e in dom.by_class("worker-row")]
            events_shown = len(dom.by_class("event"))
            print(f"status page {url}: stage nodes {nodes}, loss path {loss_points} points, "
                  f"throughput path {throughput_points} points, {len(workers_shown)} worker "
                  f"rows, {events_shown} events, health "
                  f"{page_check.Dom.text(dom.by_id('health'))}", flush=True)
            self.assertEqual(nodes, stages)
            self.assertEqual(len(nodes), 3)
            self.assertGreater(loss_points, 1)
            self.assertGreater(throughput_points, 1)
            self.assertEqual(len(workers_shown), 4)
            self.assertGreater(events_shown, 0)
            self.assertEqual(page_check.Dom.text(dom.by_id("health")), "SERVING")
            self.assertIn("hidden", dom.by_id("banner")["attrs"])  # no error shown
            screenshot = os.path.join(workdir, "status_page.png")
            page_check.chromium(browser, f"{url}#token={viewer}",
                                [f"--screenshot={screenshot}", "--window-size=1280,1400",
                                 "--hide-scrollbars"])
            self.assertGreater(os.path.getsize(screenshot), 10000)
            print(f"screenshot: {screenshot}", flush=True)


class WatchTest(unittest.TestCase):
    def test_redraws_on_a_terminal_and_prints_plain_blocks_in_a_pipe(self):
        """geotrain-ctl watch: in a pipe, one block per interval with no
        escape codes, until Ctrl-C (exit 0); on a terminal (a pty), each
        frame clears the screen first."""
        import pty
        import signal
        workdir, job = job_in_new_dir("geotrain-watch-", JOB)
        with Cluster(job, workdir=workdir) as c:
            c.start_coordinator()
            for k in range(3):
                c.start_worker(f"w{k}")
            wait_for(lambda: c.status()["step"] >= 2, 180, "2 steps")
            watch = [binary("geotrain-ctl"), "watch", f"--coordinator={c.address}", "--insecure"]
            started = time.monotonic()
            piped = subprocess.Popen(watch, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, stdin=subprocess.DEVNULL)
            time.sleep(4.5)
            piped.send_signal(signal.SIGINT)  # what Ctrl-C sends
            out, err = piped.communicate(timeout=10)
            took = time.monotonic() - started
            self.assertEqual(piped.returncode, 0, err)
            self.assertNotIn("\x1b", out)
            blocks = [b for b in out.split("\n\n") if b.startswith("geotrain watch ")]
            print(f"watch in a pipe: {len(blocks)} blocks in {took:.1f} s; the last:\n"
                  f"{out[out.rfind('geotrain watch '):]}", flush=True)
            self.assertGreaterEqual(len(blocks), 3)
            self.assertLessEqual(len(blocks), 6)
            last = out[out.rfind("geotrain watch "):]
            # Every stage of the plan has its row, and a worker the planner
            # left out its standby row. How many stages three workers get is
            # the planner's choice from what it measured, not this test's.
            workers = c.status()["workers"]
            stages = sorted({w["stage"] for w in workers if w["stage"] >= 0})
            self.assertGreaterEqual(len(stages), 2, workers)
            for stage in stages:
                self.assertRegex(last, rf"\n{stage} +\[\d+,\d+\) +w\d +training")
            for w in workers:
                if w["state"] == "WORKER_STATE_STANDBY":
                    self.assertRegex(last, rf"\n- +- +{w['name']} +standby")
            self.assertIn("downstream", last)
            self.assertIn("last events:", last)
            steps = [int(m) for m in re.findall(r"step (\d+)/", out)]
            self.assertGreater(steps[-1], steps[0])  # it is live, not one snapshot

            # A terminal: --frames ends it; each frame starts by clearing.
            leader, follower = pty.openpty()
            tty = subprocess.Popen(watch + ["--frames=2", "--interval=200ms"], stdout=follower,
                                   stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
            os.close(follower)
            screen = b""
            while True:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:  # the pty closed: the process ended
                    break
                if not chunk:
                    break
                screen += chunk
            os.close(leader)
            self.assertEqual(tty.wait(timeout=10), 0)
            self.assertEqual(screen.count(b"\x1b[H\x1b[2J"), 2, screen[:200])
            self.assertIn(b"(Ctrl-C to stop)", screen)

            # An unreachable coordinator: a clear error each frame, not a crash.
            out = subprocess.run([binary("geotrain-ctl"), "watch", "--coordinator=127.0.0.1:1",
                                  "--insecure", "--frames=2", "--interval=100ms",
                                  "--timeout_ms=500"], capture_output=True, text=True, timeout=30,
                                 stdin=subprocess.DEVNULL)
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertEqual(out.stdout.count("status at 127.0.0.1:1 failed"), 2, out.stdout)


def test_python():
    """The test tools' venv (deploy/install-test-tools.sh), made on first use."""
    venv = os.path.join(os.path.dirname(BIN_DIR), "test-venv")
    out = subprocess.run([os.path.join(SOURCE_DIR, "deploy", "install-test-tools.sh"), venv],
                         capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"deploy/install-test-tools.sh failed:\n{out.stderr[-2000:]}")
    return out.stdout.strip().splitlines()[-1]


def grpc_client(*args):
    """tests/integration/grpc_client.py ARGS under the test tools' venv."""
    out = subprocess.run([test_python(), os.path.join(os.path.dirname(__file__), "grpc_client.py"),
                          *args], capture_output=True, text=True, timeout=60,
                         stdin=subprocess.DEVNULL)
    if out.returncode != 0:
        raise AssertionError(f"grpc_client.py {' '.join(args)} failed:\n{out.stderr[-2000:]}")
    return out.stdout.split()


def reflection_services(target):
    return grpc_client("reflection", target)


if __name__ == "__main__":
    unittest.main(verbosity=2)
