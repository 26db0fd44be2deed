"""The toy deep-research task, its search tool, reward checkers and cold-start demos.

Every question comes with its own small knowledge base, generated from the
question's seed, so nothing can be memorised: to answer "country of ada ?" the
agents must look up where ada lives and then which country that city is in, and
read the answers off what the search tool returns.

    level 1 (stage 1, easy):  "country of X ?"            2 hops, 3 short clean snippets per search
    level 2 (stage 2, hard):  "country of friend of X ?"  3 hops, 8 snippets, most of them noise

Facts read "ada lives avon", "avon in norland", "ada friend bo". A sub-task,
written by the main agent, reads "city of ada", "country of avon" or
"friend of ada"; the sub-agent searches and returns one entity. Level 2 is
deep research in miniature: a search matches the entity anywhere in a fact
(so "avon" also finds "bo lives avon"), and the list is long, so the fact
asked for must be read out of much noise. The sub-agent reads each list and
hands back one word; an agent that searches for itself keeps every list in
its own context.

The search tool runs in-process (`ToySearch`) or as an HTTP server on
127.0.0.1 (`python toy_tools.py serve --port 8765`, client `HttpSearch`).
Protocol, shaped like SearXNG's JSON API:

    GET /search?q=<query>&format=json&kb=<question seed>&level=<1|2>
    -> 200 {"query": q, "results": [{"url": ..., "title": ..., "content": "ada lives avon"}, ...]}
    -> 400 {"error": "..."} on a bad request
    GET /page/<kb>/<level>/<entity>   (a result's url)
    -> 200 an HTML page with every fact about the entity

Both paths return the same results and page texts for the same (kb, level, query).

Chat models (real instruct models, or the tiny Qwen2-style ones of `--chat`) do not use
the word-level tags: they call tools as <tool_call>{"name": ..., "arguments": {...}}</tool_call>
(tools `sub_agent`, `search`, `visit`) and answer as <answer> ... </answer>; see "Chat
models" below.
"""
import argparse
import json
import random
import re
import time
import zlib
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

PERSONS = ("ada bo cy dex eli fay gus hal ivo jun kai lu mo ned oz "
           "pia quin ray sol tam uma vic wes xia yul zed abe bea cal dot").split()
CITIES = "avon brill cork dover elm fenn glen hove ilk jura".split()
COUNTRIES = "norland sudia westia eastia midia".split()
# sub-task relation -> (word in the fact, type of the subject, type of the value)
RELATIONS = {"city": ("lives", PERSONS, CITIES),
             "country": ("in", CITIES, COUNTRIES),
             "friend": ("friend", PERSONS, PERSONS)}
N_SNIPPETS = {1: 3, 2: 8}
N_MENTIONS = 3  # level 2: at most this many facts that name the entity as their value

# Every word the toy agents can read or write: the word-level vocabulary.
SPECIAL = ["<pad>", "<eos>", "<unk>"]
WORDS = (["<system>", "<user>", "<assistant>", "<tool>",
          "<think>", "</think>", "<call>", "</call>", "<answer>", "</answer>",
          "<search>", "</search>", "<return>", "</return>",
          "country", "city", "friend", "of", "?", "lives", "in", ";", "none"]
         + PERSONS + CITIES + COUNTRIES)
