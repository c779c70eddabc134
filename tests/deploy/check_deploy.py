"""Checks the deployment files in deploy/ without a Docker engine or a
Kubernetes cluster (neither runs on the development machine):

- systemd units: `systemd-analyze verify` in a scratch root that holds the
  built binaries where the units expect them; any warning fails.
- compose.yaml: YAML, the compose-spec JSON schema (from PyPI's
  docker-compose 1.29.2, the newest that ships it), a coordinator and 3
  workers with health checks.
- Kubernetes manifests: each document against the Kubernetes OpenAPI
  schemas (kubernetes-validate, strict: unknown fields fail), and the
  shapes the issue asks for (StatefulSet with a PVC, Deployment, Service,
  gRPC probes, the token as a Secret).
- Every --flag that a unit, the compose file or a manifest passes to a
  geotrain binary is one that binary knows (--helpfull), and the
  manifests' job parses (the coordinator starts on it).
- Dockerfile: two stages; its runtime-packages.sh on this tree's binaries
  gives a list with an install candidate for every package and no
  compiler. With GEOTRAIN_CHECK_DOCKERFILE_BUILD=1 (not in CI: about 6 min
  of compiling beside the timing-sensitive suites), also its build stage's
  own commands, taken from the Dockerfile, in a fresh clone.

Runs under the test tools' venv (deploy/install-test-tools.sh):
  python check_deploy.py SOURCE_DIR BIN_DIR
"""
import glob
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

import jsonschema
import kubernetes_validate
import yaml

SOURCE_DIR, BIN_DIR = sys.argv[1], sys.argv[2]
DEPLOY = os.path.join(SOURCE_DIR, "deploy")


def known_flags(binary):
    out = subprocess.run([os.path.join(BIN_DIR, binary), "--helpfull"], capture_output=True,
                         text=True, timeout=60)
    return set(re.findall(r"^\s+--([a-z_0-9]+)", out.stdout + out.stderr, re.M))


def flags_in(words):
    return [m.group(1) for w in words for m in [re.match(r"--([a-z_0-9]+)", w)] if m]


class FlagChecker:
    def __init__(self):
        self.cache = {}

    def check(self, test, binary, words, where):
        if binary not in self.cache:
            self.cache[binary] = known_flags(binary)
        for flag in flags_in(words):
            test.assertIn(flag, self.cache[binary], f"{where}: {binary} has no --{flag}")


FLAGS = FlagChecker()


class SystemdTest(unittest.TestCase):
    def test_units_verify_cleanly(self):
        units = sorted(glob.glob(os.path.join(DEPLOY, "systemd", "*.service")))
        self.assertEqual([os.path.basename(u) for u in units],
                         ["geotrain-coordinator.service", "geotrain-worker.service"])
        with tempfile.TemporaryDirectory() as root:
            shutil.copytree("/lib/systemd/system", os.path.join(root, "usr/lib/systemd/system"),
                            symlinks=True)
            os.makedirs(os.path.join(root, "usr/local/bin"))
            for binary in ("geotrain-coordinator", "geotrain-worker"):
                shutil.copy(os.path.join(BIN_DIR, binary), os.path.join(root, "usr/local/bin"))
            unit_dir = os.path.join(root, "etc/systemd/system")
            os.makedirs(unit_dir)
            for unit in units:
                shutil.copy(unit, unit_dir)
            out = subprocess.run(
                ["systemd-analyze", "verify", f"--root={root}"] +
                [f"/etc/systemd/system/{os.path.basename(u)}" for u in units],
                capture_output=True, text=True, timeout=120)
            # verify exits 0 on unknown keys and bad values: its words fail.
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertEqual((out.stdout + out.stderr).strip(), "")
            for unit in units:
                name = os.path.basename(unit)
                out = subprocess.run(["systemd-analyze", "security", "--offline=yes",
                                      f"--root={root}", name], capture_output=True, text=True,
                                     timeout=120)
                level = re.search(r"Overall exposure level for \S+: ([\d.]+)", out.stdout)
                self.assertIsNotNone(level, out.stdout[-500:] + out.stderr)
                print(f"{name}: systemd-analyze security exposure {level.group(1)}", flush=True)
                self.assertLess(float(level.group(1)), 5.0)  # "OK" or better
        for unit in units:
            with open(unit) as f:
                text = f.read()
            for key in ("DynamicUser=yes", "StateDirectory=", "ProtectSystem=strict",
                        "Restart=on-failure"):
                self.assertIn(key, text, unit)
            exec_start = re.search(r"^ExecStart=(.*?)(?<!\\)$", text, re.M | re.S).group(1)
            words = exec_start.replace("\\\n", " ").split()
            FLAGS.check(self, os.path.basename(words[0]), words[1:], unit)


