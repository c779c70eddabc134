"""Starts real geotrain processes on loopback for integration tests.

Every process is started in its own session and killed (SIGKILL after a
grace period) when the Cluster closes, whatever the test did. Waits poll a
condition with a deadline; nothing sleeps for a fixed time.
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

SOURCE_DIR = os.environ.get(
    "GEOTRAIN_SOURCE_DIR",
    os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
BIN_DIR = os.environ.get("GEOTRAIN_BIN_DIR", os.path.join(SOURCE_DIR, "build", "bin"))
# The coordinator and geotrain-ctl link no LibTorch, so a tree built against
# another LibTorch (tests/run.sh's wheel tree) may take them from this one.
COORDINATOR_BIN_DIR = os.environ.get("GEOTRAIN_COORDINATOR_BIN_DIR", BIN_DIR)


def binary(name):
    if name in ("geotrain-coordinator", "geotrain-ctl"):
        return os.path.join(COORDINATOR_BIN_DIR, name)
    return os.path.join(BIN_DIR, name)


def job_path(name):
    return os.path.join(SOURCE_DIR, "deploy", "jobs", name)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(condition, timeout, what, interval=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


class Process:
    def __init__(self, args, log_path, env=None, name=None):
        self.args = args
        self.name = name or os.path.basename(args[0])
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.popen = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True,
                                      env=None if env is None else {**os.environ, **env})

    def log(self):
        with open(self.log_path, "r", errors="replace") as f:
            return f.read()

    def alive(self):
        return self.popen.poll() is None

    def stop(self, sig=signal.SIGTERM, grace=5.0):
        if self.alive():
            try:
                self.popen.send_signal(sig)
                self.popen.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self._log.close()


class Cluster:
    """A coordinator on 127.0.0.1:<port 0> and any number of workers."""

    def __init__(self, job, coordinator_flags=(), workdir=None, secure=False):
        """`secure`: TLS, tokens and certificates (the default of the
        daemons); otherwise every process runs --insecure, as the suites
        that test other things do."""
        # A directory made here is removed by close() (checkpoints run to
        # gigabytes); GEOTRAIN_KEEP_TEST_DIRS=1 keeps it for a post-mortem.
        self._owns_dir = workdir is None
        self.dir = workdir or tempfile.mkdtemp(prefix="geotrain-it-")
        self.job = job
        self.secure = secure
        self.coordinator_flags = list(coordinator_flags) + ([] if secure else ["--insecure"])
        self.coordinator = None
        self.workers = []
        self.port = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    @property
    def address(self):
        return f"127.0.0.1:{self.port}"

    @property
    def metrics_path(self):
        return os.path.join(self.dir, "state", "metrics.jsonl")

    def start_coordinator(self, port=0):
        """Starts (or, after a crash, restarts on the same state dir and
        `port`) the coordinator."""
        port_file = os.path.join(self.dir, "port")
        if os.path.exists(port_file):
            os.remove(port_file)
        args = [binary("geotrain-coordinator"), f"--listen=127.0.0.1:{port}",
                f"--port_file={port_file}", f"--job={self.job}",
                f"--state_dir={os.path.join(self.dir, 'state')}"] + self.coordinator_flags
        self.coordinator = Process(args, os.path.join(self.dir, "coordinator.log"))

        def port():
            if not self.coordinator.alive():
                raise RuntimeError("coordinator exited:\n" + self.coordinator.log())
            try:
                with open(port_file) as f:
                    text = f.read().strip()
                return int(text) if text else None
            except FileNotFoundError:
                return None

        self.port = wait_for(port, 30, "the coordinator's port")
        return self

    def start_worker(self, name, extra=(), env=None, worker_binary=None):
        """`extra` flags come last, so they override the defaults here;
        `env` adds to the environment; `worker_binary` is another build's
        geotrain-worker (BIN_DIR's by default)."""
        args = [worker_binary or binary("geotrain-worker"), f"--coordinator={self.address}",
                "--listen=127.0.0.1:0", "--device=cpu", "--threads=1",
                f"--name={name}"] + ([] if self.secure else ["--insecure"]) + list(extra)
        worker = Process(args, os.path.join(self.dir, f"{name}.log"), env, name)
        self.workers.append(worker)
        return worker

    @property
    def admin_credential(self):
        return os.path.join(self.dir, "state", "tls", "admin.credential")

    def ctl_credentials(self):
        """The geotrain-ctl flags that authenticate to this cluster."""
        if not self.secure:
            return ["--insecure"]
        return [f"--admin_credential={self.admin_credential}"]

    def ctl(self, *args, timeout_ms=3000, credentials=None):
        """Runs geotrain-ctl ARGS against this cluster; returns the
        CompletedProcess (stdout and stderr as text)."""
        creds = self.ctl_credentials() if credentials is None else list(credentials)
        return subprocess.run([binary("geotrain-ctl"), *args, f"--coordinator={self.address}",
                               f"--timeout_ms={timeout_ms}", *creds],
                              capture_output=True, text=True, timeout=30,
                              stdin=subprocess.DEVNULL)

    def create_token(self, *flags):
        out = self.ctl("token", "create", *flags)
        if out.returncode != 0:
            raise RuntimeError(f"geotrain-ctl token create failed: {out.stderr}")
        return out.stdout.strip()

    def status(self, timeout_ms=3000):
        out = self.ctl("status", "--json", timeout_ms=timeout_ms)
        if out.returncode != 0:
            raise RuntimeError(f"geotrain-ctl failed: {out.stderr}")
        return json.loads(out.stdout)

    def metrics(self):
        try:
            with open(self.metrics_path) as f:
                return [json.loads(line) for line in f if line.strip()]
        except FileNotFoundError:
            return []

    def steps(self):
        return [m for m in self.metrics() if not m.get("eval")]

    def evals(self):
        return [m for m in self.metrics() if m.get("eval")]

    def wait_done(self, timeout):
        def done():
            for p in self.workers:
                if p.popen.poll() not in (None, 0):
                    raise RuntimeError(f"{p.name} exited with {p.popen.returncode}:\n"
                                       + p.log()[-3000:])
            if not self.coordinator.alive() and self.coordinator.popen.returncode != 0:
                raise RuntimeError("coordinator failed:\n" + self.coordinator.log()[-3000:])
            return self.status()["state"] == "done"
        wait_for(done, timeout, "the job to finish", interval=0.5)

    def train(self, workers, timeout=900):
        """Starts the coordinator and `workers` workers named w0, w1, ...
        and waits for the job to finish; prints every log if it does not."""
        self.start_coordinator()
        for i in range(workers):
            self.start_worker(f"w{i}")
        try:
            self.wait_done(timeout=timeout)
        except Exception:
            print(self.dump_logs())
            raise
        return self

    def dump_logs(self):
        parts = []
        for p in ([self.coordinator] if self.coordinator else []) + self.workers:
            parts.append(f"==== {p.log_path}\n{p.log()[-4000:]}")
        return "\n".join(parts)

    def close(self):
        for p in self.workers + ([self.coordinator] if self.coordinator else []):
            p.stop()
        if self._owns_dir and os.environ.get("GEOTRAIN_KEEP_TEST_DIRS") != "1":
            shutil.rmtree(self.dir, ignore_errors=True)