# Renders each message on its own, so a context can be grown one message at a
# time and equal the render of the whole conversation (see tests).
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}"
                 "{% if m['role'] == 'assistant' %} <eos>{% endif %} {% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def toy_tokenizer():
    """A word-level Hugging Face tokenizer over the toy vocabulary, with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    t = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                unk_token="<unk>", padding_side="left")
    t.chat_template = CHAT_TEMPLATE
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
    kb = {}
    for p in PERSONS:
        kb[("city", p)] = rng.choice(CITIES)
    for c in CITIES:
        kb[("country", c)] = rng.choice(COUNTRIES)
    if level >= 2:
        for p in PERSONS:
            kb[("friend", p)] = rng.choice([q for q in PERSONS if q != p])
    return kb


def fact_text(rel, subject, value):
    return f"{subject} {RELATIONS[rel][0]} {value}"


def make_question(seed, level):
    if level not in N_SNIPPETS:
        raise ValueError(f"level must be 1 or 2, got {level!r}")
    kb = knowledge_base(seed, level)
    x = random.Random(seed + 1).choice(PERSONS)
    if level == 1:
        return Question(seed, level, f"country of {x} ?", kb[("country", kb[("city", x)])])
    y = kb[("friend", x)]
    return Question(seed, level, f"country of friend of {x} ?", kb[("country", kb[("city", y)])])


def chain(level):
    """The relations a question of this level asks for, in order."""
    return ["city", "country"] if level == 1 else ["friend", "city", "country"]


def stable_seed(*parts):
    """A seed from parts such as (seed, step, role, turn), the same in every process.

    Python's hash() of a str changes from process to process; crc32 does not, so the
    server and the in-process tool pick the same distractors, and runs repeat."""
    return zlib.crc32("|".join(map(str, parts)).encode())


def search_results(seed, level, query):
    """The search engine: facts about the entities named in `query`, among distractors."""
    kb = knowledge_base(seed, level)
    words = set(re.findall(r"[a-z]+", query.lower()))  # "Ada?" finds ada too (chat models)
    n = N_SNIPPETS[level]
    hits = [k for k in kb if k[1] in words][:n]
    rng = random.Random(stable_seed(seed, level, query))
    own = {h[0] for h in hits}  # relations of the facts about the entity
    if level == 2:
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


def html_text(html):
    """Readable text of an HTML page: scripts, styles and tags out, entities decoded."""
    import html as html_lib
    html = re.sub(r"(?is)<(head|script|style)\b.*?</\1>", " ", html)
    return " ".join(html_lib.unescape(re.sub(r"<[^>]+>", " ", html)).split())


def _toy_page(url):
    m = re.fullmatch(r"(?:toy:/|https?://[^/]+)/page/(\d+)/(\d)/([a-z]+)", url.strip())
    return page_text(int(m.group(1)), int(m.group(2)), m.group(3)) if m and int(m.group(2)) in N_SNIPPETS else None


class SearchError(RuntimeError):
    """The search backend failed (after its retries)."""


class ToySearch:
    """In-process search tool."""

    def search(self, query, seed, level):
        return search_results(seed, level, query)

    def visit(self, url, max_chars=2000):
        text = _toy_page(url)
        if text is None:
            raise SearchError(f"cannot visit {url!r}: not a page of this search tool")
        return text[:max_chars]


class HttpSearch:
    """Client of any server that speaks SearXNG's JSON API, as the toy server does.

    Each request has a timeout; connection errors, timeouts and 5xx answers are retried
    `retries` times, waiting backoff, 2 * backoff, ... in between; a 4xx is not retried.
    What still fails raises SearchError: at start-up that stops the run with a message,
    during a rollout the agent reads it as the search's result (see `tool_loop`).
    """

    def __init__(self, url, timeout=10.0, retries=2, backoff=0.5):
        self.url, self.timeout, self.retries, self.backoff = url.rstrip("/"), timeout, retries, backoff

    def _get(self, url, params, what):
        """GET with a timeout; retries connection errors, timeouts and 5xx with backoff."""
        import requests
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                r = requests.get(url, timeout=self.timeout, params=params)
            except requests.exceptions.RequestException as e:
                why = f"is not reachable ({type(e).__name__})"
                continue
            if r.status_code < 500:
                return r
            why = f"answered {r.status_code}: {r.text[:200]}"
        raise SearchError(f"{what} {why} (after {self.retries + 1} tries)")

    def search(self, query, seed, level):
        params = {"q": query, "format": "json", "kb": seed, "level": level}  # a real server ignores kb, level
        r = self._get(f"{self.url}/search", params, f"search server {self.url}")
        if r.status_code != 200:
            raise SearchError(f"search server {self.url} answered {r.status_code}: {r.text[:200]}")
        try:
            results = r.json()["results"]
            return [{"url": x.get("url", ""), "title": x.get("title", ""), "content": x.get("content") or ""}
                    for x in results]
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise SearchError(f"search server {self.url} sent no SearXNG-style results: {r.text[:200]}") from e

    def visit(self, url, max_chars=2000):
        """The text of a result's page (HTML stripped), cut to max_chars. Only http(s) URLs:
        the URL comes from the model, so no file:// or other schemes."""
        if not re.match(r"https?://", url):
            raise SearchError(f"cannot visit {url!r}: only http(s) URLs")
        r = self._get(url, {}, f"page {url}")
        if r.status_code != 200:
            raise SearchError(f"visit {url} answered {r.status_code}")
        is_html = "html" in r.headers.get("Content-Type", "") or r.text.lstrip()[:1] == "<"
        return (html_text(r.text) if is_html else " ".join(r.text.split()))[:max_chars]


