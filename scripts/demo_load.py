#!/usr/bin/env python3
"""Load driver and reporter for scripts/demo (standard library only).

  load    create orders and move them WAITING -> COMPLETED, concurrently, surviving outages
  health  wait until GET /health answers 200
  quiet   poll GET /stats until nothing is left in flight
  report  print the delivery report from GET /stats and the load summary

The load is written to be correct across a crash of the service: every request that got no
answer is settled before it is repeated. A create carries an Idempotency-Key, so repeating it
returns the order the first attempt made. A status change is never repeated blindly: the
driver first reads the order back, since the change may have committed just before the crash.
"""

import argparse
import http.client
import json
import os
import random
import sys
import threading
import time
import urllib.parse

TRANSPORT_ERRORS = (OSError, http.client.HTTPException)


class Fatal(Exception):
    """An answer the service must never give; the demo fails."""


class Client:
    """One keep-alive connection; reopened after any transport error."""

    def __init__(self, base, timeout=10.0):
        url = urllib.parse.urlsplit(base)
        self.host, self.port, self.timeout = url.hostname, url.port, timeout
        self.conn = None

    def close(self):
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def request(self, method, path, body=None, headers=None):
        if self.conn is None:
            self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        data = None if body is None else json.dumps(body).encode()
        hdrs = {"Content-Type": "application/json"} if data is not None else {}
        hdrs.update(headers or {})
        try:
            self.conn.request(method, path, body=data, headers=hdrs)
            resp = self.conn.getresponse()
            raw = resp.read()
        except TRANSPORT_ERRORS:
            self.close()
            raise
        try:
            parsed = json.loads(raw) if raw else None
        except ValueError:
            parsed = {"raw": raw.decode(errors="replace")}
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, parsed


class Counters:
    def __init__(self):
        self.lock = threading.Lock()
        self.values = {}

    def bump(self, name, n=1):
        with self.lock:
            self.values[name] = self.values.get(name, 0) + n

    def get(self, name):
        with self.lock:
            return self.values.get(name, 0)

    def snapshot(self):
        with self.lock:
            return dict(self.values)


class Driver:
    def __init__(self, args):
        self.base = args.url
        self.total = args.orders
        self.concurrency = args.concurrency
        self.deadline = args.op_deadline
        self.run_id = "%x" % random.getrandbits(40)
        self.counters = Counters()
        self.next_index = 0
        self.index_lock = threading.Lock()
        self.failure = None

    def take_index(self):
        with self.index_lock:
            if self.next_index >= self.total or self.failure is not None:
                return None
            i = self.next_index
            self.next_index += 1
            return i

    def pause(self, attempt):
        time.sleep(min(0.05 * (2 ** attempt), 0.5))

    def call(self, client, method, path, body=None, headers=None):
        """One request; None when there was no answer (or a 5xx) and the outcome is unknown."""
        self.counters.bump("requests")
        try:
            status, hdrs, js = client.request(method, path, body, headers)
        except TRANSPORT_ERRORS:
            self.counters.bump("transport_errors")
            return None
        if status >= 500:
            self.counters.bump("server_errors")
            return None
        return status, hdrs, js

    def get_status(self, client, order_id, started):
        """The order's status, waiting out an outage."""
        attempt = 0
        while time.monotonic() - started < self.deadline:
            answer = self.call(client, "GET", "/orders/%s" % order_id)
            if answer is None:
                self.pause(attempt)
                attempt += 1
                continue
            status, _, js = answer
            if status == 200:
                return js["status"]
            raise Fatal("GET /orders/%s -> %s %s" % (order_id, status, js))
        raise Fatal("order %s: no answer within %ss" % (order_id, self.deadline))

    def create(self, client, i):
        key = "demo-%s-%d" % (self.run_id, i)
        body = {"customer_id": "c%d" % random.randrange(1000), "total_cents": random.randrange(100, 100000)}
        headers = {"Idempotency-Key": key, "X-Request-Id": key + "-create"}
        started, attempt = time.monotonic(), 0
        while time.monotonic() - started < self.deadline:
            answer = self.call(client, "POST", "/orders", body, headers)
            if answer is None:
                # Safe to repeat as is: the key makes a second create return the first order.
                if attempt == 0:
                    self.counters.bump("creates_repeated")
                self.pause(attempt)
                attempt += 1
                continue
            status, hdrs, js = answer
            if status == 201 and js.get("status") == "WAITING":
                if hdrs.get("idempotent-replayed") == "true":
                    self.counters.bump("creates_replayed")
                self.counters.bump("created")
                return js["id"]
            raise Fatal("POST /orders -> %s %s" % (status, js))
        raise Fatal("create %s: no answer within %ss" % (key, self.deadline))

    def complete(self, client, order_id, i):
        headers = {"X-Request-Id": "demo-%s-%d-complete" % (self.run_id, i)}
        path = "/orders/%s/status" % order_id
        started, attempt = time.monotonic(), 0
        while time.monotonic() - started < self.deadline:
            answer = self.call(client, "POST", path, {"status": "COMPLETED"}, headers)
            if answer is not None:
                status, _, js = answer
                if status == 200 and js.get("status") == "COMPLETED":
                    self.counters.bump("completed")
                    return
                code = ((js or {}).get("error") or {}).get("code")
                if status == 422 and code == "INVALID_TRANSITION":
                    if self.get_status(client, order_id, started) == "COMPLETED":
                        self.counters.bump("already_completed")
                        self.counters.bump("completed")
                        return
                raise Fatal("POST %s -> %s %s" % (path, status, js))
            # No answer: the change may have committed. Repeating it blindly would be refused
            # at best and a second transition at worst, so settle the first attempt first.
            self.pause(attempt)
            attempt += 1
            if self.get_status(client, order_id, started) == "COMPLETED":
                self.counters.bump("confirmed_by_read")
                self.counters.bump("completed")
                return
            self.counters.bump("status_changes_repeated")
        raise Fatal("complete %s: no answer within %ss" % (order_id, self.deadline))

    def worker(self):
        client = Client(self.base)
        try:
            while True:
                i = self.take_index()
                if i is None:
                    return
                order_id = self.create(client, i)
                self.complete(client, order_id, i)
        except Fatal as e:
            self.failure = str(e)
        except Exception as e:  # a driver bug must fail the demo, not hang it
            self.failure = "driver error: %r" % (e,)
        finally:
            client.close()


