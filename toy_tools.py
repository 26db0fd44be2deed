"""The toy deep-research task (questions, search tool, reward checkers, cold-start demos), and what any
task uses: the tokenizers of the models built in code, the action formats and their parsers, an HTTP
search client. mgrpo.py reaches a task only through this interface; a task is a module (--task NAME,
or the path of a .py file) with:

    WORDS                                    its words: the word-level vocabulary of models built in code
    SYSTEM                                   {"main", "sub", "single"}: the chat models' system prompts
    make_question(seed, level)               -> an object with .seed, .level, .text (ValueError: no level)
    answer_correct(question, answer)         -> bool: r_correct, eq. 4
    expert_score(question, subtask, result)  -> float in [0, 1]: r_expert, eq. 5
    search_tool()                            -> .search(query, seed, level) -> [{"url", "title", "content"}]
                                                and .visit(url, max_chars, allowed) -> text; both raise SearchError
    demo(question, rng, noise, kind, chat)   -> a scripted conversation (messages) for the cold start

This module is the toy task; tests/sum_task.py is a second one. The toy task: every question has its
own knowledge base, made from the question's seed, so nothing can be memorised. "country of ada ?"
needs the city where ada lives and that city's country, read off search results ("ada lives avon",
"avon in norland", "ada friend bo"); M's sub-tasks read "city of ada", "country of avon", "friend of
ada", and S returns one entity.

    level 1 (stage 1, easy):  "country of X ?"            2 hops, 3 short clean snippets per search
    level 2 (stage 2, hard):  "country of friend of X ?"  3 hops, 8 snippets, most of them noise

Level 2 is deep research in miniature: a search matches the entity anywhere in a fact ("avon" also
finds "bo lives avon") and the fact asked for must be read out of much noise. The search tool runs
in-process (`ToySearch`) or as a server on 127.0.0.1 (`python toy_tools.py serve`), shaped like
SearXNG's JSON API: GET /search?q=<query>&format=json&kb=<seed>&level=<level> -> {"query", "results":
[{"url", "title", "content"}]}; a result's url, GET /page/<kb>/<level>/<entity>, is an HTML page. Both
give the same results and pages. Chat models call tools as <tool_call>{"name": ..., "arguments": {...}}
</tool_call> and answer as <answer> ... </answer>.
"""
import argparse
import json
import random
import re
import sys
import time
import zlib
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urljoin, urlparse

PERSONS = ("ada bo cy dex eli fay gus hal ivo jun kai lu mo ned oz "
           "pia quin ray sol tam uma vic wes xia yul zed abe bea cal dot").split()
CITIES = "avon brill cork dover elm fenn glen hove ilk jura".split()
COUNTRIES = "norland sudia westia eastia midia".split()
# sub-task relation -> (word in the fact, type of the subject, type of the value)
RELATIONS = {"city": ("lives", PERSONS, CITIES),
             "country": ("in", CITIES, COUNTRIES),
             "friend": ("friend", PERSONS, PERSONS)}
N_SNIPPETS = {1: 3, 2: 8, 3: 12}
N_MENTIONS = 3  # level 2: at most this many facts that name the entity as their value

# The word-level vocabulary of the models built in code: special tokens, the turn and action tags
# (any task), then the task's WORDS.
SPECIAL = ["<pad>", "<eos>", "<unk>"]
STRUCTURE = ["<system>", "<user>", "<assistant>", "<tool>", "<think>", "</think>", "<call>", "</call>",
             "<answer>", "</answer>", "<search>", "</search>", "<return>", "</return>"]
