"""Model output, search servers and pages are untrusted input: toy_tools takes any of it.

Invalid model output is format 0 (the parser returns None), a bad tool argument or a bad
server is a SearchError (an observation for the agent); nothing else is ever raised, all in
linear time, and a server can hold no request past its deadline nor hand it unbounded data.
"""
import collections
import contextlib
import json
import random
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import helpers
import mgrpo
import retriever
import tools
import toy_server
import toy_tools as tt

WHO = ("main", "sub", "single")
# what a parsed argument must never hold: a tag of either format, open or closed
TAG_IN_ARG = re.compile(r"</?(?:think|call|answer|search|return|tool_call|tool_response)", re.I)


def utf8_ok(s):
    """Whether s reaches a tokenizer, a JSON encoder or an HTTP client without a UnicodeEncodeError."""
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


@contextlib.contextmanager
def serving(respond):
    """A throwaway HTTP server on 127.0.0.1; respond(handler) writes each whole answer. Yields its url."""
    class H(BaseHTTPRequestHandler):
        calls = 0

        def do_GET(self):
            H.calls += 1
            try:
                respond(self)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up on us, as it should

        def do_POST(self):  # the /retrieve client (tests/test_retriever.py) posts
            # its body read first (respond finds it in self.body): closing a connection with unread bytes
            # resets it, and the client would see a reset instead of the answer
            self.body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.do_GET()

        def log_message(self, *args):
            pass
    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", H
    finally:
        srv.shutdown()
        srv.server_close()


def answer(h, code, body, **headers):
    data = body if isinstance(body, bytes) else body.encode()
    h.send_response(code)
    for k, v in {"Content-Length": str(len(data)), **headers}.items():
        h.send_header(k.replace("_", "-"), v)
    h.end_headers()
    h.wfile.write(data)


# ---------------------------------------------------------------------------------------
# The known failures, one test each
# ---------------------------------------------------------------------------------------
def test_a_lone_surrogate_argument_is_format_zero_and_seeds_take_any_str():
    """json.loads turns "\\ud800" into a lone surrogate, which later broke the search client,
    stable_seed and tokenizers: such an argument is invalid."""
    for body in ('{"name": "search", "arguments": {"query": "ada \\ud800"}}',
                 '{"name": "visit", "arguments": {"url": "http://x/\\udfff"}}'):
        assert tools.parse_chat_action(f"<tool_call>{body}</tool_call>", "sub") is None
    assert tools.parse_chat_action("<answer> a\ud800 </answer>", "main") is None
    assert tools.parse_action("<search> ada\udc80 </search>", tools.TAGS["sub"]) is None
    for parts in [("\ud800",), (1, "sub", "\udfff\ud800", 3)]:
        assert 0 <= tools.stable_seed(*parts) < 2 ** 32
    assert tools.stable_seed("ada", 1) == tools.stable_seed("ada", 1) != tools.stable_seed("ada\ud800", 1)
    assert tt.search_results(1, 1, "ada \ud800")  # the in-process search takes it too


def test_deeply_nested_json_is_format_zero():
    for body in ("[" * 100_000, '{"a": ' * 50_000, '{"name": "search", "arguments": ' + "[" * 100_000):
        assert tools.parse_chat_action(f"<tool_call>{body}</tool_call>", "sub") is None


def test_a_page_url_with_thousands_of_digits_is_a_search_error():
    for url in ("toy://page/" + "9" * 5000 + "/1/ada", "toy://page/" + "a" * 100_000, "toy://page/1/1/ada",
                "http://h/page/" + "1" * 100_000 + "/2/bo"):
        with pytest.raises(tools.SearchError, match="not a page"):
            tt.ToySearch().visit(url, 1, 1, allowed=[url])
    for path in ("/page/" + "1" * 100_000 + "/2/bo", "/page/1/" + "1" * 5000 + "/ada", "/page/1/9/ada"):
        assert toy_server.served_page(path) is None  # the server's pages name their world: int() of 18 digits at most
    assert toy_server.served_page("/page/1/1/ada").startswith("ada. ada lives")


