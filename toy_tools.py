"""The toy deep-research task. It is one task among many: mgrpo.py reaches a task only through the
interface below, and this module is its implementation for the toy world (tests/sum_task.py is a
second task, of another shape; qa_task.py, open questions from a file, `--task qa:questions.jsonl`). A
task is a module, `--task NAME`, or a file, `--task path/to/task.py`, with:

    WORDS                                    its words: the word-level vocabulary of models built in code
                                                (None: an open vocabulary, for chat models only)
    SYSTEM                                   {"main", "sub", "single"}: the chat models' system prompts
    make_question(seed, level)               -> an object with .seed, .level, .text (ValueError: no such level);
                                                seeds from 2**40 (tools.EVAL_SEED) on are evaluations'
    answer_correct(question, answer)         -> bool: r_correct of R_M (the paper's eq. 4)
    expert_score(question, subtask, result,  -> float in [0, 1]: r_expert of R_S (the paper's eq. 5), given
                 reads)                         the text of each tool result S read (--judge replaces it)
    search_tool()                            -> .search(query, seed, level) -> [{"url", "title", "content"}]
                                                and .visit(url, seed, level, max_chars, allowed) -> text;
                                                both raise tools.SearchError
    demo(question, rng, noise, kind, chat)   -> a scripted conversation (messages) of agent `kind` (main,
                                                sub, single) for the cold start
and optionally
    TOOLS                                    the chat models' tool schemas by name (default: tools.TOOLS)
    f1(question, answer)                     -> float in [0, 1], logged beside r_correct (f1, eval_f1)
    use_search(search)                       is handed the run's search tool before any demo is made

The toy world: every question has its own knowledge base, made from the question's seed, so nothing
can be memorised. "country of ada ?" needs the city where ada lives and that city's country, read off
search results ("ada lives avon", "avon in norland", "ada knows bo"); M's sub-tasks read "city of
ada", "country of avon", "friend of ada", and S returns one entity.

    level 1 (easy):  "country of X ?"                      2 hops, 3 short clean snippets per search
    level 2 (hard):  "country of friend of X ?"            3 hops, 8 snippets, most of them noise
    level 3:         "country of friend of friend of X ?"  4 hops, 11 or 12 snippets

Levels 2 and 3 are deep research in miniature: a search matches the entity anywhere in a fact ("avon"
also finds "bo lives avon") and the fact asked for must be read out of much noise. The search tool
runs in-process (`ToySearch`) or as a server on 127.0.0.1 (toy_server.py), shaped like
SearXNG's JSON API: GET /search?q=<query>&format=json&kb=<seed>&level=<level> -> {"query", "results":
[{"url", "title", "content"}]}; a result's url, GET /page/<kb>/<level>/<entity>, is an HTML page. Both
give the same results and pages. In-process, a page's url is only toy://page/<entity>, since the
visit is told the question's world (seed, level) as the search is.
"""
import random
import re
from dataclasses import dataclass

from tools import NOT_AMONG, SearchError, action_text, search_observation, stable_seed

PERSONS = ("ada bo cy dex eli fay gus hal ivo jun kai lu mo ned oz "
           "pia quin ray sol tam uma vic wes xia yul zed abe bea cal dot").split()
CITIES = "avon brill cork dover elm fenn glen hove ilk jura".split()
COUNTRIES = "norland sudia westia eastia midia".split()
# sub-task relation -> (word in the fact, type of the subject, type of the value). No fact reads with
# its sub-task's word: with "ada friend bo" read for "friend of ada", a copy of the word after "friend"
# also found "of" in the question, and tiny models learned the friend hop by some seeds, not others
RELATIONS = {"city": ("lives", PERSONS, CITIES),
             "country": ("in", CITIES, COUNTRIES),
             "friend": ("knows", PERSONS, PERSONS)}
N_SNIPPETS = {1: 3, 2: 8, 3: 12}
N_MENTIONS = 3  # level 2: at most this many facts that name the entity as their value

WORDS = ["country", "city", "friend", "of", "?", "lives", "in", "knows", ";", "none"] + PERSONS + CITIES + COUNTRIES


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
    """The relations a question of this level asks for, in order (level 3: 4 hops, 11 or 12 snippets per search)."""
    return ["friend"] * (level - 1) + ["city", "country"]


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
    # the rest are distractors that share no relation with a fact about the entity and, at levels 2
    # and 3, name none of its values, so a reader finds the asked fact by its relation, and the word
    # asked for comes up once: a list that repeated it let a model read by counting (docs/toy-task.md)
    values = {kb[h] for h in hits if h[1] in words} if level >= 2 else set()
    others = [k for k in kb if k[1] not in words and k not in hits and k[1] not in values and kb[k] not in values]
    clean = [k for k in others if k[0] not in own]
    keys = hits + rng.sample(clean, min(len(clean), n - len(hits)))
    rng.shuffle(keys)
    # no seed in the url: ten digits per result, that a tiny model must read past, kept the chat
    # sub-agent's cold start from learning to read the results (docs/real-models.md)
    return [{"url": f"toy://page/{subj}", "title": subj,
             "content": fact_text(rel, subj, kb[(rel, subj)])} for rel, subj in keys]


