#!/usr/bin/env python3
"""A network lab of real hosts: Linux network namespaces on one machine.

Every host is a namespace with its own address, routes and firewall. A bridge
in an "inet" namespace plays the internet (198.51.100.0/24, TEST-NET-2).
A public host sits on it directly; a home host sits behind a NAT router
namespace (nftables masquerade plus a stateful firewall that drops what
nobody inside asked for, as a home router does) on a LAN of its own carved
from 192.0.2.0/24 (TEST-NET-1). Any host's internet link can be rate-limited
with tbf, both ways. Only addresses inside the lab are used.

    netlab.py up   --lab=demo --spec=lab.json
    netlab.py up   --lab=demo --public=coord,w0,relay --home=w1,w2 --rate=w1=100mbit
    netlab.py exec --lab=demo w1 -- ip addr
    netlab.py show --lab=demo
    netlab.py down --lab=demo

`up` first removes a lab of the same name; `down` removes everything the lab
made (its namespaces and every process still running in them) and is a no-op
for a lab that is not there. Needs root (CI runs as root).

A spec file is JSON:
    {"hosts": [{"name": "coord"},
               {"name": "w1", "nat": "home1", "rate": "100mbit",
                "forward": [7001]}]}
`nat` puts the host behind the named router (hosts naming the same router
share its LAN); `forward` opens ports on that router to the host (a port
forward); `rate` shapes the host's internet link (tbf, both directions).

As a module: Lab(name, spec).up(), .address(host), .popen(host, argv),
.run(host, argv), .down(); lab_unavailable() says why a lab cannot be made.
"""

import argparse
import ipaddress
import json
import os
import signal
import subprocess
import sys
import time

INTERNET = ipaddress.ip_network("198.51.100.0/24")
HOME_LANS = ipaddress.ip_network("192.0.2.0/24")
PREFIX = "gtl"


def _sh(argv, check=True, quiet=False):
    result = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}): "
                           f"{result.stderr.strip() or result.stdout.strip()}")
    return result


def lab_unavailable():
    """None when namespaces, veth, nftables and tbf work here; else why not."""
    if os.geteuid() != 0:
        return "the network lab needs root (ip netns, nftables, tc)"
    for tool in ("ip", "nft", "tc"):
        if subprocess.run(["which", tool], stdout=subprocess.DEVNULL).returncode != 0:
            return f"'{tool}' is not installed (deploy/install-deps.sh installs it)"
    probe = f"{PREFIX}-probe-{os.getpid()}"
    made = _sh(["ip", "netns", "add", probe], check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    try:
        veth = _sh(["ip", "-n", probe, "link", "add", "a0", "type", "veth", "peer", "name", "b0"],
                   check=False)
        if veth.returncode != 0:
            return f"cannot create veth pairs: {veth.stderr.strip()}"
        tbf = _sh(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "a0", "root", "tbf",
                   "rate", "10mbit", "burst", "32kb", "latency", "50ms"], check=False)
        if tbf.returncode != 0:
            return f"the kernel has no tbf qdisc: {tbf.stderr.strip()}"
        nft = _sh(["ip", "netns", "exec", probe, "nft", "add", "table", "ip", "probe"], check=False)
        if nft.returncode != 0:
            return f"nftables does not work in a namespace: {nft.stderr.strip()}"
    finally:
        _sh(["ip", "netns", "del", probe], check=False)
    return None


def parse_rate(text):
    """'100mbit' / '20Mbit' / '1gbit' -> bits per second."""
    t = text.strip().lower()
    for suffix, factor in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1)):
        if t.endswith(suffix):
            return float(t[: -len(suffix)]) * factor
    raise ValueError(f"rate '{text}': expected e.g. 100mbit")