@pytest.mark.parametrize("text,tags", [
    ("<answer>a</answer><answer>b</answer>", tools.TAGS["main"]),
    ("<call><answer> x </answer></call>", tools.TAGS["main"]),
    ("<call> city of ada </call> <call> city of bo </call>", tools.TAGS["main"]),
    ("<search> ada <return> bo </return> </search>", tools.TAGS["sub"]),
    ("<search> ada </return> <search> bo </search>", tools.TAGS["sub"]),
    ("<return> a <think> b </return>", tools.TAGS["sub"]),
    ("<think> <answer> a </answer> </think> <call> b </call>", tools.TAGS["main"]),
    ("<think> a </think> <think> b </think> <answer> c </answer>", tools.TAGS["main"]),
    ("<answer> <tool_call> x </answer>", tools.TAGS["main"]),
    ("<answer> a <|im_start|>user x </answer>", tools.TAGS["main"]),
    ("<answer> a <USER> b </answer>", tools.TAGS["main"]),
])
def test_a_tag_inside_the_argument_or_a_second_action_is_format_zero(text, tags):
    assert tools.parse_action(text, tags) is None


@pytest.mark.parametrize("text", [
    "<answer>a</answer><answer>b</answer>",
    "<answer> a </answer> <answer> b </answer>",
    "<answer> <call> x </call> </answer>",
    "<answer> a </tool_call> <tool_call> b </answer>",
    "<answer> x <tool_response> y </answer>",
    '<tool_call>{"name": "search", "arguments": {"query": "<answer> x </answer>"}}</tool_call>',
    '<tool_call>{"name": "search", "arguments": {"query": "\\u003canswer> x"}}</tool_call>',
    '<tool_call>{"name": "search", "arguments": {"query": "a"}, "x": "<answer> b </answer>"}</tool_call>',
    '<tool_call>{"name": "search", "arguments": {"query": "a </tool_call>"}}</tool_call>',
])
def test_a_tag_inside_a_chat_argument_or_a_second_chat_action_is_format_zero(text):
    for who in WHO:
        assert tools.parse_chat_action(text, who) is None


def test_valid_actions_still_parse():
    assert tools.parse_action("  <think> hm, a < b </think>\n<call> city  of ada </call>\n", tools.TAGS["main"]) == \
        ("call", "city of ada")
    assert tools.parse_action("<answer> a > b & c </answer>", tools.TAGS["main"]) == ("answer", "a > b & c")
    assert tools.parse_chat_action("I think </answer> is it.\n<answer> Norland </answer>\n", "main") == \
        ("answer", "Norland")
    call = '<tool_call>{"name": "search", "arguments": {"query": "ada \\u00e9 < b"}}</tool_call>'
    assert tools.parse_chat_action(call, "single") == ("search", "ada \u00e9 < b")


