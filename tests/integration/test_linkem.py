"""geotrain-linkem, the WAN lab relay, as a real process: calibration of its
delay and rate (within 10% of the settings), its faults (close after N
bytes, blackhole, toggled by SIGUSR1), reshaping on SIGHUP, back-pressure
from its queue cap, and its flag errors."""
import os
import signal
import socket
import statistics
import subprocess
import tempfile
import threading
import time
import unittest

from cluster import Process, binary, wait_for


class Sink:
    """A TCP server that echoes (mode 'echo') or counts bytes with arrival
    times (mode 'count') on every connection."""

    def __init__(self, mode):
        self.mode = mode
        self.server = socket.socket()
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(8)
        self.port = self.server.getsockname()[1]
        self.received = 0
        self.first_at = self.last_at = None
        self.closed = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn):
        with conn:
            while True:
                try:
                    data = conn.recv(65536)
                except OSError:
                    data = b""
                if not data:
                    self.closed.set()
                    return
                now = time.monotonic()
                if self.mode == "echo":
                    conn.sendall(data)
                else:
                    if self.first_at is None:
                        self.first_at = now
                        self.first_bytes = len(data)
                    self.received += len(data)
                    self.last_at = now

    def reset(self):
        """Counts from zero again (call while nothing is arriving)."""
        self.received = 0
        self.first_at = self.last_at = None

    def close(self):
        self.server.close()


class Relay:
    def __init__(self, target_port, *flags):
        self.dir = tempfile.mkdtemp(prefix="linkem-")
        port_file = os.path.join(self.dir, "port")
        self.process = Process([binary("geotrain-linkem"), "--listen=127.0.0.1:0",
                                f"--target=127.0.0.1:{target_port}", f"--port_file={port_file}",
                                *flags], os.path.join(self.dir, "linkem.log"))
        def port():
            if os.path.exists(port_file):
                with open(port_file) as f:
                    return f.read()
        self.port = int(wait_for(port, 10, "the relay's port"))

    def connect(self):
        s = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return s

    def close(self):
        self.process.stop()