def page_text(seed, level, entity):
    """The page behind a result: every fact about the entity, as sentences (None: no such page)."""
    kb = knowledge_base(seed, level)
    facts = [fact_text(rel, s, v) + "." for (rel, s), v in kb.items() if s == entity]
    return f"{entity}. " + " ".join(facts) if facts else None


_PAGE = re.compile(r"toy://page/([a-z]+)")


def toy_page(url, seed, level):
    """The text of the page at a toy URL in the world (seed, level), or None if it names no page."""
    m = _PAGE.fullmatch(url.strip())
    return page_text(seed, level, m.group(1)) if m and level in N_SNIPPETS else None


class ToySearch:
    """In-process search tool."""

    def search(self, query, seed, level):
        return search_results(seed, level, query)

    def visit(self, url, seed, level, max_chars=2000, allowed=()):
        """The page behind a result, in the question's world (seed, level), as search's; allowed: the
        URLs of this trajectory's own results."""
        if url not in allowed:
            raise SearchError(NOT_AMONG.format(url[:200]))
        text = toy_page(url, seed, level)
        if text is None:
            raise SearchError(f"cannot visit {url[:200]!r}: not a page of this search tool")
        return text[:max_chars]


# ---------------------------------------------------------------------------------------
# The reward checkers: r_correct of R_M (eq. 4), r_expert of R_S (eq. 5)
# ---------------------------------------------------------------------------------------
def parse_subtask(task):
    """'city of ada' -> ('city', 'ada'); None if it asks for no known relation."""
    w = task.lower().split()
    if len(w) == 3 and w[0] in RELATIONS and w[1] == "of":
        return w[0], w[2]
    return None


def answer_correct(q, answer):
    """r_correct of the main agent."""
    return answer is not None and answer.strip().lower() == q.answer


def expert_score(q, task, result, reads):
    """r_expert of eq. 5 (the paper uses an LLM judge, as --judge does): did the sub-agent return the fact its
    sub-task asked for? The toy world knows the fact, so what S read (`reads`) is not needed."""
    parsed = parse_subtask(task)
    if parsed is None or result is None:
        return 0.0
    truth = knowledge_base(q.seed, q.level).get(parsed)
    return float(truth is not None and result.strip().lower() == truth)


# ---------------------------------------------------------------------------------------
# The chat models' system prompts; scripted, deliberately noisy demos for the cold start
# ---------------------------------------------------------------------------------------
_WORLD = ("Facts read 'ada lives avon' (ada's city), 'avon in norland' (avon's country), "
          "'ada knows bo' (ada's friend). Reply with exactly one tool call, or with the final answer as <answer> word </answer>.")
SYSTEM = {
    "main": "You answer questions about people, cities and countries. You cannot search: call the sub_agent tool "
            "with one sub-task at a time. " + _WORLD,
    "sub": "You are a search agent: find the one word your task asks for (city of X: where X lives; country of "
           "X: the country city X is in; friend of X). Search, read the results, visit a page if you need. " + _WORLD,
    "single": "You answer questions about people, cities and countries. Search, read the results, visit a page "
              "if you need. " + _WORLD,
}


def _noisy(rng, value, pool, p):
    return rng.choice(pool) if rng.random() < p else value


def main_demo(q, rng, p, single=False, chat=False):
    """A scripted main-agent conversation (messages) with entity slots corrupted w.p. p.

    The tool results are what a perfect sub-agent would return for the (maybe wrong) sub-task, so the
    demo also teaches the main agent to carry a result forward. single=True: the single agent's demo,
    the same chain with the searches inlined; it reads every whole result list in its own context.
    chat=True: turns as chat models write them."""
    kb = knowledge_base(q.seed, q.level)
    x, thought = q.text.split()[-2], ""
    msgs = [{"role": "user", "content": q.text}]
    for rel in chain(q.level):
        x = _noisy(rng, x, RELATIONS[rel][1], p)
        act = action_text("search", x, chat) if single else action_text("call", f"{rel} of {x}", chat)
        obs = search_observation(search_results(q.seed, q.level, x), chat) if single else kb[(rel, x)]
        msgs += [{"role": "assistant", "content": thought + act}, {"role": "tool", "content": obs}]
        thought = quote(fact_text(rel, x, kb[(rel, x)])) if single else ""
        x = kb[(rel, x)]
    msgs.append({"role": "assistant", "content": thought + action_text("answer", _noisy(rng, x, COUNTRIES, p), chat)})
    return msgs


def quote(fact):
    """A chat model's thought before it acts on what it read: the fact, quoted. Copying the words that
    follow the entity in the results is a plain induction copy, which a tiny model learns early; picking
    the one word out of the results at once, it learned late or not at all (docs/real-models.md)."""
    return f"<think> {fact} </think>\n"


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
    thought = quote(fact_text(rel, e, value)) if found else ""
    msgs = [{"role": "user", "content": f"{rel} of {e}"},
            {"role": "assistant", "content": action_text("search", query, chat)},
            {"role": "tool", "content": search_observation(results, chat)}]
    page = next((r["url"] for r in results if r["title"] == e), None)
    if chat and page and rng.random() < 0.3:
        text = ToySearch().visit(page, q.seed, q.level, allowed=[r["url"] for r in results])
        msgs += [{"role": "assistant", "content": action_text("visit", page, chat)}, {"role": "tool", "content": text}]
    answer = action_text("return", _noisy(rng, value, values, p), chat)
    return msgs + [{"role": "assistant", "content": thought + answer}]