ADVERSARIAL_ACTIONS = {  # text of n characters -> a turn that made the old regexes backtrack, or could
    "leading spaces": lambda n: " " * n + "x",
    "unclosed thinks": lambda n: "<think>" * (n // 7),
    "open think, spaces": lambda n: "<think>" + " " * n,
    "closings, spaces": lambda n: "<call>" + "</call> " * (n // 8) + "x",
    "prefix text": lambda n: "ab " * (n // 3),
    "open answer, closings": lambda n: "<answer>" + "</answer> " * (n // 10) + "x",
    "tool calls": lambda n: "<tool_call>" * (n // 11),
    "open tool call, brackets": lambda n: "<tool_call>" + "[" * n + "</tool_call>",
}
ADVERSARIAL_PAGES = {
    "unclosed <": lambda n: "<" * n,
    "unclosed <script": lambda n: "<script" * (n // 7),
    "open <script>": lambda n: "<script>" + "<a>" * (n // 3),
    "<a without >": lambda n: "<a " * (n // 3),
    "many heads": lambda n: "<head><p>" * (n // 9),
    "ampersands": lambda n: "&#" * (n // 2),
    "a long charref": lambda n: "&#" + "9" * n,
}


def _seconds(f, text):
    best = float("inf")
    for _ in range(3):  # best of three: a loaded machine only ever adds time
        t0 = time.perf_counter()
        f(text)
        best = min(best, time.perf_counter() - t0)
    return best


@pytest.mark.parametrize("name", list(ADVERSARIAL_ACTIONS) + list(ADVERSARIAL_PAGES))
def test_parsers_and_html_text_take_linear_time(name):
    """1 MB of adversarial text in seconds at most, and 4x the text takes well under the 16x of a
    quadratic scan (the bounds leave room for a busy machine)."""
    make = ADVERSARIAL_ACTIONS.get(name) or ADVERSARIAL_PAGES[name]
    fs = ([lambda s: tools.parse_action(s, tools.TAGS["main"]), lambda s: tools.parse_chat_action(s, "sub")]
          if name in ADVERSARIAL_ACTIONS else [tools.html_text])
    for f in fs:
        assert _seconds(f, make(64_000)) < 1.0  # a quadratic scan takes seconds here already
        quarter, whole = _seconds(f, make(250_000)), _seconds(f, make(1_000_000))
        assert whole < 5.0 and whole < 8 * quarter + 0.3, (name, quarter, whole)


def test_html_text_of_hostile_pages():
    assert tools.html_text("&#" + "9" * 5000 + "; a &#65; &#x110000;") == "\ufffd a A \ufffd"
    assert tools.html_text("a <script> x <b>b</b> c") == "a x b c"  # never closed: only its tag goes
    assert tools.html_text("<SCRIPT>x()</script >y</SCRIPT>z<p>1 <> 2</p> 3 < 4") == "z 1 <> 2 3 < 4"
    assert tools.html_text("a <!-- b < c --> d < e") == "a d < e"  # a tag ends at the first '>', as before
    assert tools.html_text("<header>h</header><head>x</head>b") == "h b"


def trickle(h):
    """An answer of one byte every 0.2 s, 4 s in all (each read is quick: only a total deadline ends it)."""
    h.send_response(200)
    h.send_header("Content-Length", "20")
    h.end_headers()
    for _ in range(20):
        h.wfile.write(b"x")
        h.wfile.flush()
        time.sleep(0.2)


def test_a_trickling_server_cannot_hold_a_request():
    """One byte every 0.2 s: each read is quick, so a per-read timeout never fires; the total
    deadline ends the request at about timeout + one read."""
    with serving(trickle) as (url, _):
        for call in (lambda: tools.HttpSearch(url, timeout=0.5, retries=0).search("ada", 1, 1),
                     lambda: tools.HttpSearch(url, timeout=0.5, retries=0, visit_hosts={"127.0.0.1"}).visit(url + "/p")):
            t0 = time.monotonic()
            with pytest.raises(tools.SearchError, match="Timeout"):
                call()
            assert time.monotonic() - t0 < 1.5


def trickled_headers(h):
    """A status line, then header lines a byte every 0.1 s for 6 s: no read waits long, and the body's own
    deadline check never comes."""
    h.wfile.write(b"HTTP/1.1 200 OK\r\n")
    for b in (b"X-Slow: " + b"x" * 55 + b"\r\n"):
        h.wfile.write(bytes([b]))
        h.wfile.flush()
        time.sleep(0.1)


def test_a_server_that_trickles_its_headers_cannot_hold_a_request():
    """The deadline holds while the headers come in too (a watchdog shuts the connection down at it): a client
    with a 0.5 s deadline was held for over 15 s by headers sent a byte every 0.2 s."""
    with serving(trickled_headers) as (url, _):
        for call in (lambda: tools.HttpSearch(url, timeout=0.5, retries=0).search("ada", 1, 1),
                     lambda: retriever.RetrieveClient(url + "/retrieve", timeout=0.5, retries=0).search("ada")):
            t0 = time.monotonic()
            with pytest.raises(tools.SearchError, match="Timeout"):
                call()
            assert time.monotonic() - t0 < 1.5
    assert threading.active_count() < 20  # the watchdogs of finished requests do not pile up


def test_responses_and_pages_are_capped():
    """A search body over max_bytes is a SearchError; a page is cut at max_bytes; a compressed
    body (asked for none) is refused: no decompression bombs."""
    big = json.dumps({"results": [{"url": "u", "title": "t", "content": "a" * 5_000_000}]})

    def respond(h):
        if h.path.startswith("/search"):
            answer(h, 200, big, Content_Type="application/json")
        elif h.path == "/gzip":
            answer(h, 200, b"\x1f\x8b" + b"\0" * 100, Content_Encoding="gzip")
        else:
            answer(h, 200, "word " * 1_000_000, Content_Type="text/plain")
    with serving(respond) as (url, _):
        search = tools.HttpSearch(url, retries=0, max_bytes=100_000, visit_hosts={"127.0.0.1"})
        with pytest.raises(tools.SearchError, match="over 100000 bytes"):
            search.search("ada", 1, 1)
        page = search.visit(url + "/page", max_chars=10 ** 9)
        assert 90_000 < len(page) <= 100_000 and set(page.split()) == {"word"}
        with pytest.raises(tools.SearchError, match="compressed"):
            search.visit(url + "/gzip")
        with pytest.raises(tools.SearchError, match="over 2000000 bytes"):  # the default cap
            tools.HttpSearch(url, retries=0).search("ada", 1, 1)
        assert len(tools.HttpSearch(url, retries=0, max_bytes=10 ** 7).search("ada", 1, 1)[0]["content"]) == 5_000_000


@pytest.mark.parametrize("body", [
    {"results": [{"url": "u", "title": 5, "content": "c"}]},
    {"results": [{"url": "u", "title": "t", "content": {"a": 1}}]},
    {"results": [{"url": ["u"], "title": "t", "content": "c"}]},
    {"results": [{"url": "u", "title": "t", "content": True}]},
    {"results": {"a": 1}},
    {"results": [[1, 2]]},
    {"results": ["u"]},
    {"results": None},
    {"results": "abc"},
    [{"results": []}],
    {"no results": []},
    "[" * 100_000,
    '{"results": ' + "[" * 100_000,
    '{"results": [{"title": "' + "1" * 5000,
    "1" * 5000,
])
def test_wrongly_typed_or_deeply_nested_results_are_search_errors(body):
    text = body if isinstance(body, str) else json.dumps(body)
    with serving(lambda h: answer(h, 200, text)) as (url, _):
        with pytest.raises(tools.SearchError, match="no SearXNG-style results"):
            tools.HttpSearch(url, retries=0).search("ada", 1, 1)


def test_outside_text_comes_back_as_valid_utf8():
    """JSON escapes, charsets and HTML entities can make lone surrogates; the observations and
    pages an agent reads must be text any tokenizer takes."""
    body = '{"results": [{"url": "u\\ud800", "title": "\\udfff", "content": "a\\ud800b"}, {"url": "v"}]}'
    pages = {"/unicode_escape": ("text/html; charset=unicode_escape", b"<p>x \\ud800 y</p>"),
             "/bogus": ("text/plain; charset=no-such-charset", "caf\u00e9".encode()),
             "/latin": ("text/plain; charset=latin-1", "caf\u00e9".encode("latin-1")),
             "/bytes": ("text/plain", bytes(range(256)))}

    def respond(h):
        ctype, data = pages.get(h.path, ("application/json", body.encode()))
        answer(h, 200, data, Content_Type=ctype)
    with serving(respond) as (url, _):
        results = tools.HttpSearch(url, retries=0).search("ada \ud800", 1, 1)  # the query too: no UnicodeEncodeError
        assert [r["content"] for r in results] == ["a?b", ""] and results[1] == {"url": "v", "title": "", "content": ""}
        texts = [tools.HttpSearch(url, retries=0, visit_hosts={"127.0.0.1"}).visit(url + p) for p in pages]
        assert texts[1:3] == ["caf\u00e9", "caf\u00e9"]
    for s in texts + [tools.search_observation(results), tools.search_observation(results, chat=True),
                      tools.search_observation([{"url": "\ud800", "title": "t\udc80", "content": "\udfff"}], chat=True)]:
        assert isinstance(s, str) and utf8_ok(s), s


def test_visit_fetches_only_the_trajectorys_own_results(server_url):
    http, local = tools.HttpSearch(server_url, retries=0, timeout=2), tt.ToySearch()
    results = http.search("ada", 1, 1)
    page, urls = results[0]["url"], [r["url"] for r in results]
    assert http.visit(page, allowed=urls).startswith(results[0]["title"] + ".")
    for url in (page, server_url + "/page/1/1/bo", "http://169.254.169.254/latest/meta-data/",
                "http://127.0.0.1:9/", "http://localhost:22/", "https://example.com/"):
        with pytest.raises(tools.SearchError, match="not among this trajectory's search results"):
            http.visit(url)  # nothing is allowed by default
        with pytest.raises(tools.SearchError, match="not among this trajectory's search results"):
            http.visit(url, allowed=[u for u in urls if u != url])
    toy = local.search("ada", 1, 1)[0]["url"]
    with pytest.raises(tools.SearchError, match="not among"):
        local.visit(toy, 1, 1)
    assert local.visit(toy, 1, 1, allowed={toy}) == http.visit(page, allowed={page})
    # hosts the user allows: any page there, but a URL that merely names the host is not on it
    trusting = tools.HttpSearch(server_url, retries=0, timeout=2, visit_hosts={"127.0.0.1"})
    assert trusting.visit(server_url + "/page/1/1/bo").startswith("bo. bo lives")
    for sneaky in ("http://evil.invalid\\@127.0.0.1/page/1/1/bo", "http://127.0.0.1@evil.invalid/page/1/1/bo",
                   "http://127.0.0.1.evil.invalid/"):
        with pytest.raises(tools.SearchError, match="not among"):
            trusting.visit(sneaky)


def test_redirects_stay_on_the_same_host_and_are_few():
    def respond(h):
        port = h.server.server_address[1]
        where = {"/elsewhere": "http://127.0.0.2:%d/ok" % port, "/other-port": "http://127.0.0.1:9/ok",
                 "/userinfo": "http://127.0.0.1@evil.invalid:%d/ok" % port, "/loop": "/loop",
                 "/hop": "/hop2", "/hop2": "ok", "/https": "https://127.0.0.1/ok", "/downgrade": "ftp://127.0.0.1/ok"}
        if h.path in where or h.path.startswith("/search"):
            answer(h, 302, "", Location=where.get(h.path, "/ok"))
        else:
            answer(h, 200, "<p>the page</p>", Content_Type="text/html")
    with serving(respond) as (url, H):
        search = tools.HttpSearch(url, retries=0, timeout=2)
        for path in ("/elsewhere", "/other-port", "/userinfo", "/downgrade"):
            with pytest.raises(tools.SearchError, match="redirects elsewhere"):
                search.visit(url + path, allowed=[url + path])
        assert search.visit(url + "/hop", allowed=[url + "/hop"]) == "the page"  # relative, same host
        H.calls = 0
        with pytest.raises(tools.SearchError, match="too often"):
            search.visit(url + "/loop", allowed=[url + "/loop"])
        assert H.calls == 4  # the first request and 3 redirects
        with pytest.raises(tools.SearchError, match="not reachable"):  # up to https is allowed (nothing listens)
            search.visit(url + "/https", allowed=[url + "/https"])
        with pytest.raises(tools.SearchError, match="answered 302"):  # a search follows none
            search.search("ada", 1, 1)


# ---------------------------------------------------------------------------------------
# Fuzz: every parser, checker and tool on random and mutated strings
# ---------------------------------------------------------------------------------------
# 12,043 strings: 2,000 random byte strings decoded with 'replace', 1,500 with 'surrogateescape',
# 2,000 random code-point strings (lone surrogates among them), 4,000 mutated valid actions of every
# tag in both formats, 2,000 strings of nested tags, 520 mistyped, truncated or deeply nested JSON
# calls, 13 page URLs and entities, some with thousands of digits, 10 strings of 100 kB to 1 MB. Each goes
# through 17 calls (parse_action and parse_chat_action for each of the 3 agents, parse_subtask,
# answer_correct, expert_score, stable_seed, search_results, ToySearch.search, search_observation
# twice, ToySearch.visit twice, html_text): 204,731 calls, plus a reparse of every valid action.
# About 3 s on one core.
TAGS = ["<think>", "</think>", "<call>", "</call>", "<answer>", "</answer>", "<search>", "</search>",
        "<return>", "</return>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
        "<visit>", "</visit>", "<|im_start|>", "<|im_end|>", "<", ">", "</", "\n"]
WORDS = ["ada", "bo", "city of ada", "country of avon", "friend of bo", "norland", "toy://page/ada",
         "toy://page/7/2/bo", "toy://page/", "http://127.0.0.1:1/page/1/1/ada", " ", "\u00e9", "\ud800", "\udfff",
         "{", "}", '"']
CALLS = ['{"name": 5}', '{"name": "search", "arguments": [1]}', '{"name": "search", "arguments": {"query": {"a": 1}}}',
         '{"name": "search", "arguments": {"query": ["ada"]}}', '{"name": "search", "arguments": "ada"}',
         '{"name": ["search"], "arguments": {"query": "ada"}}', '{"name": {"a": 1}, "arguments": {}}',
         '{"name": "visit", "arguments": {"url": null}}', '{"name": "sub_agent", "arguments": {"task": 1e999}}',
         '{"name": "search", "arguments": {"query": "\\ud800"}}',
         '{"name": "search", "arguments": {"query": "a\\u0000"}}',
         '{"name": "search", "arguments": {"query": "a", "query": "<answer>"}}', "null", "true", "[]", '""', "1" * 5000,
         '{"name": "search", "arguments": {"query": "ada"}}',
         '{"name": "visit", "arguments": {"url": "toy://page/1/1/ada"}}',
         '{"name": "sub_agent", "arguments": {"task": "city of ada"}}']


def _valid_actions():
    out = []
    for tag in ("call", "answer", "search", "return", "visit"):
        for arg in ("city of ada", "bo", "toy://page/1/1/ada", "norland", "a \u00e9 b", "x y z"):
            out += [tools.action_text(tag, arg), tools.action_text(tag, arg, chat=True)]
    return out


def _mutate(rng, s):
    how = rng.randrange(7)
    i, j = sorted(rng.randrange(len(s) + 1) for _ in range(2))
    if how == 0:
        return s[:i]                                   # truncated
    if how == 1:
        return s + rng.choice(["", " ", "\n"]) + s     # duplicated: a second action
    if how == 2:
        return s[:i] + rng.choice(TAGS + WORDS) + s[i:]  # an inserted tag or word
    if how == 3 and j > i + 1:
        return s[:i] + s[j - 1] + s[i + 1:j - 1] + s[i] + s[j:]  # two characters swapped
    if how == 4:
        return s.replace(rng.choice(TAGS[:16]), rng.choice(TAGS), 1)  # a tag swapped for another
    if how == 5:
        return rng.choice(_VALID)[:rng.randrange(60)] + s  # nested in, or after, another action
    return rng.choice(["<think>", "<think> hm </think>", "Let me see. ", "\ud800", ""]) + s + rng.choice(["", " ", "x"])


_VALID = _valid_actions()


def fuzz_strings():
    rng = random.Random(0)
    out = []
    for _ in range(2000):
        out.append(bytes(rng.randrange(256) for _ in range(rng.randrange(80))).decode("utf-8", "replace"))
    for _ in range(1500):
        out.append(bytes(rng.randrange(256) for _ in range(rng.randrange(80))).decode("utf-8", "surrogateescape"))
    pools = [(0, 0x80), (0xD800, 0xE000), (0, 0x110000), (0x3C, 0x3F)]  # ASCII, surrogates, anything, '<=>'
    for _ in range(2000):
        out.append("".join(chr(rng.randrange(*rng.choice(pools))) for _ in range(rng.randrange(60))))
    for _ in range(4000):
        s = rng.choice(_VALID)
        for _ in range(rng.randrange(1, 4)):
            s = _mutate(rng, s)
        out.append(s)
    for _ in range(2000):
        out.append("".join(rng.choice(TAGS + WORDS) for _ in range(rng.randrange(1, 12))))
    for body in CALLS:
        out += [f"<tool_call>{body}</tool_call>", f"<tool_call>\n{body}\n</tool_call>\n"]
    while len(out) < 12_020:  # truncated and nested JSON calls: 520 in all with CALLS
        body = rng.choice(CALLS)
        k = rng.randrange(1, 2000)
        out.append(rng.choice([f"<tool_call>{body[:rng.randrange(len(body) + 1)]}</tool_call>",
                               "<tool_call>" + "[" * k + "]" * rng.randrange(k + 1) + "</tool_call>",
                               '<tool_call>{"name": "search", "arguments": ' + '{"a": ' * k + "</tool_call>"]))
    out += ["toy://page/" + "9" * 5000 + "/1/ada", "http://h/page/1/" + "2" * 5000 + "/bo", "&#" + "9" * 5000 + ";",
            "&#x" + "f" * 5000, "<tool_call>" + '{"a": ' * 5000 + "</tool_call>", "<think>" + "\ud800" * 5000,
            "toy://page/" + "\u0669" * 20 + "/1/ada", "toy://page/1/1/ada\n", " toy://page/1/2/ada ",
            "toy://page/1/3/ada", "toy://page/" + "a" * 5000, "toy://page/ada ", "toy://page/bo\n"]
    n = 1_000_000
    out += [" " * n + "<answer> a </answer>", "<think>" * (n // 7), "<" * n, "<script" * (n // 7),
            "<tool_call>" + "[" * (n // 5) + "</tool_call>", "<answer> " + "a" * n + " </answer>",
            "&#" + "9" * 100_000, "\ud800" * 100_000, "<call>" + "</call> " * (n // 8) + "x",
            tools.action_text("search", "ada " * 50_000, chat=True)]
    return out


def test_fuzz_every_parser_checker_and_tool_with_hostile_strings():
    strings = fuzz_strings()
    assert len(strings) == 12_043
    q = tt.make_question(3, 2)
    toy = tt.ToySearch()
    failures, calls, parsed = [], 0, 0

    def check(name, f, ok=lambda v: True):
        """f(), recording a failure if it raises anything but a tool's SearchError (which must read
        as UTF-8: it becomes an observation), or if ok(its value) is false."""
        nonlocal calls
        calls += 1
        try:
            v = f()
        except tools.SearchError as e:
            v = e
            if not name.startswith("ToySearch.") or not utf8_ok(str(e)):
                failures.append((name, "SearchError", str(e)[:80].encode("utf-8", "replace"), s[:80]))
        except Exception as e:  # the whole point: nothing else may escape
            failures.append((name, type(e).__name__, str(e)[:80], s[:80]))
            return None
        if not isinstance(v, tools.SearchError) and not ok(v):
            failures.append((name, "bad value", f"{v!r:.80}", s[:80]))
        return v

    def action_ok(v, reparse):
        """None, or (tag, argument) with a clean argument that survives action_text and a reparse."""
        if v is None:
            return True
        tag, arg = v
        return (arg and arg == " ".join(arg.split()) and not TAG_IN_ARG.search(arg) and utf8_ok(arg)
                and reparse(tag, arg) == v)

    for s in strings:
        for who in WHO:
            tags = tools.TAGS[who]
            v = check("parse_action", lambda: tools.parse_action(s, tags),
                      lambda v: action_ok(v, lambda t, a: tools.parse_action(tools.action_text(t, a), tags)))
            w = check("parse_chat_action", lambda: tools.parse_chat_action(s, who),
                      lambda v: action_ok(v, lambda t, a: tools.parse_chat_action(tools.action_text(t, a, chat=True), who)))
            parsed += (v is not None) + (w is not None)
        check("parse_subtask", lambda: tt.parse_subtask(s),
              lambda v: v is None or (v[0] in tt.RELATIONS and isinstance(v[1], str)))
        check("answer_correct", lambda: tt.answer_correct(q, s), lambda v: v in (True, False))
        check("expert_score", lambda: tt.expert_score(q, s, s, [s]), lambda v: v in (0.0, 1.0))
        check("stable_seed", lambda: tools.stable_seed(s, 1, "sub", s), lambda v: 0 <= v < 2 ** 32)
        # a query that names many entities leaves fewer distractors that name none of their values
        results = check("search_results", lambda: tt.search_results(q.seed, q.level, s),
                        lambda v: 0 < len(v) <= tt.N_SNIPPETS[q.level])
        check("ToySearch.search", lambda: toy.search(s, 5, 1), lambda v: 0 < len(v) <= tt.N_SNIPPETS[1])
        check("search_observation", lambda: tools.search_observation(results, chat=len(s) % 2 == 0), utf8_ok)
        check("search_observation(s)", lambda: tools.search_observation([{"url": s, "title": s, "content": s}], True),
              utf8_ok)
        check("ToySearch.visit", lambda: toy.visit(s, 5, 1), lambda v: False)  # never allowed
        check("ToySearch.visit allowed", lambda: toy.visit(s, 5, 1, allowed={s}), utf8_ok)
        check("html_text", lambda: tools.html_text(s), lambda v: isinstance(v, str))
    kinds = collections.Counter(f[:2] for f in failures)
    assert not failures, f"{len(failures)} failures: {dict(kinds)}; e.g. {failures[:3]}"
    assert calls == 17 * len(strings) and parsed > 500  # some mutations stay valid: both paths are exercised


def test_fuzz_the_real_data_parsers_with_hostile_strings():
    """The same strings through what reads real outside text: a question file's line, a corpus line, a /retrieve
    reply, a judge's reply and score, a passage's url and result, the programmatic r_expert, and a tool result's
    ids (every 20th string: the tokenizer is slow on the largest). Each gives its value or its own error, one
    that names the line where there is one; outside text never becomes an added token."""
    import judge
    import qa_task
    from agents import message_ids
    strings = fuzz_strings()
    chat = helpers.load_agent("", mgrpo.parse_args(["--chat", "--model-size", "0.1M"]), seed=0)
    added = set(chat.tok.get_added_vocab().values())
    template = sum(i in added for i in message_ids(chat, "tool", "plain"))
    q = qa_task.Question(0, 1, "Which country?", ["France"])
    task, failures = qa_task.QaTask.__new__(qa_task.QaTask), []

    def check(name, f, ok, errors=()):
        try:
            v = f()
        except errors as e:
            if "f.jsonl, line 3" not in str(e) and not isinstance(e, (judge.JudgeError, tools.SearchError)):
                failures.append((name, "unnamed error", str(e)[:80]))
            return
        except Exception as e:  # noqa: BLE001  (nothing else may escape)
            failures.append((name, type(e).__name__, str(e)[:80]))
            return
        if not ok(v):
            failures.append((name, "bad value", f"{v!r:.80}"))

    for n, s in enumerate(strings):
        check("question_line", lambda: qa_task.question_line({"question": s, "answers": [s, "x"], "id": s}, "f.jsonl, line 3"),
              lambda v: len(v) == 5 and all(qa_task.normalize(a) for a in v[1]), (ValueError,))
        hops = [{"question": s, "answer": s}, {"question": "What of #1?", "answer": "x", "id": s}]
        check("question_decomposition", lambda: qa_task.question_line({"question": "q?", "answers": ["x"],
                                                                        "question_decomposition": hops}, "f.jsonl, line 3"),
              lambda v: len(v[3]) == 2 and all(qa_task.normalize(a) for _, a in v[3]), (ValueError,))
        check("filled hop", lambda: qa_task.filled(s, [s, "x"]), lambda v: isinstance(v, str))
        check("corpus line", lambda: retriever._passage({"id": s, "title": s, "contents": s}, "f.jsonl, line 3"),
              lambda v: len(v) == 3, (ValueError,))
        check("/retrieve reply", lambda: retriever._documents(s), lambda v: isinstance(v, list), (tools.SearchError,))
        reply = json.dumps({"result": [[{"document": {"id": s, "contents": s}, "score": 1.0}]]})
        check("/retrieve reply of s", lambda: retriever._documents(reply),  # JSON pairs up \\udxxx escapes
              lambda v: v[0]["contents"] == json.loads(json.dumps(s)))
        check("judge reply", lambda: judge.reply_content(s), lambda v: isinstance(v, str), (judge.JudgeError,))
        check("judge score", lambda: judge.parse_score(s), lambda v: v is None or 0 <= v <= 1)
        check("doc_url", lambda: retriever.doc_url(s), lambda v: v.isascii() and len(v) < 300)
        check("passage_result", lambda: retriever.passage_result(s, s),
              lambda v: len(v["title"]) <= retriever.TITLE_CHARS and len(v["content"]) <= retriever.SNIPPET_CHARS)
        check("qa r_expert", lambda: task.expert_score(q, s, s, [s, "France"]), lambda v: v in (0.0, 1.0))
        check("qa r_correct", lambda: task.answer_correct(q, s), lambda v: v in (True, False))
        if n % 20 == 0:
            check("tool result ids", lambda: message_ids(chat, "tool", s),
                  lambda v: sum(i in added for i in v) == template)
    assert not failures, f"{len(failures)} failures: {collections.Counter(f[:2] for f in failures)}; e.g. {failures[:3]}"