class ComposeTest(unittest.TestCase):
    def test_compose_file_follows_the_spec(self):
        # docker-compose's package (installed without its dependencies):
        # only its schema file is read, nothing is imported.
        package = importlib.util.find_spec("compose").submodule_search_locations[0]
        schema_path = os.path.join(package, "config", "compose_spec.json")
        with open(schema_path) as f:
            schema = json.load(f)
        with open(os.path.join(DEPLOY, "docker", "compose.yaml")) as f:
            spec = yaml.safe_load(f)
        # The compose spec is written against JSON Schema draft-07.
        jsonschema.Draft7Validator(schema).validate(spec)
        services = spec["services"]
        self.assertIn("coordinator", services)
        workers = [name for name in services if name.startswith("worker-")]
        self.assertEqual(len(workers), 3)
        for name in ["coordinator"] + workers:
            service = services[name]
            self.assertIn("geotrain-ctl", service["healthcheck"]["test"], name)
            FLAGS.check(self, service["command"][0], service["command"][1:], f"compose {name}")
            FLAGS.check(self, "geotrain-ctl", service["healthcheck"]["test"][2:],
                        f"compose {name} healthcheck")
        self.assertEqual(spec["services"]["coordinator"]["build"]["dockerfile"],
                         "deploy/docker/Dockerfile")
        # The compose file refers to the repository root as its build context.
        context = os.path.normpath(os.path.join(DEPLOY, "docker",
                                                spec["services"]["coordinator"]["build"]["context"]))
        self.assertTrue(os.path.exists(os.path.join(context, "deploy", "docker", "Dockerfile")))


class KubernetesTest(unittest.TestCase):
    def test_manifests_validate_against_the_schemas(self):
        version = kubernetes_validate.latest_version()
        with open(os.path.join(DEPLOY, "k8s", "geotrain.yaml")) as f:
            docs = [d for d in yaml.safe_load_all(f) if d]
        kinds = {}
        for doc in docs:
            kubernetes_validate.validate(doc, version, strict=True)
            kinds.setdefault(doc["kind"], []).append(doc)
        print(f"{len(docs)} manifests valid against Kubernetes {version} (strict)", flush=True)
        coordinator = kinds["StatefulSet"][0]
        self.assertTrue(coordinator["spec"]["volumeClaimTemplates"])
        worker = kinds["Deployment"][0]
        self.assertTrue(kinds["Service"])
        self.assertEqual(kinds["Secret"][0]["metadata"]["name"], "geotrain-join-token")
        for workload in (coordinator, worker):
            container = workload["spec"]["template"]["spec"]["containers"][0]
            readiness, liveness = container["readinessProbe"], container["livenessProbe"]
            self.assertIn("grpc", readiness)
            self.assertEqual(liveness["grpc"].get("service"), "liveness")
            args = container["args"]
            health = [a for a in args if a.startswith("--health_listen=")]
            self.assertTrue(health, args)
            self.assertEqual(int(health[0].rsplit(":", 1)[1]), readiness["grpc"]["port"])
            FLAGS.check(self, args[0], args[1:], f"k8s {workload['metadata']['name']}")
        token_mounts = [v for v in worker["spec"]["template"]["spec"]["volumes"]
                        if v.get("secret", {}).get("secretName") == "geotrain-join-token"]
        self.assertTrue(token_mounts)

    def test_the_manifests_job_parses(self):
        with open(os.path.join(DEPLOY, "k8s", "geotrain.yaml")) as f:
            docs = [d for d in yaml.safe_load_all(f) if d]
        job = next(d for d in docs if d["kind"] == "ConfigMap")["data"]["job.textproto"]
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "job.textproto")
            with open(path, "w") as f:
                f.write(job)
            port_file = os.path.join(d, "port")
            log_path = os.path.join(d, "coordinator.log")
            with open(log_path, "w") as log:
                coordinator = subprocess.Popen(
                    [os.path.join(BIN_DIR, "geotrain-coordinator"), "--listen=127.0.0.1:0",
                     f"--job={path}", f"--state_dir={d}/state", "--insecure",
                     f"--port_file={port_file}"], stdout=log, stderr=subprocess.STDOUT)
            try:
                deadline = time.monotonic() + 30
                while not os.path.exists(port_file) and coordinator.poll() is None:
                    self.assertLess(time.monotonic(), deadline, "the coordinator did not start")
                    time.sleep(0.1)
                if coordinator.poll() is not None:
                    with open(log_path) as f:
                        self.fail(f"the coordinator refused the job:\n{f.read()[-2000:]}")
            finally:
                coordinator.terminate()
                coordinator.wait(timeout=10)


