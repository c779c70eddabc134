#!/usr/bin/env python3
"""Renders coordinator/status_page.html in headless Chromium against a fixture.

A tiny HTTP server on 127.0.0.1 (ephemeral port) serves "/" = the page and
"/status.json" = tests/integration/status_page_fixture.json, in three modes:
  ok     the fixture, always;
  auth   401 unless "Authorization: Bearer <TOKEN>" (the page is opened once
         without a token, once with #token=<TOKEN>);
  flaky  the fixture once, then 500: the page keeps the data and shows an error;
  sparse the fixture cut to one step, no evals, no staged workers, no events;
  swarm  the fixture's stages among 1,000 members, served a page at a time and
         filtered by the query (page_size, name, state, stage) as the coordinator
         does: the page must ask for a page, show the summary and a row per stage,
         and fetch members on demand (#q=..., #stage=...).
Chromium dumps the DOM after a few seconds of virtual time; the script checks
it, writes a screenshot to /tmp/status_page.png, and exits non-zero on failure.

  python3 tests/integration/check_status_page_static.py [--chromium PATH] [--screenshot PATH]
"""
import argparse
import html.parser
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import urllib.parse

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGE = os.path.join(ROOT, "coordinator", "status_page.html")
FIXTURE = os.path.join(ROOT, "tests", "integration", "status_page_fixture.json")
TOKEN = "viewer-test-token-7f3a"


class Server:
    def __init__(self, mode):
        page = open(PAGE, "rb").read()
        fixture = open(FIXTURE, "rb").read()
        if mode == "sparse":
            doc = json.loads(fixture)
            doc["history"] = {"steps": doc["history"]["steps"][:1], "evals": []}
            doc["status"]["workers"] = [w for w in doc["status"]["workers"] if w["stage"] < 0]
            doc["status"]["events"] = []
            doc["health"] = {"coordinator": "NOT_SERVING"}
            fixture = json.dumps(doc).encode()
        if mode == "pipelines":
            fixture = json.dumps(pipelines_fixture(json.loads(fixture))).encode()
        swarm = swarm_fixture(json.loads(fixture)) if mode == "swarm" else None
        self.mode = mode
        self.queries = []
        self.auth_headers = []
        self.status_requests = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def send(self, code, body, ctype):
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                path = self.path.split("?")[0]
                if path == "/":
                    return self.send(200, page, "text/html; charset=utf-8")
                if path != "/status.json":
                    return self.send(404, b"not found\n", "text/plain")
                outer.status_requests += 1
                auth = self.headers.get("Authorization")
                outer.auth_headers.append(auth)
                if outer.mode == "auth" and auth != "Bearer " + TOKEN:
                    return self.send(401, b"viewer token needed\n", "text/plain")
                if outer.mode == "flaky" and outer.status_requests > 1:
                    return self.send(500, b"boom\n", "text/plain")
                if swarm is not None:
                    query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
                    outer.queries.append(query)
                    return self.send(200, json.dumps(swarm_page(swarm, query)).encode(), "application/json")
                return self.send(200, fixture, "application/json")

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def find_chromium(explicit):
    for name in ([explicit] if explicit else []) + ["chromium", "chromium-browser", "google-chrome", "chrome"]:
        path = shutil.which(name)
        if path:
            return path
    for path in ["/usr/bin/chromium", "/usr/lib/chromium/chromium"]:
        if os.access(path, os.X_OK):
            return path
    return None


def chromium(binary, url, extra):
    with tempfile.TemporaryDirectory(prefix="status-page-profile-") as profile:
        cmd = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
               "--no-first-run", "--user-data-dir=" + profile, "--virtual-time-budget=5000"] + extra + [url]
        run = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120)
    if run.returncode != 0:
        raise RuntimeError("chromium exited %d: %s" % (run.returncode, run.stderr.decode(errors="replace")[-2000:]))
    return run.stdout.decode("utf-8", errors="replace")


