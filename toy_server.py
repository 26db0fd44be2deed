"""The toy task's search tool as an HTTP server on 127.0.0.1, shaped like SearXNG's JSON API (the toy
task's docstring, toy_tools.py, gives its paths): what `--search URL` reaches, with the same results
and pages as the in-process tool. Its server (`Server`: a thread per connection, deadlines, room made
by closing the oldest connection that has not sent its request) serves retriever.py's index too.

    python toy_server.py --port 8765
"""
import argparse
import json
import re
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

from toy_tools import N_SNIPPETS, page_text, search_results

_SERVED_PAGE = re.compile(r"/page/([0-9]{1,18})/([0-9])/([a-z]+)")  # int() of 18 digits: safe


def served_page(path):
    """The text of the page at the server's path /page/<kb>/<level>/<entity>, or None."""
    m = _SERVED_PAGE.fullmatch(path)
    return page_text(int(m.group(1)), int(m.group(2)), m.group(3)) if m and int(m.group(2)) in N_SNIPPETS else None


def cut(sock):
    """End a connection that another thread may be reading: its blocked read returns, and that thread closes it."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class DeadlineHandler(BaseHTTPRequestHandler):
    """A handler whose connection is cut after `timeout` seconds of silence or `total_timeout` in all.
    A subclass calls self.server.working(self.request) once it holds its whole request."""
    timeout = 10.0        # seconds a connection may sit silent before it is closed
    total_timeout = 30.0  # seconds a connection may last in all (one that trickles is cut too)

    def setup(self):
        super().setup()
        self.cut_at = time.monotonic() + self.total_timeout  # work past it is for nobody
        self.deadline = threading.Timer(self.total_timeout, cut, (self.connection,))
        self.deadline.daemon = True
        self.deadline.start()

    def finish(self):
        self.deadline.cancel()
        super().finish()

    def log_message(self, *args):  # keep the training log clean
        pass


class _Handler(DeadlineHandler):
    def do_GET(self):
        self.server.working(self.request)
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


class Server(ThreadingHTTPServer):
    """A thread per connection, at most `max_connections` of them: at the bound, the oldest connection
    that has not yet sent its whole request is closed to make room for the new one.

    Why: anyone can open connections and send nothing, or half a request. A server that refuses
    connections past its bound is locked by as many idle sockets until their timeouts; one that never
    bounds them runs out of threads and file descriptors. Closing the oldest waiting connection keeps
    the bound and lets idle sockets push out only each other, while a client that sends its request at
    once is answered. A connection whose request is in (`working`) is never closed for room: its answer
    is near. Threads, not an event loop, keep each handler plain blocking code; each connection's
    deadlines (DeadlineHandler) end the ones that stall."""
    daemon_threads = True
    request_queue_size = 128  # connections the kernel queues until accepted (socketserver's default: 5)

    def __init__(self, address, handler, max_connections=64):
        super().__init__(address, handler)
        self.max_connections, self.lock = max_connections, threading.Lock()
        self.connections = {}  # each open connection -> True while it waits for its request; oldest first

    def process_request(self, request, client_address):
        with self.lock:
            if len(self.connections) >= self.max_connections:
                oldest = next((c for c, waits in self.connections.items() if waits), None)
                if oldest is None:  # every connection is being answered: this one waits for none
                    self.shutdown_request(request)
                    return
                del self.connections[oldest]
                cut(oldest)
            self.connections[request] = True
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started to forget it
            self.forget(request)
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.forget(request)

    def working(self, request):
        """The handler holds its whole request: from now on the connection is not closed for room."""
        with self.lock:
            if request in self.connections:
                self.connections[request] = False

    def forget(self, request):
        with self.lock:
            self.connections.pop(request, None)

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], OSError):  # a connection cut (room, deadline, client) is no error
            super().handle_error(request, client_address)


def make_server(port=0, max_connections=64):
    """A toy search server on 127.0.0.1 (port 0: any free port); call .serve_forever()."""
    return Server(("127.0.0.1", port), _Handler, max_connections)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="The toy search tool as an HTTP server on 127.0.0.1.")
    ap.add_argument("--port", type=int, default=8765)
    srv = make_server(ap.parse_args().port)
    print(f"toy search on http://127.0.0.1:{srv.server_address[1]}/search", flush=True)
    srv.serve_forever()