class DockerfileTest(unittest.TestCase):
    def build_stage_commands(self):
        with open(os.path.join(DEPLOY, "docker", "Dockerfile")) as f:
            text = f.read()
        stages = re.split(r"^FROM ", text, flags=re.M)[1:]
        self.assertEqual(len(stages), 2, "a build stage and a runtime stage")
        self.assertTrue(stages[0].startswith("debian:12 AS build"))
        self.assertTrue(stages[1].startswith("debian:12-slim AS runtime"))
        runs = [r.replace("\\\n", " ") for r in
                re.findall(r"^RUN (.*?)(?<!\\)$", stages[0], re.M | re.S)]
        self.assertEqual(len(runs), 2, runs)
        self.assertIn("install-deps.sh", runs[0])
        # install-deps.sh, without the image's apt cache cleanup; the build.
        return runs[0].split("&&")[0], runs[1]

    def check_runtime_packages(self, packages):
        self.assertIn("libtorch1.13", packages)
        self.assertIn("libgrpc++1.51", packages)
        for compiler in ("gcc", "g++", "cpp", "clang-14", "cmake", "libtorch-dev",
                         "libgrpc++-dev", "protobuf-compiler"):
            self.assertNotIn(compiler, packages)
        out = subprocess.run(["apt-cache", "policy"] + packages, capture_output=True, text=True,
                             timeout=120)
        no_candidate = re.findall(r"^(\S+):\n\s+Installed: .*\n\s+Candidate: \(none\)",
                                  out.stdout, re.M)
        self.assertEqual(no_candidate, [], "packages apt cannot install")
        print(f"runtime image: {len(packages)} Debian packages, no compiler", flush=True)

    def test_runtime_packages_of_the_built_binaries(self):
        """The runtime stage's package list, from this tree's binaries (the
        ones the build stage makes), by the Dockerfile's own script."""
        self.build_stage_commands()
        binaries = [os.path.join(BIN_DIR, b) for b in
                    ("geotrain-coordinator", "geotrain-worker", "geotrain-ctl", "geotrain-relay")]
        out = subprocess.run([os.path.join(DEPLOY, "docker", "runtime-packages.sh")] + binaries,
                             capture_output=True, text=True, timeout=300)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.check_runtime_packages(out.stdout.split())

    @unittest.skipUnless(os.environ.get("GEOTRAIN_CHECK_DOCKERFILE_BUILD") == "1",
                         "the full build (about 6 min on 2 cores, beside the other suites) runs "
                         "with GEOTRAIN_CHECK_DOCKERFILE_BUILD=1")
    def test_build_stage_commands_run_in_a_fresh_clone(self):
        install, build_command = self.build_stage_commands()
        with tempfile.TemporaryDirectory() as d:
            clone = os.path.join(d, "src")
            subprocess.run(["git", "clone", "--quiet", SOURCE_DIR, clone], check=True,
                           timeout=300)
            build = os.path.join(d, "build")
            # The Dockerfile's own commands; only /build moves to a scratch dir.
            started = time.monotonic()
            for command in (install, build_command.replace("/build", build)):
                out = subprocess.run(["bash", "-c", f"set -e; {command}"], cwd=clone,
                                     capture_output=True, text=True, timeout=1800)
                self.assertEqual(out.returncode, 0,
                                 f"{command}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
            print(f"Dockerfile build stage in a fresh clone: {time.monotonic() - started:.0f} s",
                  flush=True)
            with open(os.path.join(build, "runtime-packages.txt")) as f:
                self.check_runtime_packages(f.read().split())


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1], verbosity=2)