def pipelines_fixture(doc):
    """The fixture as two pipelines of two stages (job.outer): its four
    staged workers, pipeline 1 a round behind, with spot checks: the last
    worker failed one and was evicted."""
    st = doc["status"]
    ws = [w for w in st["workers"] if w["stage"] >= 0]
    for k, w in enumerate(ws):
        w["stage"], w["replica"], w["pipeline"] = k % 2, k // 2, k // 2
        w["outer_rounds"] = 7 - k // 2
        w["outer_bytes_sent"] = str(1500000 * (k + 1))
    st["pipelines"] = 2
    st["pipeline_status"] = [
        {"pipeline": r, "workers": [ws[2 * r]["id"], ws[2 * r + 1]["id"]], "step": 30 - 4 * r,
         "loss": 2.5 + 0.1 * r, "samples_per_s": 120.5} for r in range(2)]
    st["audits"] = {"fraction": 0.05, "drawn": "41", "passed": "37", "failed": "1",
                    "undecided": "2", "open": 1}
    for w in ws:
        w["audits_passed"] = "9"
    ws[-1]["audits_failed"] = "1"
    return doc


def swarm_fixture(doc, members=1000):
    """The fixture's staged workers and relay among `members` members: the
    others standbys named fake-0, fake-1, ..."""
    st = doc["status"]
    kept = [w for w in st["workers"] if w["stage"] >= 0 or w["role"] == "relay"]
    template = next(w for w in st["workers"] if w["stage"] < 0 and w["role"] != "relay")
    workers = list(kept)
    for i in range(members - len(kept)):
        w = dict(template, id="w-%05d" % i, name="fake-%d" % i,
                 address="192.0.2.%d:%d" % (1 + i % 250, 7000 + i))
        workers.append(w)
    st["workers"] = workers
    return doc


def swarm_page(doc, query):
    """What the coordinator answers /status.json?QUERY with (status_page.cc,
    StatusAssembler): the members that match, a page of them, the counts."""
    st = doc["status"]
    one = lambda k: (query.get(k) or [""])[0]
    size = int(one("page_size") or 0) or 2000
    name, state, stage = one("name"), one("state"), one("stage")
    def state_of(w):
        return w["state"].replace("WORKER_STATE_", "").lower()
    matched = [w for w in st["workers"]
               if (not name or name in w["name"] or name in w["id"])
               and (not state or state_of(w) == state)
               and (stage == "" or w["stage"] == int(stage))]
    states = {}
    for w in st["workers"]:
        states[state_of(w)] = states.get(state_of(w), 0) + 1
    summary = {}
    for w in st["workers"]:
        if w["stage"] >= 0:
            s = summary.setdefault(w["stage"], {"stage": w["stage"], "layer_begin": w["layer_begin"],
                                                "layer_end": w["layer_end"], "workers": 0})
            s["workers"] += 1
    page = dict(st, workers=matched[:size], workers_total=len(st["workers"]),
                workers_matched=len(matched), worker_states=states,
                stage_summary=[summary[k] for k in sorted(summary)],
                next_page_token=str(size) if size < len(matched) else "")
    return dict(doc, status=page)


class Dom(html.parser.HTMLParser):
    """Elements (tag, attrs, text inside) of a dumped DOM; enough for these checks."""

    VOID = {"meta", "link", "br", "img", "input", "hr", "col", "area", "base", "wbr", "source"}

    def __init__(self, text):
        super().__init__(convert_charrefs=True)
        self.elements = []
        self.stack = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        e = {"tag": tag, "attrs": dict(attrs), "text": []}
        self.elements.append(e)
        if tag not in self.VOID:
            self.stack.append(e)

    def handle_startendtag(self, tag, attrs):
        self.elements.append({"tag": tag, "attrs": dict(attrs), "text": []})

    def handle_endtag(self, tag):
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i]["tag"] == tag:
                del self.stack[i:]
                break

    def handle_data(self, data):
        for e in self.stack:
            e["text"].append(data)

    def by_class(self, name):
        return [e for e in self.elements if name in e["attrs"].get("class", "").split()]

    def by_id(self, ident):
        return next((e for e in self.elements if e["attrs"].get("id") == ident), None)

    @staticmethod
    def text(e):
        return "".join(e["text"]) if e else ""


def path_points(e):
    d = (e or {}).get("attrs", {}).get("d", "") or ""
    if "NaN" in d or "undefined" in d or "Infinity" in d:
        return -1
    return len(re.findall(r"[ML]", d))