def write_atomic(path, text):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def cmd_load(args):
    d = Driver(args)
    threads = [threading.Thread(target=d.worker, daemon=True) for _ in range(d.concurrency)]
    started = time.monotonic()
    for t in threads:
        t.start()
    last_print, last_requests = started, 0
    while any(t.is_alive() for t in threads):
        time.sleep(0.05)
        c = d.counters
        if args.progress_file:
            write_atomic(args.progress_file, "%d\n" % c.get("completed"))
        now = time.monotonic()
        if now - last_print >= args.progress_every:
            requests = c.get("requests")
            rate = (requests - last_requests) / (now - last_print)
            print(
                "[load] %5d/%d orders completed, %5d created | %5.0f req/s | %d requests without an answer"
                % (c.get("completed"), d.total, c.get("created"), rate,
                   c.get("transport_errors") + c.get("server_errors")),
                flush=True,
            )
            last_print, last_requests = now, requests
    elapsed = time.monotonic() - started
    if args.progress_file:
        write_atomic(args.progress_file, "%d\n" % d.counters.get("completed"))
    summary = d.counters.snapshot()
    summary.update({"orders": d.total, "seconds": round(elapsed, 2), "failure": d.failure})
    if args.summary:
        write_atomic(args.summary, json.dumps(summary))
    print(
        "[load] done: %d/%d orders completed in %.1fs (%d requests, %.0f req/s)"
        % (summary.get("completed", 0), d.total, elapsed, summary.get("requests", 0),
           summary.get("requests", 0) / max(elapsed, 1e-9)),
        flush=True,
    )
    if d.failure is not None or summary.get("completed", 0) != d.total:
        print("[load] FAILED: %s" % (d.failure or "not every order was completed"), file=sys.stderr)
        return 1
    return 0


def fetch_stats(client):
    status, _, js = client.request("GET", "/stats")
    if status != 200:
        raise Fatal("GET /stats -> %s %s" % (status, js))
    return js


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def cmd_health(args):
    client = Client(args.url, timeout=2)
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        if args.pid and not alive(args.pid):
            print("[demo] the service (pid %d) exited" % args.pid, file=sys.stderr)
            return 1
        try:
            status, _, _ = client.request("GET", "/health")
            if status == 200:
                return 0
        except TRANSPORT_ERRORS:
            pass
        time.sleep(0.1)
    print("[demo] the service did not become healthy within %ss" % args.timeout, file=sys.stderr)
    return 1


def in_flight(s):
    jobs = s["notification_jobs"]
    return {
        "outbox pending": s["outbox_pending"],
        "inbox open": s["inbox_open"],
        "jobs pending": jobs.get("PENDING", 0) + jobs.get("SENDING", 0),
        "completed without job": s["drift"]["completed_without_notification"],
    }


def cmd_quiet(args):
    client = Client(args.url)
    started = time.monotonic()
    quiet_polls, last_print, s = 0, 0.0, None
    while time.monotonic() - started < args.deadline:
        try:
            s = fetch_stats(client)
        except TRANSPORT_ERRORS:
            time.sleep(0.5)
            continue
        left = in_flight(s)
        # Twice in a row: a reconcile run or a job retry may be about to add work.
        quiet_polls = quiet_polls + 1 if not any(left.values()) else 0
        if quiet_polls >= 2:
            print("[quiet] quiet after %.1fs" % (time.monotonic() - started), flush=True)
            return 0
        now = time.monotonic()
        if now - last_print >= args.progress_every:
            print("[quiet] %s" % ", ".join("%s %d" % kv for kv in left.items()), flush=True)
            last_print = now
        time.sleep(0.5)
    print("[quiet] still busy after %ss: %s" % (args.deadline, in_flight(s) if s else "no stats"),
          file=sys.stderr)
    return 1