WORDS = ["country", "city", "friend", "of", "?", "lives", "in", ";", "none"] + PERSONS + CITIES + COUNTRIES
# Renders each message on its own, so a context can be grown one message at a
# time and equal the render of the whole conversation (see tests).
WORD_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}"
                 "{% if m['role'] == 'assistant' %} <eos>{% endif %} {% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def word_tokenizer(words=WORDS):
    """A word-level Hugging Face tokenizer over the tags and a task's words, with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = list(words) + [w for w in (";", "none") if w not in words]  # search_observation's, rollout's
    vocab = {w: i for i, w in enumerate(SPECIAL + STRUCTURE + words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    t = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                unk_token="<unk>", padding_side="left")
    t.chat_template = WORD_TEMPLATE
    return t


# ---------------------------------------------------------------------------------------
# The world of one question
# ---------------------------------------------------------------------------------------
@dataclass
class Question:
    seed: int    # regenerates the knowledge base: the "kb" of the search protocol
    level: int
    text: str    # what the main agent reads
    answer: str


def knowledge_base(seed, level):
    """Facts of one question: {(relation, subject): value}, from the seed alone."""
    rng = random.Random(seed)
    kb = {("city", p): rng.choice(CITIES) for p in PERSONS}
    kb.update({("country", c): rng.choice(COUNTRIES) for c in CITIES})
    if level >= 2:
        kb.update({("friend", p): rng.choice([q for q in PERSONS if q != p]) for p in PERSONS})
    return kb


def fact_text(rel, subject, value):
    return f"{subject} {RELATIONS[rel][0]} {value}"


def make_question(seed, level):
    if level not in N_SNIPPETS:
        raise ValueError(f"level must be 1, 2 or 3, got {level!r}")
    kb, x = knowledge_base(seed, level), random.Random(seed + 1).choice(PERSONS)
    text = "country of " + "friend of " * (level - 1) + f"{x} ?"
    for rel in chain(level):
        x = kb[(rel, x)]
    return Question(seed, level, text, x)


def chain(level):
    """The relations a question of this level asks for, in order (level 3: 4 hops, 12 snippets per search)."""
    return ["friend"] * (level - 1) + ["city", "country"]


def stable_seed(*parts):
    """A seed from parts such as (seed, step, role, turn), the same in every process.

    Python's hash() of a str changes from process to process; crc32 does not, so the server and the
    in-process tool pick the same distractors, and runs repeat. 'surrogatepass': any str part is fine."""
    return zlib.crc32("|".join(map(str, parts)).encode("utf-8", "surrogatepass"))


def search_results(seed, level, query):
    """The search engine: facts about the entities named in `query`, among distractors."""
    kb = knowledge_base(seed, level)
    words = set(re.findall(r"[a-z]+", query.lower()))  # "Ada?" finds ada too (chat models)
    n = N_SNIPPETS[level]
    hits = [k for k in kb if k[1] in words][:n]
    rng = random.Random(stable_seed(seed, level, query))
    own = {h[0] for h in hits}  # relations of the facts about the entity
    if level >= 2:
        # full-text match: facts that name the entity as their value come up too ("bo lives
        # avon" for "avon"), those of another relation than the entity's own facts
        mentions = [k for k in kb if k[1] not in words and kb[k] in words and k[0] not in own]
        hits += rng.sample(mentions, min(len(mentions), N_MENTIONS, n - len(hits)))
    # the rest are distractors that share no relation with a fact about the entity, so a
    # reader finds the asked fact by its relation: it is the only one of its kind
    others = [k for k in kb if k[1] not in words and k not in hits]
    clean = [k for k in others if k[0] not in own]
    others = clean if len(clean) >= n - len(hits) else others
    keys = hits + rng.sample(others, n - len(hits))
    rng.shuffle(keys)
    return [{"url": f"toy://page/{seed}/{level}/{subj}", "title": subj,
             "content": fact_text(rel, subj, kb[(rel, subj)])} for rel, subj in keys]


def page_text(seed, level, entity):
    """The page behind a result: every fact about the entity, as sentences (None: no such page)."""
    kb = knowledge_base(seed, level)
    facts = [fact_text(rel, s, v) + "." for (rel, s), v in kb.items() if s == entity]
    return f"{entity}. " + " ".join(facts) if facts else None


_MARKUP = re.compile(r"<(?:(head|script|style)\b[^>]*|[^>]+)>", re.I)  # a tag; group 1: a block to cut whole
_CLOSE = {n: re.compile(f"</{n}>", re.I) for n in ("head", "script", "style")}
_BIG_CHARREF = re.compile(r"&#(?:[xX][0-9a-fA-F]{9,}|[0-9]{9,});?")  # past U+10FFFF; int() caps digits
_PAGE = re.compile(r"(?:toy:/|https?://[^/]+)/page/([0-9]{1,18})/([0-9])/([a-z]+)")  # int() of 18 digits: safe
_NOT_AMONG = "cannot visit {!r}: not among this trajectory's search results"


def _text(s):
    """s with lone surrogates made '?': outside text (servers, pages, JSON escapes) any tokenizer takes."""
    return s.encode("utf-8", "replace").decode("utf-8")


def html_text(html):
    """Readable text of an HTML page: scripts, styles and tags out, entities decoded. In linear time,
    as a page is untrusted: no '<' past the last '>' is tried, nor a closing tag looked for twice."""
    import html as html_lib
    out, i, end, unclosed = [], 0, html.rfind(">") + 1, set()  # unclosed: blocks with no closing tag after
    while m := _MARKUP.search(html, i, end):
        name = (m.group(1) or "").lower()
        c = name and name not in unclosed and _CLOSE[name].search(html, m.end())
        unclosed.update([name] if name and not c else [])
        out += [html[i:m.start()], " "]
        i = c.end() if c else m.end()
    return " ".join(html_lib.unescape(_BIG_CHARREF.sub("\ufffd", "".join(out) + html[i:])).split())


def _toy_page(url):
    m = _PAGE.fullmatch(url.strip())
    return page_text(int(m.group(1)), int(m.group(2)), m.group(3)) if m and int(m.group(2)) in N_SNIPPETS else None


class SearchError(RuntimeError):
    """The search backend failed (after its retries)."""


def _host_port(url):
    """(scheme, host, port) that requests connects to (urllib3's parser: no mismatch on 'http://a\\@b/')."""
    from urllib3.util import parse_url
    try:
        p = parse_url(url)
        return p.scheme, p.host, p.port or {"http": 80, "https": 443}.get(p.scheme)
    except ValueError:
        return None


class ToySearch:
    """In-process search tool."""

    def search(self, query, seed, level):
        return search_results(seed, level, query)

    def visit(self, url, max_chars=2000, allowed=()):
        """The page behind a result; allowed: the URLs of this trajectory's own results."""
        if url not in allowed:
            raise SearchError(_NOT_AMONG.format(url[:200]))
        text = _toy_page(url)
        if text is None:
            raise SearchError(f"cannot visit {url[:200]!r}: not a page of this search tool")
        return text[:max_chars]


class HttpSearch:
    """Client of any server that speaks SearXNG's JSON API, as the toy server does.

    Each request has a total deadline: the body comes in small reads, and the first read ending past `timeout`
    seconds ends it (a trickling server cannot hold it); at most `max_bytes` are read. Connection errors, timeouts
    and 5xx answers are retried `retries` times, waiting backoff, 2 * backoff, ... in between; a 4xx is not retried.
    What still fails raises SearchError: at start-up that stops the run with a message, during a rollout the agent
    reads it as the search's result (see `tool_loop`). `visit_hosts`: hosts a model may visit beyond its results."""

    def __init__(self, url, timeout=10.0, retries=2, backoff=0.5, max_bytes=2_000_000, visit_hosts=()):
        self.url, self.timeout, self.retries, self.backoff = url.rstrip("/"), timeout, retries, backoff
        self.max_bytes, self.visit_hosts = max_bytes, {h.strip().lower() for h in visit_hosts if h.strip()}

    def _get(self, url, params, what):
        """(response, text cut to max_bytes, was it longer?) of a GET with a total deadline; retries
        connection errors, timeouts and 5xx with backoff. Redirects are answers, not followed."""
        import requests
        import urllib3
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            deadline, body = time.monotonic() + self.timeout, bytearray()
            try:  # read1: what one recv brings, so the deadline is checked after each small read
                with requests.get(url, timeout=self.timeout, params=params, stream=True, allow_redirects=False,
                                  headers={"Accept-Encoding": "identity"}) as r:
                    if r.headers.get("Content-Encoding", "identity") != "identity":  # no decompression bombs
                        raise SearchError(f"{what} sent a compressed body, asked for none")
                    while len(body) <= self.max_bytes and (chunk := r.raw.read1(65536, decode_content=False)):
                        body += chunk
                        if time.monotonic() > deadline:
                            raise requests.exceptions.Timeout(f"over {self.timeout} s")
            except (requests.exceptions.RequestException, urllib3.exceptions.HTTPError, ValueError) as e:
                why = f"is not reachable ({type(e).__name__})"
                continue
            try:  # in the charset the server names, if Python knows it (none: UTF-8, as JSON is)
                text = _text(body[:self.max_bytes].decode(r.encoding or "utf-8", "replace"))
            except (LookupError, ValueError):
                text = body[:self.max_bytes].decode("utf-8", "replace")
            if r.status_code < 500:
                return r, text, len(body) > self.max_bytes
            why = f"answered {r.status_code}: {text[:200]}"
        raise SearchError(f"{what} {why} (after {self.retries + 1} tries)")

    def search(self, query, seed, level):
        """The results; a body over max_bytes or not of their shape (wrong types, deep nesting): SearchError."""
        params = {"q": _text(query), "format": "json", "kb": seed, "level": level}  # a real server ignores kb, level
        r, text, over = self._get(f"{self.url}/search", params, f"search server {self.url}")
        if r.status_code != 200 or over:
            raise SearchError(f"search server {self.url} " + (f"answered {r.status_code}: {text[:200]}" if
                              r.status_code != 200 else f"sent over {self.max_bytes} bytes"))
        try:
            results = json.loads(text)["results"]
            if isinstance(results, list) and all(isinstance(x, dict) and all(
                    isinstance(x.get(k), (str, type(None))) for k in ("url", "title", "content")) for x in results):
                return [{k: _text(x.get(k) or "") for k in ("url", "title", "content")} for x in results]
        except (ValueError, KeyError, TypeError, RecursionError):
            pass
        raise SearchError(f"search server {self.url} sent no SearXNG-style results: {text[:200]}")

    def visit(self, url, max_chars=2000, allowed=()):
        """The text of a result's page (HTML stripped), cut to max_chars (and to max_bytes). The URL
        comes from the model: only http(s), only one in `allowed` (this trajectory's own results)
        or on a host in visit_hosts; at most 3 redirects, to the same host and port (or https)."""
        if not re.match(r"https?://", url):
            raise SearchError(f"cannot visit {url[:200]!r}: only http(s) URLs")
        if url not in allowed and (_host_port(url) or (None, None))[1] not in self.visit_hosts:
            raise SearchError(_NOT_AMONG.format(url[:200]))
        for hops in range(4):
            r, text, _ = self._get(url, {}, f"page {url[:200]}")
            if r.status_code not in (301, 302, 303, 307, 308):
                break
            to, here = urljoin(url, r.headers.get("Location", "")), _host_port(url)
            if hops == 3 or not here or _host_port(to) not in {here, ("https", here[1], 443)}:
                raise SearchError(f"visit {url[:200]} redirects elsewhere or too often: {to[:200]!r}")
            url = to
        if r.status_code != 200:
            raise SearchError(f"visit {url[:200]} answered {r.status_code}")
        is_html = "html" in r.headers.get("Content-Type", "") or text.lstrip()[:1] == "<"
        return (html_text(text) if is_html else " ".join(text.split()))[:max_chars]


def search_observation(results, chat=False):
    """What the agent reads back from one search: the snippets, ';'-separated (word-level
    models), or for chat models one numbered line per result with its url (to visit)."""
    if not results:
        return "none"
    if chat:
        return _text("\n".join(f"[{i + 1}] {r['title']} ({r['url']}): {r['content']}" for i, r in enumerate(results)))
    return _text(" ; ".join(r["content"] for r in results))


class _Handler(BaseHTTPRequestHandler):
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
                for r in results:  # the pages live on this server
                    r["url"] = r["url"].replace("toy:/", f"http://{self.headers.get('Host', 'localhost')}", 1)
                code, body = 200, json.dumps({"query": query, "results": results})
            elif u.path.startswith("/page/") and (page := _toy_page("toy:/" + u.path)) is not None:
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


def make_server(port=0):
    """A toy search server on 127.0.0.1 (port 0: any free port); call .serve_forever()."""
    return ThreadingHTTPServer(("127.0.0.1", port), _Handler)


# ---------------------------------------------------------------------------------------
# Parsing model output; the reward checkers (r_correct of eq. 4, r_expert of eq. 5)
# ---------------------------------------------------------------------------------------
# Model output is untrusted: the parsers take any str, in linear time (no backtracking regex), and
# answer None (format 0) for all but exactly one action. _TAG: a tag of either format or a role; in
# an argument it would be a second (nested) action, or a fake turn in the context it is passed to.
_OPEN = re.compile(r"<(call|answer|search|return)>")
_TAG = re.compile(r"</?(?:think|call|answer|search|return|tool|system|user|assistant)|<\|", re.I)
MAIN_TAGS, SUB_TAGS = ("call", "answer"), ("search", "return")
SINGLE_TAGS = ("search", "answer")  # the single-agent baseline searches itself
TAGS = {"main": MAIN_TAGS, "sub": SUB_TAGS, "single": SINGLE_TAGS}  # (tool, final answer) per agent


def parse_action(text, allowed):
    """(tag, argument) of one turn's output, or None when the format is invalid.

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
    return (tag, arg) if arg and not _TAG.search(arg) and _text(arg) == arg else None


def parse_subtask(task):
    """'city of ada' -> ('city', 'ada'); None if it asks for no known relation."""
    w = task.lower().split()
    if len(w) == 3 and w[0] in RELATIONS and w[1] == "of":
        return w[0], w[2]
    return None


def answer_correct(q, answer):
    """r_correct of the main agent."""
    return answer is not None and answer.strip().lower() == q.answer


def expert_score(q, task, result):
    """r_expert of eq. 5 (the paper uses an LLM judge): did the sub-agent return the fact its sub-task asked for?"""
    parsed = parse_subtask(task)
    if parsed is None or result is None:
        return 0.0
    truth = knowledge_base(q.seed, q.level).get(parsed)
    return float(truth is not None and result.strip().lower() == truth)


# ---------------------------------------------------------------------------------------
# Chat models: tools as JSON schemas, calls as <tool_call>{json}</tool_call>
# ---------------------------------------------------------------------------------------
def _tool(name, description, arg, arg_description):
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {arg: {"type": "string", "description": arg_description}},
                       "required": [arg]}}}


TOOLS = {
    "sub_agent": _tool("sub_agent", "Ask the sub-agent, which can search, to look up one fact. It returns one word.",
                       "task", "'<relation> of <name>', relation one of city, country, friend; e.g. 'city of ada'"),
    "search": _tool("search", "Search the web. Returns results: title, url, snippet.", "query", "what to search for"),
    "visit": _tool("visit", "Read the page at a url from the search results.", "url", "the url"),
}
# per agent: its tools, and (tool name -> (action tag, argument)) for parsing its calls
CHAT_TOOLS = {"main": ("sub_agent",), "sub": ("search", "visit"), "single": ("search", "visit")}
TOOL_ACTION = {"sub_agent": ("call", "task"), "search": ("search", "query"), "visit": ("visit", "url")}
_WORLD = ("Facts read 'ada lives avon' (ada's city), 'avon in norland' (avon's country), 'ada friend bo'. "
          "Reply with exactly one tool call, or with the final answer as <answer> word </answer>.")
SYSTEM = {
    "main": "You answer questions about people, cities and countries. You cannot search: call the sub_agent tool "
            "with one sub-task at a time. " + _WORLD,
    "sub": "You are a search agent: find the one word your task asks for (city of X: where X lives; country of "
           "X: the country city X is in; friend of X). Search, read the results, visit a page if you need. " + _WORLD,
    "single": "You answer questions about people, cities and countries. Search, read the results, visit a page "
              "if you need. " + _WORLD,
}


def parse_chat_action(text, who):
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
        return _action(TAGS[who][1], inner)
    try:  # deep nesting ('[' * 10**5) makes json raise RecursionError
        call = None if _TAG.search(inner) else json.loads(inner)
    except (ValueError, RecursionError):
        return None
    if not (isinstance(call, dict) and call.get("name") in CHAT_TOOLS[who] and isinstance(call.get("arguments"), dict)):
        return None
    tag, key = TOOL_ACTION[call["name"]]
    return _action(tag, call["arguments"].get(key))


def action_text(tag, arg, chat=False):
    """One assistant turn: '<tag> arg </tag>' for word-level models, a tool call or an
    <answer> for chat models. The demos write their turns with it."""
    if not chat:
        return f"<{tag}> {arg} </{tag}>"
    if tag in ("answer", "return"):
        return f"<answer> {arg} </answer>"
    name, key = next((n, k) for n, (t, k) in TOOL_ACTION.items() if t == tag)
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": {key: arg}}) + "\n</tool_call>"


# A Qwen-style chat template (ChatML turns, tools listed in the system prompt, tool results
# as <tool_response> in a user turn, a default system prompt): the models that `--chat`
# builds in code use it, and the tests check the chat path with it.
QWEN_STYLE_TEMPLATE = (  # (the tokenizer's jinja drops a newline right after a tag: newlines are in {{ }})
    "{%- if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}"
    "{%- else %}{% set sys = 'You are a helpful assistant.' %}{% endif %}"
    "<|im_start|>system{{ '\\n' + sys }}"
    "{%- if tools %}{{ '\\n\\n# Tools\\n\\nYou may call one of these functions:\\n<tools>' }}"
    "{%- for t in tools %}{{ '\\n' + t | tojson }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nCall one as:\\n<tool_call>\\n' }}"
    '{"name": <function-name>, "arguments": <args-json-object>}{{ "\\n</tool_call>" }}{% endif %}'
    "{{ '<|im_end|>\\n' }}"
    "{%- for m in messages if m['role'] != 'system' %}"
    "{%- if m['role'] == 'tool' %}"
    "{%- if loop.first or loop.previtem['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{%- else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CHAT_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<answer>", "</answer>",
              "<think>", "</think>"]


def chat_tokenizer(task=None, vocab_size=768):
    """A byte-level BPE tokenizer in Qwen's style (pad <|endoftext|>, eos <|im_end|>), its merges
    learned in a second from a task's conversations (this module's by default), with the Qwen-style template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    task, rng = task or sys.modules[__name__], random.Random(0)
    corpus = [task.SYSTEM[w] + json.dumps([TOOLS[n] for n in CHAT_TOOLS[w]]) for w in task.SYSTEM]
    corpus += 50 * [QWEN_STYLE_TEMPLATE, "system\nuser\nassistant\n"]
    for s in range(300):
        try:
            q = task.make_question(s, 1 + s % 2)
        except ValueError:  # a task with one level
            q = task.make_question(s, 1)
        corpus += [m["content"] for kind in ("main", "single", "sub") for m in task.demo(q, rng, 0.2, kind, True)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=CHAT_SPECIAL, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_tokens([AddedToken(t, normalized=False) for t in CHAT_ADDED])
    t = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                padding_side="left")
    t.chat_template = QWEN_STYLE_TEMPLATE
    return t


