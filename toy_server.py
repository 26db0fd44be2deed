"""The toy task's search tool as an HTTP server on 127.0.0.1, shaped like SearXNG's JSON API (the toy
task's docstring, toy_tools.py, gives its paths): what `--search URL` reaches, with the same results
and pages as the in-process tool.

    python toy_server.py --port 8765
"""
import argparse
import json
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

from toy_tools import N_SNIPPETS, page_text, search_results

_SERVED_PAGE = re.compile(r"/page/([0-9]{1,18})/([0-9])/([a-z]+)")  # int() of 18 digits: safe


def served_page(path):
    """The text of the page at the server's path /page/<kb>/<level>/<entity>, or None."""
    m = _SERVED_PAGE.fullmatch(path)
    return page_text(int(m.group(1)), int(m.group(2)), m.group(3)) if m and int(m.group(2)) in N_SNIPPETS else None


class _Handler(BaseHTTPRequestHandler):
    timeout = 10.0        # seconds a connection may sit silent before it is closed
    total_timeout = 30.0  # seconds a connection may last in all (one that trickles is cut too)

    def setup(self):
        super().setup()
        self.deadline = threading.Timer(self.total_timeout, self.cut)
        self.deadline.daemon = True
        self.deadline.start()

    def finish(self):
        self.deadline.cancel()
        super().finish()

    def cut(self):
        try:
            self.connection.shutdown(socket.SHUT_RDWR)  # the handler's blocked read returns
        except OSError:
            pass

    def do_GET(self):
        u = urlparse(self.path)
        qs = parse_qs(u.query)
        ctype = "application/json"
        try:
            if u.path == "/search":
                query = qs.get("q", [""])[0]
                seed, level = int(qs["kb"][0]), int(qs.get("level", ["1"])[0])
                if level not in N_SNIPPETS:
                    raise ValueError("no such level")
                results = search_results(seed, level, query)
                host, port = self.server.server_address[:2]
                for r in results:  # the pages live on this server, at its own address (not the request's Host)
                    r["url"] = f"http://{host}:{port}/page/{seed}/{level}/{r['title']}"
                code, body = 200, json.dumps({"query": query, "results": results})
            elif u.path.startswith("/page/") and (page := served_page(u.path)) is not None:
                title, text = page.split(" ", 1)
                ctype, code = "text/html; charset=utf-8", 200
                body = (f"<html><head><title>{title}</title><style>p {{margin: 0}}</style></head>"
                        f"<body><h1>{title}</h1><p>{text.replace('. ', '.<br>')}</p></body></html>")
            else:
                code, body = 404, json.dumps({"error": f"unknown path {u.path}"})
        except (KeyError, ValueError) as e:
            code, body = 400, json.dumps({"error": f"bad request: {e}"})
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):  # keep the training log clean
        pass


class ToyServer(ThreadingHTTPServer):
    """The toy search server: a thread per connection, at most `max_connections` at once (one more
    is closed at once), each cut after its handler's `timeout` of silence."""
    daemon_threads = True

    def __init__(self, address, max_connections=32):
        super().__init__(address, _Handler)
        self.slots = threading.BoundedSemaphore(max_connections)

    def process_request(self, request, client_address):
        if not self.slots.acquire(blocking=False):  # full: this connection is refused
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread to give the slot back
            self.slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


def make_server(port=0, max_connections=32):
    """A toy search server on 127.0.0.1 (port 0: any free port); call .serve_forever()."""
    return ToyServer(("127.0.0.1", port), max_connections)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="The toy search tool as an HTTP server on 127.0.0.1.")
    ap.add_argument("--port", type=int, default=8765)
    srv = make_server(ap.parse_args().port)
    print(f"toy search on http://127.0.0.1:{srv.server_address[1]}/search", flush=True)
    srv.serve_forever()
