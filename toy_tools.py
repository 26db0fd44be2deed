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

Both paths return the same results for the same (kb, level, query).
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
    words = set(query.split())
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
    return [{"url": f"toy://kb/{seed}/{rel}/{subj}", "title": subj,
             "content": fact_text(rel, subj, kb[(rel, subj)])} for rel, subj in keys]


class ToySearch:
    """In-process search tool."""

    def search(self, query, seed, level):
        return search_results(seed, level, query)


class SearchError(RuntimeError):
    """The search backend failed (after its retries)."""


class HttpSearch:
    """Client of any server that speaks SearXNG's JSON API, as the toy server does.

    Each request has a timeout; connection errors, timeouts and 5xx answers are retried
    `retries` times, waiting backoff, 2 * backoff, ... in between; a 4xx is not retried.
    What still fails raises SearchError: at start-up that stops the run with a message,
    during a rollout the agent reads it as the search's result (see `tool_loop`).
    """

    def __init__(self, url, timeout=10.0, retries=2, backoff=0.5):
        self.url, self.timeout, self.retries, self.backoff = url.rstrip("/"), timeout, retries, backoff

    def search(self, query, seed, level):
        import requests
        params = {"q": query, "format": "json", "kb": seed, "level": level}  # a real server ignores kb, level
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                r = requests.get(f"{self.url}/search", timeout=self.timeout, params=params)
            except requests.exceptions.RequestException as e:
                why = (f"is not reachable ({type(e).__name__}); start one with: "
                       f"python toy_tools.py serve --port PORT")
                continue
            if r.status_code < 500:
                break
            why = f"answered {r.status_code}: {r.text[:200]}"
        else:
            raise SearchError(f"search server {self.url} {why} (after {self.retries + 1} tries)")
        if r.status_code != 200:
            raise SearchError(f"search server {self.url} answered {r.status_code}: {r.text[:200]}")
        try:
            results = r.json()["results"]
            return [{"url": x.get("url", ""), "title": x.get("title", ""), "content": x.get("content") or ""}
                    for x in results]
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise SearchError(f"search server {self.url} sent no SearXNG-style results: {r.text[:200]}") from e


def search_observation(results):
    """What the sub-agent reads back from one search: the snippets, ';'-separated."""
    return " ; ".join(r["content"] for r in results) if results else "none"


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        u = urlparse(self.path)
        qs = parse_qs(u.query)
        try:
            if u.path != "/search":
                raise ValueError(f"unknown path {u.path}")
            query = qs.get("q", [""])[0]
            seed, level = int(qs["kb"][0]), int(qs.get("level", ["1"])[0])
            if level not in N_SNIPPETS:
                raise ValueError("level must be 1 or 2")
            code, body = 200, {"query": query, "results": search_results(seed, level, query)}
        except (KeyError, ValueError) as e:
            code, body = 400, {"error": f"bad request: {e}"}
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
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
    w = task.split()
    if len(w) == 3 and w[0] in RELATIONS and w[1] == "of":
        return w[0], w[2]
    return None


def answer_correct(q, answer):
    """r_correct of the main agent."""
    return answer is not None and answer.strip() == q.answer


def expert_score(q, task, result):
    """r_expert [choice, spec 2]: did the sub-agent return the fact its sub-task asked for?"""
    parsed = parse_subtask(task)
    if parsed is None or result is None:
        return 0.0
    truth = knowledge_base(q.seed, q.level).get(parsed)
    return float(truth is not None and result.strip() == truth)


# ---------------------------------------------------------------------------------------
# Scripted, deliberately noisy demonstrations for the cold start (stands in for stage 1)
# ---------------------------------------------------------------------------------------
def _noisy(rng, value, pool, p):
    return rng.choice(pool) if rng.random() < p else value


def main_demo(q, rng, p, single=False):
    """A scripted main-agent conversation (messages) with entity slots corrupted w.p. p.

    The tool results are what a perfect sub-agent would return for the (maybe wrong)
    sub-task, so the demo also teaches the main agent to carry a result forward.
    single=True: the single agent's demo, the same chain with the searches inlined; it
    reads every whole result list in its own context.
    """
    kb = knowledge_base(q.seed, q.level)
    x = q.text.split()[-2]
    msgs = [{"role": "user", "content": q.text}]
    for rel in chain(q.level):
        x = _noisy(rng, x, RELATIONS[rel][1], p)
        act = f"<search> {x} </search>" if single else f"<call> {rel} of {x} </call>"
        obs = search_observation(search_results(q.seed, q.level, x)) if single else kb[(rel, x)]
        msgs += [{"role": "assistant", "content": act}, {"role": "tool", "content": obs}]
        x = kb[(rel, x)]
    msgs.append({"role": "assistant", "content": f"<answer> {_noisy(rng, x, COUNTRIES, p)} </answer>"})
    return msgs


def single_demo(q, rng, p):
    return main_demo(q, rng, p, single=True)


def sub_demo(q, rng, p):
    """A scripted sub-agent conversation: one search, then return the value read off it."""
    kb = knowledge_base(q.seed, q.level)
    rel = rng.choice(chain(q.level))
    _, subjects, values = RELATIONS[rel]
    e = rng.choice(subjects)
    query = _noisy(rng, e, subjects, p)
    obs = search_observation(search_results(q.seed, q.level, query))
    found = re.search(rf"(?:^|; ){e} {RELATIONS[rel][0]} (\S+)", obs)
    value = found.group(1) if found else rng.choice(values)
    return [{"role": "user", "content": f"{rel} of {e}"},
            {"role": "assistant", "content": f"<search> {query} </search>"},
            {"role": "tool", "content": obs},
            {"role": "assistant", "content": f"<return> {_noisy(rng, value, values, p)} </return>"}]


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
