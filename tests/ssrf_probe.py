"""Processes for tests of the SSRF guard run inside a network namespace, where the
system's resolver asks a test's own DNS server (tests/dns_server.py).

``deliver URL [--allow NETWORK ...]``: what a webhook attempt does with a callback URL
(workers/tasks/webhooks.py): the guard's check through the system resolver, then the
POST to the checked target; prints one JSON line, the checked addresses and the status,
or the refusal's reason.

``resolve HOST``: the system resolver's answer now, as JSON.

``receive --port PORT --log FILE``: an HTTP server on every address of the namespace that
answers 204 and logs, one JSON line each, the local address each request came in on
(which of the namespace's addresses the sender connected to).
"""

from __future__ import annotations

import argparse
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from core.ops.urlguard import UrlPolicy, UrlRefused, check_url, system_resolver
from workers.tasks.webhooks import post


def deliver(url: str, allowed: list[str]) -> dict[str, object]:
    policy = UrlPolicy.of(allow_http=True, allowed_networks=allowed)
    try:
        target = check_url(url, policy, system_resolver)
    except UrlRefused as exc:
        return {"refused": exc.reason, "permanent": exc.permanent}
    try:
        response = post(target, b"{}", {"Content-Type": "application/json"}, 5.0, 1024)
    except OSError as exc:
        return {"addresses": list(target.addresses), "error": f"{type(exc).__name__}: {exc}"}
    return {"addresses": list(target.addresses), "status": response.status_code}


def receive(port: int, log: Path) -> None:
    sink = log.open("a")

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", "0")))
            local = self.connection.getsockname()[0]
            entry = {"local": local, "host": self.headers.get("Host"), "path": self.path}
            sink.write(json.dumps(entry) + "\n")
            sink.flush()
            self.send_response(204)
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("0.0.0.0", port), Handler)
    print("ready", flush=True)
    server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers(dest="command", required=True)
    deliver_parser = commands.add_parser("deliver")
    deliver_parser.add_argument("url")
    deliver_parser.add_argument("--allow", action="append", default=[])
    resolve_parser = commands.add_parser("resolve")
    resolve_parser.add_argument("host")
    receive_parser = commands.add_parser("receive")
    receive_parser.add_argument("--port", type=int, required=True)
    receive_parser.add_argument("--log", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.command == "deliver":
        print(json.dumps(deliver(args.url, args.allow)), flush=True)
    elif args.command == "resolve":
        print(json.dumps(system_resolver(args.host, 80)), flush=True)
    else:
        receive(args.port, args.log)


if __name__ == "__main__":
    main()