class Lab:
    def __init__(self, name, spec):
        if not name.isalnum() or len(name) > 8:
            raise ValueError(f"lab name '{name}': at most 8 letters or digits")
        self.name = name
        self.hosts = {}    # host -> {"ns", "address", "nat", "rate", "forward"}
        self.routers = {}  # router -> {"ns", "wan", "lan_net", "lan_gw", "hosts"}
        public = iter(list(INTERNET.hosts())[9:90])      # .10 - .90: public hosts
        router_wan = iter(list(INTERNET.hosts())[99:200])  # .100 - : routers
        lans = iter(HOME_LANS.subnets(new_prefix=28))
        names = set()
        for h in spec.get("hosts", []):
            host = h["name"]
            if not host.replace("-", "").isalnum() or len(host) > 12 or host in names:
                raise ValueError(f"host name '{host}': unique, at most 12 letters, digits or '-'")
            names.add(host)
            entry = {"ns": f"{PREFIX}-{name}-{host}", "nat": h.get("nat"),
                     "rate": h.get("rate"), "forward": [int(p) for p in h.get("forward", [])]}
            if entry["rate"]:
                parse_rate(entry["rate"])
            if entry["nat"]:
                router = entry["nat"]
                if router not in self.routers:
                    lan = next(lans)
                    hosts = list(lan.hosts())
                    self.routers[router] = {"ns": f"{PREFIX}-{name}-{router}", "wan": str(next(router_wan)),
                                            "lan_net": lan, "lan_gw": str(hosts[0]),
                                            "free": iter(hosts[1:]), "hosts": []}
                r = self.routers[router]
                entry["address"] = str(next(r["free"]))
                entry["public_address"] = r["wan"]
                r["hosts"].append(host)
            else:
                entry["address"] = str(next(public))
                entry["public_address"] = entry["address"]
            self.hosts[host] = entry
        self.inet = f"{PREFIX}-{name}-inet"

    # -- building --

    def _ns(self, ns, *argv, check=True):
        return _sh(["ip", "netns", "exec", ns, *argv], check=check)

    def _veth(self, ns_a, if_a, ns_b, if_b):
        _sh(["ip", "-n", ns_a, "link", "add", if_a, "type", "veth", "peer", "name", if_b,
             "netns", ns_b])

    def _shape(self, ns, dev, rate):
        # tbf: the rate, a burst of ~2 ms of it (at least 16 KiB), and a queue
        # of ~50 ms beyond which packets drop (TCP backs off, as on a real uplink).
        bits = parse_rate(rate)
        burst = max(16384, int(bits / 8 * 0.002))
        self._ns(ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{int(bits)}bit",
                 "burst", str(burst), "latency", "50ms")

    def up(self):
        self.down()
        namespaces = [self.inet] + [h["ns"] for h in self.hosts.values()] + \
                     [r["ns"] for r in self.routers.values()]
        for ns in namespaces:
            _sh(["ip", "netns", "add", ns])
            self._ns(ns, "ip", "link", "set", "lo", "up")
        self._ns(self.inet, "ip", "link", "add", "br0", "type", "bridge")
        self._ns(self.inet, "ip", "link", "set", "br0", "up")
        port = 0
        for host, h in self.hosts.items():
            if h["nat"]:
                continue
            port += 1
            self._veth(h["ns"], "eth0", self.inet, f"p{port}")
            self._ns(self.inet, "ip", "link", "set", f"p{port}", "master", "br0", "up")
            self._ns(h["ns"], "ip", "addr", "add", f"{h['address']}/24", "dev", "eth0")
            self._ns(h["ns"], "ip", "link", "set", "eth0", "up")
            if h["rate"]:
                self._shape(h["ns"], "eth0", h["rate"])
                self._shape(self.inet, f"p{port}", h["rate"])
        for router, r in self.routers.items():
            port += 1
            self._veth(r["ns"], "wan", self.inet, f"p{port}")
            self._ns(self.inet, "ip", "link", "set", f"p{port}", "master", "br0", "up")
            self._ns(r["ns"], "ip", "addr", "add", f"{r['wan']}/24", "dev", "wan")
            self._ns(r["ns"], "ip", "link", "set", "wan", "up")
            self._ns(r["ns"], "ip", "link", "add", "lan", "type", "bridge")
            self._ns(r["ns"], "ip", "addr", "add", f"{r['lan_gw']}/{r['lan_net'].prefixlen}", "dev", "lan")
            self._ns(r["ns"], "ip", "link", "set", "lan", "up")
            self._ns(r["ns"], "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
            rules = [
                "table ip nat {",
                " chain prerouting { type nat hook prerouting priority -100; }",
                " chain postrouting { type nat hook postrouting priority 100;",
                '  oifname "wan" masquerade; }',
                "}",
                "table inet firewall {",
                # A home router: what comes in from the internet gets through
                # only as an answer to something from inside, or by a port forward.
                " chain input { type filter hook input priority 0; policy accept;",
                '  iifname "wan" ct state established,related accept;',
                '  iifname "wan" drop; }',
                " chain forward { type filter hook forward priority 0; policy accept;",
                '  iifname "wan" ct state established,related accept;',
                '  iifname "wan" ct status dnat accept;',
                '  iifname "wan" drop; }',
                "}",
            ]
            for i, host in enumerate(r["hosts"]):
                h = self.hosts[host]
                self._veth(h["ns"], "eth0", r["ns"], f"h{i}")
                self._ns(r["ns"], "ip", "link", "set", f"h{i}", "master", "lan", "up")
                self._ns(h["ns"], "ip", "addr", "add", f"{h['address']}/{r['lan_net'].prefixlen}",
                         "dev", "eth0")
                self._ns(h["ns"], "ip", "link", "set", "eth0", "up")
                self._ns(h["ns"], "ip", "route", "add", "default", "via", r["lan_gw"])
                for forwarded in h["forward"]:
                    rules.insert(2, f'add rule ip nat prerouting iifname "wan" tcp dport {forwarded} '
                                    f'dnat to {h["address"]}:{forwarded}')
                if h["rate"]:
                    self._shape(r["ns"], "wan", h["rate"])
                    self._shape(self.inet, f"p{port}", h["rate"])
            forwards = [x for x in rules if x.startswith("add rule")]
            tables = "\n".join(x for x in rules if not x.startswith("add rule"))
            self._nft(r["ns"], tables + "\n" + "\n".join(forwards) + "\n")
        return self

    def _nft(self, ns, script):
        result = subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=script,
                                text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        if result.returncode != 0:
            raise RuntimeError(f"nft in {ns}: {result.stderr.strip()}\n{script}")

    def namespaces(self):
        listed = _sh(["ip", "netns", "list"], check=False).stdout.split("\n")
        mine = f"{PREFIX}-{self.name}-"
        return [line.split()[0] for line in listed if line.startswith(mine)]

    def down(self):
        for ns in self.namespaces():
            pids = _sh(["ip", "netns", "pids", ns], check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            for _ in range(50):
                if not _sh(["ip", "netns", "pids", ns], check=False).stdout.split():
                    break
                time.sleep(0.1)
            _sh(["ip", "netns", "del", ns], check=False)

    # -- using --

    def address(self, host):
        """The host's own address (a home host's LAN address)."""
        return self.hosts[host]["address"]

    def public_address(self, host):
        """Where the internet sees the host (a home host: its router's WAN)."""
        return self.hosts[host]["public_address"]

    def prefix(self, host):
        return ["ip", "netns", "exec", self.hosts[host]["ns"]]

    def popen(self, host, argv, **kwargs):
        return subprocess.Popen(self.prefix(host) + list(argv), **kwargs)

    def run(self, host, argv, **kwargs):
        return subprocess.run(self.prefix(host) + list(argv), **kwargs)

    def describe(self):
        lines = [f"lab {self.name}: internet {INTERNET} on a bridge in {self.inet}"]
        for host, h in self.hosts.items():
            where = f"behind NAT router '{h['nat']}' ({h['public_address']})" if h["nat"] else "public"
            extra = f", {h['rate']}" if h["rate"] else ""
            fwd = f", ports forwarded {h['forward']}" if h["forward"] else ""
            lines.append(f"  {host:12s} {h['address']:15s} {where}{extra}{fwd}  (ns {h['ns']})")
        return "\n".join(lines)


def spec_from_args(args):
    if args.spec:
        with open(args.spec) as f:
            return json.load(f)
    rates = {}
    for item in filter(None, (args.rate or "").split(",")):
        host, _, rate = item.partition("=")
        rates[host] = rate
    hosts = [{"name": h} for h in filter(None, (args.public or "").split(","))]
    for i, h in enumerate(filter(None, (args.home or "").split(","))):
        hosts.append({"name": h, "nat": f"nat{i}"})
    for h in hosts:
        if h["name"] in rates:
            h["rate"] = rates[h["name"]]
    return {"hosts": hosts}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["up", "down", "show", "exec", "check"])
    parser.add_argument("rest", nargs="*")
    parser.add_argument("--lab", default="lab")
    parser.add_argument("--spec", help="JSON spec file (see the module docstring)")
    parser.add_argument("--public", help="public hosts, comma-separated")
    parser.add_argument("--home", help="hosts each behind a NAT router of its own")
    parser.add_argument("--rate", help="HOST=RATE[,...], e.g. w1=100mbit")
    args = parser.parse_args()
    if args.command == "check":
        why = lab_unavailable()
        print(why or "ok: namespaces, veth, nftables and tbf work here")
        return 1 if why else 0
    if args.command in ("up", "show", "exec"):
        if args.command != "up" and not args.spec and not args.public and not args.home:
            state = f"/run/{PREFIX}-{args.lab}.json"
            if os.path.exists(state):
                args.spec = state
    lab = Lab(args.lab, spec_from_args(args) if args.command != "down" else {})
    if args.command == "down":
        lab.down()
        state = f"/run/{PREFIX}-{args.lab}.json"
        if os.path.exists(state):
            os.remove(state)
        return 0
    if args.command == "up":
        why = lab_unavailable()
        if why:
            print(f"netlab: {why}", file=sys.stderr)
            return 1
        lab.up()
        with open(f"/run/{PREFIX}-{args.lab}.json", "w") as f:
            json.dump(spec_from_args(args), f)
        print(lab.describe())
        return 0
    if args.command == "show":
        print(lab.describe())
        print("namespaces up:", " ".join(lab.namespaces()) or "none")
        return 0
    if not args.rest:
        print("netlab exec HOST -- COMMAND...", file=sys.stderr)
        return 2
    host, command = args.rest[0], args.rest[1:]
    if host not in lab.hosts:
        print(f"netlab: no host '{host}' in lab {args.lab}", file=sys.stderr)
        return 2
    return lab.run(host, command).returncode


if __name__ == "__main__":
    sys.exit(main())
