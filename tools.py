"""What every task's agents use, whatever the task: the action formats and their parsers (word-level
tags and chat-model tool calls), the tools as the agents call them and what a search returns to
them, the HTTP search client with its `visit` tool, and a seeding helper that gives the same seed in
every process.

Model output, servers and pages are untrusted input: the parsers take any str in linear time and
answer None (format 0) for all but exactly one well-formed action; the client has deadlines, caps
and retries, and what still fails is a `SearchError` that the agent reads as its observation.
"""
import html as html_lib
import json
import os
import re
import secrets
import shutil
import socket
import threading
import time
import zlib
from urllib.parse import urljoin


def stable_seed(*parts):
    """A seed from parts such as (seed, step, role, turn), the same in every process.

    Python's hash() of a str changes from process to process; crc32 does not, so both roles of a
    decoupled run, and a search server, draw the same numbers. 'surrogatepass': any str part is fine."""
    return zlib.crc32("|".join(map(str, parts)).encode("utf-8", "surrogatepass"))


EVAL_SEED = 2 ** 40  # the task interface: question seeds at or above this are evaluations', never training's
CHECK_SEED = EVAL_SEED + 2 ** 30  # and from this one on the cold start's checks' (mgrpo.cold_start_check): never
# training's draws, nor the evaluations' own questions


def clean_text(s):
    """s with lone surrogates made '?': outside text (servers, pages, JSON escapes) any tokenizer takes."""
    return s.encode("utf-8", "replace").decode("utf-8")


def json_lines(path, max_line, digest=None):
    """(line number, 'PATH, line N', object) of each line of a JSONL file that is not blank; a line over
    max_line bytes, not UTF-8 or not JSON is a ValueError that names the file and the line. digest: a
    hashlib object, fed every byte read. Corpora (retriever.py) and question files (qa_task.py) are read with it."""
    with open(path, "rb") as f:
        for n, raw in enumerate(iter(lambda: f.readline(max_line + 1), b""), 1):
            if digest:
                digest.update(raw)
            where = f"{path}, line {n}"
            if len(raw) > max_line:
                raise ValueError(f"{where}: longer than {max_line} bytes")
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                raise ValueError(f"{where}: not UTF-8") from None
            except (ValueError, RecursionError):
                raise ValueError(f"{where}: not JSON") from None
            yield n, where, obj


def temporary_name(path):
    """'<path>.tmp-<host>-<pid>-<random>': where a build or conversion writes before renaming it to `path`."""
    host = re.sub(r"[^A-Za-z0-9]", "", socket.gethostname())[:32] or "host"
    return f"{path}.tmp-{host}-{os.getpid()}-{secrets.token_hex(4)}"


def sweep_temporary(path):
    """Remove what a build or conversion killed midway left beside `path` (temporary_name): this host's folders
    whose process is gone. A live process's is still being written; another host's (a shared disk) is not ours
    to judge."""
    folder, name = os.path.split(os.path.abspath(path))
    mine = temporary_name(name).rsplit("-", 2)[0] + "-"
    for entry in os.listdir(folder) if os.path.isdir(folder) else []:
        pid = entry[len(mine):].split("-")[0] if entry.startswith(mine) else ""
        if pid.isdigit() and not alive(int(pid)):
            shutil.rmtree(os.path.join(folder, entry), ignore_errors=True)