class Checks:
    def __init__(self):
        self.failures = []
        self.passed = 0

    def check(self, label, ok, detail=""):
        print("  %s %s%s" % ("ok  " if ok else "FAIL", label, (": " + detail) if detail else ""))
        if ok:
            self.passed += 1
        else:
            self.failures.append(label)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chromium", help="browser binary (default: chromium on PATH)")
    ap.add_argument("--screenshot", default="/tmp/status_page.png")
    args = ap.parse_args()
    binary = find_chromium(args.chromium)
    if not binary:
        print("chromium not found (apt-get install chromium)", file=sys.stderr)
        return 2
    fixture = json.load(open(FIXTURE))
    st = fixture["status"]
    stages = {w["stage"] for w in st["workers"] if w["stage"] >= 0}
    replicas = [w for w in st["workers"] if w["stage"] >= 0 and w["replica"] > 0]
    events = st["events"][-50:]
    c = Checks()
    print("page %s (%d bytes), fixture %d workers, %d stages, %d steps, %d evals, %d events; browser %s"
          % (os.path.relpath(PAGE, ROOT), os.path.getsize(PAGE), len(st["workers"]), len(stages),
             len(fixture["history"]["steps"]), len(fixture["history"]["evals"]), len(events), binary))

    page_text = open(PAGE, encoding="utf-8").read()
    c.check("page has no external resources",
            not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//|@import|url\(\s*["']?https?:""", page_text))
    c.check("page builds no HTML from strings", "innerHTML" not in page_text and "insertAdjacentHTML" not in page_text
            and "document.write" not in page_text)

    print("mode ok: the fixture")
    with Server("ok") as srv:
        dom = Dom(chromium(binary, "http://127.0.0.1:%d/" % srv.port, ["--dump-dom"]))
        n_stage = len(dom.by_class("stage"))
        c.check("stage nodes == distinct stages", n_stage == len(stages) == 3, "%d .stage, %d stages" % (n_stage, len(stages)))
        c.check("data-stage attributes 0..2",
                sorted(e["attrs"].get("data-stage") for e in dom.by_class("stage")) == ["0", "1", "2"])
        c.check("replica nodes", len(dom.by_class("replica")) == len(replicas) == 1, "%d .replica" % len(dom.by_class("replica")))
        loss_pts = path_points(dom.by_id("loss-path"))
        tp_pts = path_points(dom.by_id("throughput-path"))
        val_pts = path_points(dom.by_id("val-loss-path"))
        c.check("loss-path points", loss_pts == len(fixture["history"]["steps"]), "%d points" % loss_pts)
        c.check("throughput-path points", tp_pts == len(fixture["history"]["steps"]), "%d points" % tp_pts)
        c.check("val-loss-path points", val_pts == len(fixture["history"]["evals"]), "%d points" % val_pts)
        rows = dom.by_class("event")
        c.check("event rows", len(rows) == len(events), "%d rows" % len(rows))
        first = Dom.text(rows[0]) if rows else ""
        c.check("events newest first", events[-1]["kind"] in first and events[-1]["detail"] in first, first[:60])
        missing = [e["detail"] for e in events if not any(e["detail"] in Dom.text(r) for r in rows)]
        c.check("every event detail shown", not missing, "; ".join(missing)[:120])
        c.check("event text escaped (no injected script)",
                sum(1 for e in dom.elements if e["tag"] == "script") == 1)
        hrows = dom.by_class("worker-row")
        c.check("health rows == workers", len(hrows) == len(st["workers"]), "%d rows" % len(hrows))
        standby = [w["name"] for w in st["workers"] if w["stage"] < 0 and w["role"] != "relay"]
        shown = " ".join(Dom.text(e) for e in dom.by_class("standby"))
        c.check("standby listed", all(n in shown for n in standby), shown)
        pipe = Dom.text(dom.by_id("pipeline"))
        for want in ["layers [4, 8)", "fp16 · 412 Mb/s", "int8 · 95.2 Mb/s", "via relay lon-relay-5", "fra-l4-2", "ms/µb"]:
            c.check("pipeline shows %r" % want, want in pipe)
        c.check("header job", Dom.text(dom.by_id("job")) == st["job"])
        c.check("header step", Dom.text(dom.by_id("step")) == "30 / 200", Dom.text(dom.by_id("step")))
        c.check("header health SERVING", Dom.text(dom.by_id("health")) == "SERVING")
        c.check("last update shown", "last update" in Dom.text(dom.by_id("age")), Dom.text(dom.by_id("age")))
        c.check("no banner", "hidden" in (dom.by_id("banner") or {}).get("attrs", {}))
        c.check("one pipeline: no pipelines table",
                "hidden" in (dom.by_id("pipelines-card") or {}).get("attrs", {}))
        chromium(binary, "http://127.0.0.1:%d/" % srv.port, ["--screenshot=" + args.screenshot, "--window-size=1280,1400",
                                                            "--hide-scrollbars"])
        c.check("screenshot written", os.path.getsize(args.screenshot) > 10000, args.screenshot)

    print("mode pipelines: two pipelines with the outer optimizer")
    with Server("pipelines") as srv:
        dom = Dom(chromium(binary, "http://127.0.0.1:%d/" % srv.port, ["--dump-dom"]))
        doc = pipelines_fixture(json.load(open(FIXTURE)))
        names = {w["id"]: w["name"] for w in doc["status"]["workers"]}
        rows = dom.by_class("pipeline-row")
        c.check("pipelines table shown", "hidden" not in (dom.by_id("pipelines-card") or {}).get("attrs", {}))
        c.check("a row per pipeline", [r["attrs"].get("data-pipeline") for r in rows] == ["0", "1"],
                "%d rows" % len(rows))
        for r, p in zip(rows, doc["status"]["pipeline_status"]):
            text = Dom.text(r)
            want = " → ".join(names[i] for i in p["workers"])
            c.check("pipeline %d workers, step, outer rounds" % p["pipeline"],
                    want in text and str(p["step"]) in text and str(7 - p["pipeline"]) in text, text)
        audits = Dom.text(dom.by_id("audits"))
        c.check("spot checks in the header", "hidden" not in (dom.by_id("audits-kv") or {}).get("attrs", {})
                and audits == "37 passed · 1 failed · 1 open", audits)
        failed = [Dom.text(r) for r in dom.by_class("worker-row") if "failed a spot check" in Dom.text(r)]
        c.check("the worker that failed a spot check is marked", len(failed) == 1, "; ".join(failed)[:120])

    print("mode auth: 401 without the viewer token")
    with Server("auth") as srv:
        dom = Dom(chromium(binary, "http://127.0.0.1:%d/" % srv.port, ["--dump-dom"]))
        msg = Dom.text(dom.by_id("banner"))
        c.check("token message shown", "needs a viewer token" in msg and "#token=<viewer token>" in msg
                and "geotrain-ctl token create --role=viewer" in msg, msg[:160])
        c.check("no Authorization header sent", srv.auth_headers and not any(srv.auth_headers))
        c.check("no stage nodes without access", len(dom.by_class("stage")) == 0)
    with Server("auth") as srv:
        dom = Dom(chromium(binary, "http://127.0.0.1:%d/#token=%s" % (srv.port, TOKEN), ["--dump-dom"]))
        c.check("#token= sent as Bearer on every fetch",
                srv.auth_headers and all(h == "Bearer " + TOKEN for h in srv.auth_headers),
                "%d fetches" % len(srv.auth_headers))
        c.check("renders with the token", len(dom.by_class("stage")) == 3 and "hidden" in dom.by_id("banner")["attrs"])

    print("mode flaky: one good answer, then HTTP 500")
    with Server("flaky") as srv:
        dom = Dom(chromium(binary, "http://127.0.0.1:%d/" % srv.port, ["--dump-dom"]))
        msg = Dom.text(dom.by_id("banner"))
        c.check("error banner shown", "hidden" not in dom.by_id("banner")["attrs"] and "HTTP 500" in msg, msg[:120])
        c.check("last data kept", len(dom.by_class("stage")) == 3 and path_points(dom.by_id("loss-path")) == 30)
        c.check("polls every second", srv.status_requests >= 3, "%d fetches in 5 s" % srv.status_requests)

    print("mode sparse: one step, no evals, no stages, no events")
    with Server("sparse") as srv:
        dom = Dom(chromium(binary, "http://127.0.0.1:%d/" % srv.port, ["--dump-dom"]))
        c.check("one-point loss path, no NaN", path_points(dom.by_id("loss-path")) == 1, dom.by_id("loss-path")["attrs"].get("d"))
        c.check("empty val-loss path, no NaN", path_points(dom.by_id("val-loss-path")) == 0)
        c.check("one-point throughput path", path_points(dom.by_id("throughput-path")) == 1)
        c.check("no stage nodes", len(dom.by_class("stage")) == 0 and "No stages" in Dom.text(dom.by_id("pipeline")))
        c.check("health shows NOT_SERVING", Dom.text(dom.by_id("health")) == "NOT_SERVING")
        c.check("no NaN anywhere", "NaN" not in "".join(Dom.text(e) + json.dumps(e["attrs"]) for e in dom.elements))

    print("mode swarm: 1,000 members, a page at a time")
    with Server("swarm") as srv:
        dom = Dom(chromium(binary, "http://127.0.0.1:%d/" % srv.port, ["--dump-dom"]))
        first = srv.queries[0] if srv.queries else {}
        c.check("asks for a page of 200", first.get("page_size") == ["200"] and "name" not in first, str(first))
        hrows = dom.by_class("worker-row")
        c.check("health rows: one page", len(hrows) == 200, "%d rows" % len(hrows))
        summary = Dom.text(dom.by_id("members-summary"))
        c.check("summary counts every member", "1000 members" in summary and "4 training" in summary
                and "996 standby" in summary, summary)
        rows = dom.by_class("stage-row")
        texts = [Dom.text(r) for r in rows]
        c.check("one row per stage with its count",
                len(texts) == 3 and all(t.startswith("stage %d" % k) and t.endswith("%dmembers" % n)
                                        for k, (t, n) in enumerate(zip(texts, [1, 2, 1]))),
                " | ".join(texts))
        c.check("a search box", dom.by_id("q") is not None and dom.by_id("q")["attrs"].get("type") == "search")
        c.check("more on request", "hidden" not in (dom.by_id("more") or {"attrs": {"hidden": ""}})["attrs"])
        c.check("standby line cut to 20", len(dom.by_class("standby")) <= 21,
                "%d standby names" % len(dom.by_class("standby")))
        c.check("the diagram says what it drew", "first 200 of 1000" in Dom.text(dom.by_id("pipe-notes")),
                Dom.text(dom.by_id("pipe-notes"))[:120])
    with Server("swarm") as srv:
        dom = Dom(chromium(binary, "http://127.0.0.1:%d/#q=fake-12" % srv.port, ["--dump-dom"]))
        c.check("a search asks by name", any(q.get("name") == ["fake-12"] for q in srv.queries),
                str(srv.queries[:2]))
        names = sorted(Dom.text(r).strip() for r in dom.by_class("worker-row"))
        c.check("only the members found", len(names) == 11 and all("fake-12" in n for n in names), str(names[:3]))
        c.check("says how many match", "11 match" in Dom.text(dom.by_id("members-page")),
                Dom.text(dom.by_id("members-page")))
    with Server("swarm") as srv:
        dom = Dom(chromium(binary, "http://127.0.0.1:%d/#stage=1" % srv.port, ["--dump-dom"]))
        c.check("a stage's members on demand", any(q.get("stage") == ["1"] for q in srv.queries),
                str(srv.queries[:2]))
        hrows = dom.by_class("worker-row")
        c.check("its two members listed", len(hrows) == 2 and all("fra-l4" in Dom.text(r) for r in hrows),
                "%d rows" % len(hrows))
        on = [r for r in dom.by_class("stage-row") if "on" in r["attrs"].get("class", "").split()]
        c.check("its row marked", len(on) == 1 and "stage 1" in Dom.text(on[0]))

    print("%d passed, %d failed" % (c.passed, len(c.failures)))
    return 1 if c.failures else 0


if __name__ == "__main__":
    sys.exit(main())