def search_observation(results, chat=False):
    """What the agent reads back from one search: the snippets, ';'-separated (word-level
    models), or for chat models one numbered line per result with its url (to visit)."""
    if not results:
        return "none"
    if chat:
        return "\n".join(f"[{i + 1}] {r['title']} ({r['url']}): {r['content']}" for i, r in enumerate(results))
    return " ; ".join(r["content"] for r in results)


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
                    raise ValueError("level must be 1 or 2")
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
# Parsing model output and reward checkers (spec 2)
# ---------------------------------------------------------------------------------------
_ACTION = re.compile(r"^\s*(?:<think>.*?</think>)?\s*<(call|answer|search|return)>(.*?)</\1>\s*$", re.S)
MAIN_TAGS, SUB_TAGS = ("call", "answer"), ("search", "return")
SINGLE_TAGS = ("search", "answer")  # the single-agent baseline searches itself
TAGS = {"main": MAIN_TAGS, "sub": SUB_TAGS, "single": SINGLE_TAGS}  # (tool, final answer) per agent


def parse_action(text, allowed):
    """(tag, argument) of one turn's output, or None when the format is invalid.

    Valid: an optional <think>...</think>, then exactly one <tag> argument </tag> with a
    non-empty argument and a tag this agent may use. Anything else (no tags, unclosed
    tags, empty text, an unknown or foreign tool) is invalid.
    """
    m = _ACTION.match(text)
    if not m or m.group(1) not in allowed or not m.group(2).strip():
        return None
    return m.group(1), " ".join(m.group(2).split())


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
    """r_expert [choice, spec 2]: did the sub-agent return the fact its sub-task asked for?"""
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
_CHAT_ACTION = re.compile(r"^(?:(?!<tool_call>|<answer>).)*?(?:<tool_call>(.*?)</tool_call>|<answer>(.*?)</answer>)\s*$",
                          re.S)


def parse_chat_action(text, who):
    """(tag, argument) of a chat model's turn, in the same tags as `parse_action`, or None.

    Valid: any text (thoughts) with no second action, then exactly one
    <tool_call>{"name": <one of this agent's tools>, "arguments": {<its argument>: "..."}}</tool_call>
    or one <answer> ... </answer>, and nothing after it.
    """
    m = _CHAT_ACTION.match(text)
    if not m:
        return None
    if m.group(2) is not None:
        answer = " ".join(m.group(2).split())
        return (TAGS[who][1], answer) if answer else None
    try:
        call = json.loads(m.group(1))
        tag, key = TOOL_ACTION[call["name"]]
        value = call["arguments"][key]
    except (ValueError, KeyError, TypeError):
        return None
    if call["name"] not in CHAT_TOOLS[who] or not isinstance(value, str) or not value.strip():
        return None
    return tag, " ".join(value.split())


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


def chat_tokenizer(vocab_size=768):
    """A byte-level BPE tokenizer in Qwen's style (pad <|endoftext|>, eos <|im_end|>), its
    merges learned from toy conversations in a second, with the Qwen-style template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    rng = random.Random(0)
    corpus = [SYSTEM[w] + json.dumps([TOOLS[n] for n in CHAT_TOOLS[w]]) for w in SYSTEM]
    corpus += 50 * [QWEN_STYLE_TEMPLATE, "system\nuser\nassistant\n"]
    for s in range(300):
        q = make_question(s, 1 + s % 2)
        for msgs in (main_demo(q, rng, 0.2, chat=True), single_demo(q, rng, 0.2, chat=True),
                     sub_demo(q, rng, 0.2, chat=True)):
            corpus += [m["content"] for m in msgs]
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

    The tool results are what a perfect sub-agent would return for the (maybe wrong)
    sub-task, so the demo also teaches the main agent to carry a result forward.
    single=True: the single agent's demo, the same chain with the searches inlined; it
    reads every whole result list in its own context. chat=True: turns as chat models write them.
    """
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
                 {"role": "tool", "content": ToySearch().visit(page)}]
    return msgs + [{"role": "assistant", "content": action_text("return", _noisy(rng, value, values, p), chat)}]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="Toy search tool. `serve` runs the HTTP server; "
                                 "`ask` prints a question and a search.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="serve the search tool on 127.0.0.1")
    s.add_argument("--port", type=int, default=8765)
    a = sub.add_parser("ask", help="print one question and one search")
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--level", type=int, default=1)
    a.add_argument("--query", default=None)
    args = ap.parse_args()
    if args.cmd == "serve":
        srv = make_server(args.port)
        print(f"toy search on http://127.0.0.1:{srv.server_address[1]}/search", flush=True)
        srv.serve_forever()
    else:
        q = make_question(args.seed, args.level)
        print(q)
        query = args.query or q.text.split()[-2]
        print(search_observation(search_results(q.seed, q.level, query)))