# ---------------------------------------------------------------------------------------
# Scripted, deliberately noisy demonstrations for the cold start (stands in for stage 1)
# ---------------------------------------------------------------------------------------
def _noisy(rng, value, pool, p):
    return rng.choice(pool) if rng.random() < p else value


def main_demo(q, rng, p, single=False, chat=False):
    """A scripted main-agent conversation (messages) with entity slots corrupted w.p. p.

    The tool results are what a perfect sub-agent would return for the (maybe wrong) sub-task, so the
    demo also teaches the main agent to carry a result forward. single=True: the single agent's demo,
    the same chain with the searches inlined; it reads every whole result list in its own context.
    chat=True: turns as chat models write them."""
    kb = knowledge_base(q.seed, q.level)
    x = q.text.split()[-2]
    msgs = [{"role": "user", "content": q.text}]
    for rel in chain(q.level):
        x = _noisy(rng, x, RELATIONS[rel][1], p)
        act = action_text("search", x, chat) if single else action_text("call", f"{rel} of {x}", chat)
        obs = search_observation(search_results(q.seed, q.level, x), chat) if single else kb[(rel, x)]
        msgs += [{"role": "assistant", "content": act}, {"role": "tool", "content": obs}]
        x = kb[(rel, x)]
    msgs.append({"role": "assistant", "content": action_text("answer", _noisy(rng, x, COUNTRIES, p), chat)})
    return msgs