def cmd_report(args):
    s = fetch_stats(Client(args.url))
    load = {}
    if args.summary and os.path.exists(args.summary):
        with open(args.summary) as f:
            load = json.load(f)
    consumers = sorted(s["inbox"])
    by_source = s["orders_by_source"]
    imported = sum(n for src, n in by_source.items() if src != "api")
    dup = s["duplicates_absorbed"]
    retries = s["inbox_retries"]
    dead = s["dead_letters"]
    lat = s["latency_ms"]
    jobs = s["notification_jobs"]
    rec = s["reconcile"]
    # Both from the jobs the repairs made (each commits on its own); reconcile_runs is written at
    # a run's end, so a run cut off by the crash is missing from its figures.
    repairs = s["reconcile_repairs_by_source"]
    imported_repaired = sum(n for src, n in repairs.items() if src != "api")
    api_repaired = repairs.get("api", 0)

    def fmt_lat(name):
        l = lat.get(name) or {}
        return "p50 %s ms, p99 %s ms" % (l.get("p50"), l.get("p99"))

    rows = [
        ("orders", "%d (%d through the API, %d written around it without events); %s" % (
            sum(s["orders"].values()), by_source.get("api", 0), imported,
            ", ".join("%s %d" % kv for kv in sorted(s["orders"].items())))),
        ("events written", "%d ORDER_STATUS_CHANGED (%s); outbox: %s" % (
            s["events_written"], ", ".join("%s %d" % kv for kv in sorted(s["events_by_status"].items())),
            ", ".join("%s %d" % kv for kv in sorted(s["outbox"].items())))),
        ("delivered", "; ".join("%s %d PROCESSED" % (c, s["inbox"][c].get("PROCESSED", 0)) for c in consumers)),
        ("duplicates absorbed", "%d repeated handler calls (redeliveries after the crash and batches "
            "replayed after a failure; their effects rolled back, never repeated); "
            "%d events whose notification already existed (idempotency key); "
            "%d repeated creates answered with the order their first attempt made" % (
            dup["redeliveries"], dup["idempotency_keys"], load.get("creates_replayed", 0))),
        ("retries", "inbox %d (%s); provider sends %d" % (
            sum(retries.values()), ", ".join("%s %d" % (c, retries.get(c, 0)) for c in consumers),
            s["notification_send_retries"])),
        ("dead letters", "%d (outbox %d, inbox %d)" % (dead["outbox"] + dead["inbox"], dead["outbox"], dead["inbox"])),
        ("drift repaired", "%d notifications made by the reconciler over %d recorded runs (%d for orders "
            "written around the service, never announced; %d for orders that had events)" % (
            imported_repaired + api_repaired, rec["runs"], imported_repaired, api_repaired)),
        ("delivery latency", "%s (%s)" % (fmt_lat("all"), "; ".join("%s %s" % (c, fmt_lat(c)) for c in consumers))),
        ("notification jobs", ", ".join("%s %d" % kv for kv in sorted(jobs.items())) + " (created by %s)" % (
            ", ".join("%s %d" % kv for kv in sorted(s["notification_jobs_by_creator"].items())))),
        ("analytics", ", ".join("%s %d" % kv for kv in sorted(s["analytics"].items()))),
    ]
    if load:
        rows.append(("load", "%d requests in %.1fs; %d without an answer; creates repeated %d; status "
                     "changes found committed by a read-back %d, repeated after one %d, refused as "
                     "already COMPLETED %d" % (
                         load.get("requests", 0), load.get("seconds", 0),
                         load.get("transport_errors", 0) + load.get("server_errors", 0),
                         load.get("creates_repeated", 0), load.get("confirmed_by_read", 0),
                         load.get("status_changes_repeated", 0), load.get("already_completed", 0))))
    width = max(len(k) for k, _ in rows)
    print("== delivery report ==")
    for k, v in rows:
        print("  %-*s  %s" % (width, k, v))
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    load = sub.add_parser("load")
    load.add_argument("--url", required=True)
    load.add_argument("--orders", type=int, default=2000)
    load.add_argument("--concurrency", type=int, default=16)
    load.add_argument("--op-deadline", type=float, default=120.0,
                      help="seconds one order may take, outages included")
    load.add_argument("--progress-file")
    load.add_argument("--progress-every", type=float, default=2.0)
    load.add_argument("--summary")
    health = sub.add_parser("health")
    health.add_argument("--url", required=True)
    health.add_argument("--timeout", type=float, default=60.0)
    health.add_argument("--pid", type=int, help="give up as soon as this process has exited")
    quiet = sub.add_parser("quiet")
    quiet.add_argument("--url", required=True)
    quiet.add_argument("--deadline", type=float, default=180.0)
    quiet.add_argument("--progress-every", type=float, default=3.0)
    report = sub.add_parser("report")
    report.add_argument("--url", required=True)
    report.add_argument("--summary")
    args = p.parse_args()
    try:
        return {"load": cmd_load, "health": cmd_health, "quiet": cmd_quiet, "report": cmd_report}[args.cmd](args)
    except Fatal as e:
        print("[demo] %s" % e, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