class LinkemTest(unittest.TestCase):
    def tearDown(self):
        for thing in getattr(self, "_cleanup", []):
            thing.close()

    def start(self, thing):
        self._cleanup = getattr(self, "_cleanup", []) + [thing]
        return thing

    def measure_one_way_delay(self, relay):
        with relay.connect() as s:
            samples = []
            for _ in range(15):
                start = time.monotonic()
                s.sendall(b"x")
                self.assertEqual(s.recv(1), b"x")
                samples.append((time.monotonic() - start) / 2)
            return statistics.median(samples)

    def measure_rate(self, relay, sink, total_bytes):
        with relay.connect() as s:
            block = b"\0" * 65536
            sent = 0
            while sent < total_bytes:
                s.sendall(block)
                sent += len(block)
            wait_for(lambda: sink.received >= total_bytes, 60, "every byte at the sink")
        # Bits after the first arrival, over the time between first and last.
        return (sink.received - sink.first_bytes) * 8 / (sink.last_at - sink.first_at)

    def test_calibration(self):
        figures = []
        for delay_ms, rate_mbit, total in ((50, 100, 8 << 20), (20, 20, 2 << 20), (10, 400, 24 << 20)):
            echo = self.start(Sink("echo"))
            relay = self.start(Relay(echo.port, f"--delay_ms={delay_ms}", f"--rate_mbit={rate_mbit}"))
            delay = self.measure_one_way_delay(relay)
            sink = self.start(Sink("count"))
            rate_relay = self.start(Relay(sink.port, f"--delay_ms={delay_ms}",
                                          f"--rate_mbit={rate_mbit}"))
            rate = self.measure_rate(rate_relay, sink, total)
            figures.append(f"set {delay_ms} ms {rate_mbit} Mb/s: measured "
                           f"{delay * 1000:.1f} ms {rate / 1e6:.1f} Mb/s")
            print(figures[-1], flush=True)
            self.assertLess(abs(delay * 1000 - delay_ms), 0.1 * delay_ms, figures[-1])
            self.assertLess(abs(rate / 1e6 - rate_mbit), 0.1 * rate_mbit, figures[-1])

    def test_sighup_reshapes_a_running_link(self):
        """A link slowed to a tenth of its rate mid-run (the planner's
        re-planning test needs links that change under it)."""
        settings = os.path.join(tempfile.mkdtemp(prefix="linkem-settings-"), "settings")
        with open(settings, "w") as f:
            f.write("rate_mbit=100\n")
        sink = self.start(Sink("count"))
        relay = self.start(Relay(sink.port, "--rate_mbit=100", f"--settings_file={settings}"))
        before = self.measure_rate(relay, sink, 4 << 20)
        with open(settings, "w") as f:
            f.write("rate_mbit=10 delay_ms=0\n")
        relay.process.popen.send_signal(signal.SIGHUP)
        wait_for(lambda: "settings applied" in relay.process.log(), 10, "the new settings")
        sink.reset()
        after = self.measure_rate(relay, sink, 1 << 20)
        print(f"100 Mb/s link measured {before / 1e6:.1f} Mb/s; after SIGHUP (10 Mb/s) "
              f"{after / 1e6:.1f} Mb/s", flush=True)
        self.assertLess(abs(before / 1e6 - 100), 10)
        self.assertLess(abs(after / 1e6 - 10), 1.5)
        # A bad file is refused and changes nothing.
        with open(settings, "w") as f:
            f.write("rate_mbit=fast\n")
        relay.process.popen.send_signal(signal.SIGHUP)
        wait_for(lambda: "settings not applied" in relay.process.log(), 10, "the refusal")

    def test_profile_by_name(self):
        echo = self.start(Sink("echo"))
        relay = self.start(Relay(echo.port, "--profile=home-10mbit"))
        delay = self.measure_one_way_delay(relay)
        self.assertLess(abs(delay * 1000 - 20), 2.0)
        self.assertIn("rate 10", relay.process.log())

    def test_close_after_bytes(self):
        sink = self.start(Sink("count"))
        relay = self.start(Relay(sink.port, "--close_after_bytes=100000"))
        with relay.connect() as s:
            with self.assertRaises(OSError):
                for _ in range(100):
                    s.sendall(b"\1" * 65536)
                    time.sleep(0.01)
        wait_for(sink.closed.is_set, 10, "the sink to see the connection end")
        self.assertEqual(sink.received, 100000)

    def test_blackhole_keeps_the_connection_open_and_forwards_nothing(self):
        sink = self.start(Sink("count"))
        relay = self.start(Relay(sink.port, "--blackhole"))
        with relay.connect() as s:
            s.sendall(b"\1" * 100000)
            # The relay swallows the bytes; the sender sees no error.
            time.sleep(0.5)  # nothing may arrive in this time; there is no event to wait for
            self.assertEqual(sink.received, 0)
            self.assertFalse(sink.closed.is_set())
            relay.process.popen.send_signal(signal.SIGUSR1)  # blackhole off
            wait_for(lambda: "blackhole off" in relay.process.log(), 5, "the toggle")
            s.sendall(b"\2" * 1000)
            wait_for(lambda: sink.received == 1000, 5, "bytes after the blackhole")

    def test_queue_cap_holds_the_sender_back(self):
        sink = self.start(Sink("count"))
        relay = self.start(Relay(sink.port, "--rate_mbit=1", "--queue_kb=64"))
        with relay.connect() as s:
            s.setblocking(False)
            accepted = 0
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline:
                try:
                    accepted += s.send(b"\0" * 65536)
                except BlockingIOError:
                    time.sleep(0.01)
            # 1 Mb/s for 1 s is 125 kB; the queue, the relay's 128 KiB socket
            # buffers and the sender's own buffer may hold a few MB, not 100s.
            print(f"accepted {accepted} bytes in 1 s at 1 Mb/s", flush=True)
            self.assertLess(accepted, 8 << 20)

    def test_flag_errors(self):
        def run(*flags):
            return subprocess.run([binary("geotrain-linkem"), *flags], capture_output=True,
                                  text=True, timeout=10)
        missing = run("--listen=127.0.0.1:0")
        self.assertEqual(missing.returncode, 2)
        self.assertIn("--target", missing.stderr)
        unknown = run("--target=127.0.0.1:1", "--profile=mars")
        self.assertEqual(unknown.returncode, 2)
        self.assertIn("tokyo-london", unknown.stderr)
        bad_address = run("--target=nowhere")
        self.assertNotEqual(bad_address.returncode, 0)
        self.assertIn("HOST:PORT", bad_address.stderr)
        self.assertNotEqual(run("--target=127.0.0.1:1", "--no_such_flag").returncode, 0)


if __name__ == "__main__":
    unittest.main()