def single_demo(q, rng, p, chat=False):
    return main_demo(q, rng, p, single=True, chat=chat)


def demo(q, rng, p, kind, chat=False):
    """The task interface's demo: a scripted conversation of agent `kind` (main, sub, single)."""
    return {"main": main_demo, "sub": sub_demo, "single": single_demo}[kind](q, rng, p, chat=chat)


def search_tool():
    """The task interface's search tool: this task's own, in-process."""
    return ToySearch()


def sub_demo(q, rng, p, chat=False):
    """A scripted sub-agent conversation: one search, then return the value read off it.
    Chat models visit the entity's page first in about a third of the demos."""
    rel = rng.choice(chain(q.level))
    _, subjects, values = RELATIONS[rel]
    e = rng.choice(subjects)
    query = _noisy(rng, e, subjects, p)
    results = search_results(q.seed, q.level, query)
    obs = search_observation(results)
    found = re.search(rf"(?:^|; ){e} {RELATIONS[rel][0]} (\S+)", obs)
    value = found.group(1) if found else rng.choice(values)
    msgs = [{"role": "user", "content": f"{rel} of {e}"},
            {"role": "assistant", "content": action_text("search", query, chat)},
            {"role": "tool", "content": search_observation(results, chat)}]
    page = next((r["url"] for r in results if r["title"] == e), None)
    if chat and page and rng.random() < 0.3:
        msgs += [{"role": "assistant", "content": action_text("visit", page, chat)},
                 {"role": "tool", "content": ToySearch().visit(page, allowed=[r["url"] for r in results])}]
    return msgs + [{"role": "assistant", "content": action_text("return", _noisy(rng, value, values, p), chat)}]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="The toy search tool as an HTTP server on 127.0.0.1.")
    ap.add_argument("command", choices=["serve"])
    ap.add_argument("--port", type=int, default=8765)
    srv = make_server(ap.parse_args().port)
    print(f"toy search on http://127.0.0.1:{srv.server_address[1]}/search", flush=True)
    srv.serve_forever()