def alive(pid):
    """Is there a process `pid` on this host (one of another user's too)?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


class SearchError(RuntimeError):
    """The search backend failed (after its retries), or refused a visit."""


# ---------------------------------------------------------------------------------------
# Action formats. Word-level models write '<tag> argument </tag>'; chat models write a
# <tool_call>{"name": ..., "arguments": {...}}</tool_call> or an <answer> ... </answer>.
# Both parse to the same (tag, argument), so rewards and losses never see the format.
# ---------------------------------------------------------------------------------------
_OPEN = re.compile(r"<(call|answer|search|return)>")
# a tag of either format or a role: in an argument it would be a second (nested) action, or a fake
# turn in the context it is passed to
_TAG = re.compile(r"</?(?:think|call|answer|search|return|tool|system|user|assistant)|<\|", re.I)
TAGS = {"main": ("call", "answer"), "sub": ("search", "return"), "single": ("search", "answer")}  # (tool, final)
FINAL = {kind: tags[1] for kind, tags in TAGS.items()}  # the tag that ends an agent's conversation


def parse_action(text, allowed):
    """(tag, argument) of one word-level turn, or None when the format is invalid.

    Valid: an optional <think>...</think>, then exactly one <tag> argument </tag> with a non-empty
    argument and a tag this agent may use. Anything else (no tags, unclosed tags, empty text, an
    unknown or foreign tool, a tag in the thought or the argument, a lone surrogate) is invalid."""
    s = text.strip()
    if s.startswith("<think>"):
        end = s.find("</think>")
        if end < 0 or _TAG.search(s, 7, end):
            return None
        s = s[end + 8:].lstrip()
    m = _OPEN.match(s)
    if not m or m.group(1) not in allowed or not s.endswith(f"</{m.group(1)}>"):
        return None
    return _action(m.group(1), s[m.end():-len(m.group(1)) - 3])


def _action(tag, arg):
    """(tag, argument with whitespace collapsed), or None if the argument is no str or empty, holds a
    tag, or holds a lone surrogate (which would fail later in a tokenizer or the HTTP client)."""
    arg = " ".join(arg.split()) if isinstance(arg, str) else ""
    return (tag, arg) if arg and not _TAG.search(arg) and clean_text(arg) == arg else None


def tool_schema(name, description, arg, arg_description):
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {arg: {"type": "string", "description": arg_description}},
                       "required": [arg]}}}


TOOLS = {  # the chat models' tools, as JSON schemas for the chat template; a task may describe them its own way (TOOLS)
    "sub_agent": tool_schema("sub_agent", "Ask the sub-agent, which can search, to look up one fact. It returns one "
                             "word.", "task", "'<relation> of <name>', relation one of city, country, friend; e.g. "
                             "'city of ada'"),
    "search": tool_schema("search", "Search the web. Returns results: title, url, snippet.", "query",
                          "what to search for"),
    "visit": tool_schema("visit", "Read the page at a url from the search results.", "url", "the url"),
}
CHAT_TOOLS = {"main": ("sub_agent",), "sub": ("search", "visit"), "single": ("search", "visit")}  # per agent
TOOL_ACTION = {"sub_agent": ("call", "task"), "search": ("search", "query"), "visit": ("visit", "url")}


def parse_chat_action(text, kind):
    """(tag, argument) of a chat model's turn, in the same tags as `parse_action`, or None.

    Valid: any text (thoughts) with no second action, then exactly one
    <tool_call>{"name": <one of this agent's tools>, "arguments": {<its argument>: "..."}}</tool_call>
    or one <answer> ... </answer>, and nothing after it; no tag inside the call or the answer."""
    m = re.search(r"<(tool_call|answer)>", text)  # the first action: the thoughts before it hold none
    end = text.find(f"</{m.group(1)}>", m.end()) if m else -1
    if end < 0 or text[end + len(m.group(0)) + 1:].strip():
        return None
    inner = text[m.end():end]
    if m.group(1) == "answer":
        return _action(FINAL[kind], inner)
    try:  # deep nesting ('[' * 10**5) makes json raise RecursionError
        call = None if _TAG.search(inner) else json.loads(inner)
    except (ValueError, RecursionError):
        return None
    if not (isinstance(call, dict) and call.get("name") in CHAT_TOOLS[kind]
            and isinstance(call.get("arguments"), dict)):
        return None
    tag, key = TOOL_ACTION[call["name"]]
    return _action(tag, call["arguments"].get(key))


def action_text(tag, arg, chat=False):
    """One assistant turn: '<tag> arg </tag>' for word-level models, a tool call or an <answer> for
    chat models. Demos and scripted agents write their turns with it."""
    if not chat:
        return f"<{tag}> {arg} </{tag}>"
    if tag in ("answer", "return"):
        return f"<answer> {arg} </answer>"
    name, key = next((n, k) for n, (t, k) in TOOL_ACTION.items() if t == tag)
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": {key: arg}}) + "\n</tool_call>"


def search_observation(results, chat=False):
    """What the agent reads back from one search: the snippets, ';'-separated (word-level
    models), or for chat models one numbered line per result with its url (to visit)."""
    if not results:
        return "none"
    if chat:
        lines = (f"[{i + 1}] {r['title']} ({r['url']}): {r['content']}" for i, r in enumerate(results))
        return clean_text("\n".join(lines))
    return clean_text(" ; ".join(r["content"] for r in results))


def tool_calls(search, questions, chat):
    """The tools of S and the single agent, as mgrpo.agent_loop calls them: act(calls, turn) answers
    each call [(conversation, tag, argument)] with one message. A call searches (for conversation j,
    in the knowledge of questions[j]: its seed and level) or visits a page (chat models); a visit may
    only go to a URL among the conversation's own search results, and reads at most VISIT_CHARS of it
    (about 700 tokens). A tool that fails on its argument
    (model output) answers with the error, and the run goes on."""
    seen = [set() for _ in questions]  # per conversation: the URLs its searches returned

    def act(calls, turn):
        messages = []
        for j, tag, arg in calls:
            try:
                if tag == "visit":
                    messages.append(search.visit(arg, questions[j].seed, questions[j].level, VISIT_CHARS, seen[j]))
                    continue
                results = search.search(arg, questions[j].seed, questions[j].level)
                seen[j].update(r["url"] for r in results)
                messages.append(search_observation(results, chat))
            except SearchError as e:
                messages.append(f"error: {e}")
            except Exception as e:  # noqa: BLE001  (a bug in a tool: shown, but a long run goes on)
                print(f"warning: the {tag} tool raised {type(e).__name__}: {e}", flush=True)
                messages.append(f"error: {type(e).__name__}")
        return messages
    return act


# ---------------------------------------------------------------------------------------
# Search and visit over HTTP
# ---------------------------------------------------------------------------------------
VISIT_CHARS = 2000  # a visited page's text is cut to this
NOT_AMONG = "cannot visit {!r}: not among this trajectory's search results"
_MARKUP = re.compile(r"<(?:(head|script|style)\b[^>]*|[^>]+)>", re.I)  # a tag; group 1: a block to cut whole
_CLOSE = {n: re.compile(f"</{n}>", re.I) for n in ("head", "script", "style")}
_BIG_CHARREF = re.compile(r"&#(?:[xX][0-9a-fA-F]{9,}|[0-9]{9,});?")  # past U+10FFFF; int() caps digits


def html_text(html):
    """Readable text of an HTML page: scripts, styles and tags out, entities decoded. In linear time,
    as a page is untrusted: no '<' past the last '>' is tried, nor a closing tag looked for twice."""
    out, i, end, unclosed = [], 0, html.rfind(">") + 1, set()  # unclosed: blocks with no closing tag after
    while m := _MARKUP.search(html, i, end):
        name = (m.group(1) or "").lower()
        close = name and name not in unclosed and _CLOSE[name].search(html, m.end())
        if name and not close:
            unclosed.add(name)
        out += [html[i:m.start()], " "]
        i = close.end() if close else m.end()
    return " ".join(html_lib.unescape(_BIG_CHARREF.sub("\ufffd", "".join(out) + html[i:])).split())


def host_port(url):
    """(scheme, host, port) that requests connects to (urllib3's parser: no mismatch on 'http://a\\@b/')."""
    from urllib3.util import parse_url
    try:
        p = parse_url(url)
        return p.scheme, p.host, p.port or {"http": 80, "https": 443}.get(p.scheme)
    except ValueError:
        return None


def deadline_session(deadline):
    """A requests session whose connections are shut down at `deadline` (time.monotonic()) by a watchdog,
    whatever the server sends: a socket timeout bounds one read only, and a server that trickles its header
    lines a byte at a time would pass every one (HttpSearch's own check reads the body, after the headers).
    Closing the session cancels the watchdogs."""
    import requests
    timers = []

    class Adapter(requests.adapters.HTTPAdapter):
        def get_connection_with_tls_context(self, *a, **kw):
            pool = super().get_connection_with_tls_context(*a, **kw)

            class Watched(pool.ConnectionCls):
                def _new_conn(self):  # the plain socket, watched before a TLS handshake runs on it
                    sock = super()._new_conn()
                    timers.append(threading.Timer(max(0.0, deadline - time.monotonic()), shut_down, (sock,)))
                    timers[-1].daemon = True
                    timers[-1].start()
                    return sock
            pool.ConnectionCls = Watched
            return pool

        def close(self):
            for t in timers:
                t.cancel()
            super().close()
    session = requests.Session()
    session.mount("http://", Adapter(max_retries=0))
    session.mount("https://", Adapter(max_retries=0))
    return session


def shut_down(sock):
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # closed already
        pass


class HttpSearch:
    """Client of any server that speaks SearXNG's JSON API, as the toy server does.

    Each request has a total deadline: the body comes in small reads, and the first read ending past `timeout`
    seconds ends it, and a watchdog shuts the connection down at it (deadline_session), headers under way or
    not: a trickling server cannot hold it; at most `max_bytes` are read. Connection errors, timeouts
    and 5xx answers are retried `retries` times, waiting backoff, 2 * backoff, ... in between; a 4xx is not retried.
    What still fails raises SearchError: at start-up that stops the run with a message, during a rollout the agent
    reads it as the search's result. `visit_hosts`: hosts a model may visit beyond its own results."""

    def __init__(self, url, timeout=10.0, retries=2, backoff=0.5, max_bytes=2_000_000, visit_hosts=()):
        self.url, self.timeout, self.retries, self.backoff = url.rstrip("/"), timeout, retries, backoff
        self.max_bytes, self.visit_hosts = max_bytes, {h.strip().lower() for h in visit_hosts if h.strip()}

    def _request(self, url, params, what, payload=None):
        """(response, text cut to max_bytes, was it longer?) of a GET, or a POST of `payload` as JSON, with a
        total deadline; retries connection errors, timeouts and 5xx with backoff. Redirects are answers,
        not followed."""
        import requests
        import urllib3
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            deadline, body = time.monotonic() + self.timeout, bytearray()
            session = deadline_session(deadline)
            try:  # read1: what one recv brings, so the deadline is checked after each small read
                with session.request("GET" if payload is None else "POST", url, params=params, json=payload,
                                     timeout=self.timeout, stream=True, allow_redirects=False,
                                     headers={"Accept-Encoding": "identity"}) as r:
                    if r.headers.get("Content-Encoding", "identity") != "identity":  # no decompression bombs
                        raise SearchError(f"{what} sent a compressed body, asked for none")
                    while len(body) <= self.max_bytes and (chunk := r.raw.read1(65536, decode_content=False)):
                        body += chunk
                        if time.monotonic() > deadline:
                            raise requests.exceptions.Timeout(f"over {self.timeout} s")
                    if time.monotonic() > deadline:  # the watchdog shut the socket: what came is not all
                        raise requests.exceptions.Timeout(f"over {self.timeout} s")
            except (requests.exceptions.RequestException, urllib3.exceptions.HTTPError, ValueError, OSError) as e:
                late = time.monotonic() > deadline  # the watchdog's shutdown fails the read under way
                why = f"is not reachable ({'Timeout' if late else type(e).__name__})"
                continue
            finally:
                session.close()
            try:  # in the charset the server names, if Python knows it (none: UTF-8, as JSON is)
                text = clean_text(body[:self.max_bytes].decode(r.encoding or "utf-8", "replace"))
            except (LookupError, ValueError):
                text = body[:self.max_bytes].decode("utf-8", "replace")
            if r.status_code < 500:
                return r, text, len(body) > self.max_bytes
            why = f"answered {r.status_code}: {text[:200]}"
        raise SearchError(f"{what} {why} (after {self.retries + 1} tries)")

    def search(self, query, seed, level):
        """The results; a body over max_bytes or not of their shape (wrong types, deep nesting): SearchError."""
        params = {"q": clean_text(query), "format": "json", "kb": seed, "level": level}  # a real server ignores kb
        r, text, over = self._request(f"{self.url}/search", params, f"search server {self.url}")
        if r.status_code != 200:
            raise SearchError(f"search server {self.url} answered {r.status_code}: {text[:200]}")
        if over:
            raise SearchError(f"search server {self.url} sent over {self.max_bytes} bytes")
        try:
            results = json.loads(text)["results"]
            if isinstance(results, list) and all(isinstance(x, dict) and all(
                    isinstance(x.get(k), (str, type(None))) for k in ("url", "title", "content")) for x in results):
                return [{k: clean_text(x.get(k) or "") for k in ("url", "title", "content")} for x in results]
        except (ValueError, KeyError, TypeError, RecursionError):
            pass
        raise SearchError(f"search server {self.url} sent no SearXNG-style results: {text[:200]}")

    def visit(self, url, seed=None, level=None, max_chars=2000, allowed=()):
        """The text of a result's page (HTML stripped), cut to max_chars (and to max_bytes); seed and
        level unused, since an http URL names its page whatever the question's world. The URL
        comes from the model: only http(s), only one in `allowed` (this trajectory's own results)
        or on a host in visit_hosts; at most 3 redirects, to the same host and port (or https)."""
        if not re.match(r"https?://", url):
            raise SearchError(f"cannot visit {url[:200]!r}: only http(s) URLs")
        if url not in allowed and (host_port(url) or (None, None))[1] not in self.visit_hosts:
            raise SearchError(NOT_AMONG.format(url[:200]))
        for hops in range(4):
            r, text, _ = self._request(url, {}, f"page {url[:200]}")
            if r.status_code not in (301, 302, 303, 307, 308):
                break
            to, here = urljoin(url, r.headers.get("Location", "")), host_port(url)
            if hops == 3 or not here or host_port(to) not in {here, ("https", here[1], 443)}:
                raise SearchError(f"visit {url[:200]} redirects elsewhere or too often: {to[:200]!r}")
            url = to
        if r.status_code != 200:
            raise SearchError(f"visit {url[:200]} answered {r.status_code}")
        is_html = "html" in r.headers.get("Content-Type", "") or text.lstrip()[:1] == "<"
        return (html_text(text) if is_html else " ".join(text.split()))[:max_chars]
