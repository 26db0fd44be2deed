"""Open questions over a corpus of passages, as a task (the interface of toy_tools.py):

    python mgrpo.py --chat --task qa:questions.jsonl --search bm25:corpus.jsonl [--judge URL]

The question file holds one JSON object a line: {"question": str, "answers": [str, ...]}, with an optional
"id" (a string or an integer), "split" ("train" or "test") and "question_decomposition", the question's
hops in MuSiQue's shape: [{"question": str, "answer": str}, ...], where "#1" in a later hop stands for the
first hop's answer; other keys are ignored. A line without a
split is held out by a hash of its question: one in TEST_SHARE goes to the test split, the same ones on
every machine. Training questions come from the train split alone, evaluations' from the test split
alone (question seeds at or above tools.EVAL_SEED), in the file's order, from the first again
when --eval-questions asks for more (so do the cold start's checks); a train question that is also a test
question (the same once normalized) is dropped from training. A malformed line stops the run at start-up
with its file and line number. docs/own-questions.md: HotpotQA and Wikipedia in these shapes.

    r_correct (eq. 4)  M's answer, normalized as SQuAD does (lower case, no punctuation, no articles, one
                       space between words), equals a gold answer's; `f1`, the best word F1 over the golds,
                       is logged beside it (metrics.jsonl: f1, eval_f1)
    r_expert (eq. 5)   without --judge: S's answer, normalized, is found whole in a passage S read
    demos              M delegates the question and answers with what S returns; S (and the single agent)
                       searches the question and answers with the words of a result that holds a gold
                       answer, quoted first. A question with hops: M delegates each hop in turn, the
                       answers before it filled in, then answers; S's demos are hops. Train questions
                       only, searched with the run's search tool

Open questions need the chat path, --chat (tiny chat models built here) or instruct models: the
word-level models built here read only a task's WORDS, and this task has none (run.py says so).
"""
import re
import string
from collections import Counter
from dataclasses import dataclass

from tools import (CHECK_SEED, EVAL_SEED, SearchError, action_text, clean_text, json_lines, search_observation, stable_seed,
                   tool_schema)

TEST_SHARE = 10      # a file without splits: 1 question in 10 (by a hash of its text) is held out
MAX_LINE = 100_000   # bytes of one line of the question file (an answer may come with many aliases)
MAX_QUESTION = 2000  # characters of one question
MAX_HOPS = 8         # hops of one question_decomposition
N_TRIES = 4          # a demo of S tries up to this many train questions for one whose search finds an answer
QUOTE_WORDS = 8      # a demo's quote: the answer and this many words of the passage on each side

WORDS = None  # an open vocabulary: no word-level model built here can read it
_DONE = "Reply with exactly one tool call, or with the answer, a short phrase, as <answer> ... </answer>."
SYSTEM = {
    "main": "You answer questions. You cannot search: give the sub_agent tool a question to look up (the whole "
            "question, or one step of it), one at a time, then answer. " + _DONE,
    "sub": "You are a search agent: answer your task from the passages a search returns, in their words. Search, "
           "read the results, visit a passage if you need. " + _DONE,
    "single": "You answer questions. Search, read the results, visit a passage if you need. " + _DONE,
}


TOOLS = {  # the chat models' tools as this task describes them (tools.TOOLS: the toy task's)
    "sub_agent": tool_schema("sub_agent", "Ask the sub-agent, which can search, to look up one question. It returns a "
                       "short answer.", "task", "a question to look up: the whole question, or one step of it"),
    "search": tool_schema("search", "Search the passages. Returns the best few: title, url, text.", "query",
                    "what to search for"),
    "visit": tool_schema("visit", "Read the whole passage at a url from the search results.", "url", "the url"),
}


@dataclass
class Question:
    seed: int
    level: int
    text: str     # what M reads
    answers: list  # the gold answers
    id: object = None
    hops: tuple = ()  # ((sub-question, its answer), ...): the question's decomposition, "#k" for hop k's answer


# ---------------------------------------------------------------------------------------
# The question file
# ---------------------------------------------------------------------------------------
def question_line(obj, where):
    """(question, answers, id, hops, split or None) of one line's object, or a ValueError that names the line."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: not a JSON object")
    q, answers, qid, split = obj.get("question"), obj.get("answers"), obj.get("id"), obj.get("split")
    if not isinstance(q, str) or not q.strip() or len(q) > MAX_QUESTION:
        raise ValueError(f"{where}: 'question' must be a string of 1 to {MAX_QUESTION} characters")
    if not (isinstance(answers, list) and answers and all(isinstance(a, str) and normalize(clean_text(a))
                                                          for a in answers)):
        raise ValueError(f"{where}: 'answers' must be a non-empty list of strings, each with a word in it")
    if qid is not None and (isinstance(qid, bool) or not isinstance(qid, (str, int))):
        raise ValueError(f"{where}: 'id' must be a string or an integer")
    if split not in (None, "train", "test"):
        raise ValueError(f"{where}: 'split' must be \"train\" or \"test\", not {str(split)[:40]!r}")
    tidy = lambda s: " ".join(clean_text(s).split())  # noqa: E731
    return tidy(q), [tidy(a) for a in answers], qid, hops_of(obj.get("question_decomposition"), where), split


def hops_of(hops, where):
    """((sub-question, answer), ...) of a question_decomposition (MuSiQue's shape; its other keys ignored),
    () without one, or a ValueError that names the line."""
    if hops is None:
        return ()
    if not (isinstance(hops, list) and 0 < len(hops) <= MAX_HOPS and all(
            isinstance(h, dict) and isinstance(h.get("question"), str) and 0 < len(h["question"].strip())
            and len(h["question"]) <= MAX_QUESTION and isinstance(h.get("answer"), str)
            and len(h["answer"]) <= MAX_QUESTION and normalize(clean_text(h["answer"])) for h in hops)):
        raise ValueError(f"{where}: 'question_decomposition' must be a list of 1 to {MAX_HOPS} objects, each "
                         f"a \"question\" and an \"answer\" of 1 to {MAX_QUESTION} characters, a word in the answer")
    hops = tuple((" ".join(clean_text(h["question"]).split()), " ".join(clean_text(h["answer"]).split()))
                 for h in hops)
    if any(len(filled(q, [a for _, a in hops[:k]])) > MAX_QUESTION for k, (q, _) in enumerate(hops)):
        raise ValueError(f"{where}: a hop of 'question_decomposition', its #k filled in, is over {MAX_QUESTION} "
                         "characters")
    return hops


def filled(question, answers):
    """A hop's question with "#k" replaced by hop k's answer, for the hops answered so far."""
    return re.sub(r"#(\d{1,3})(?!\d)", lambda m: answers[int(m.group(1)) - 1] if 0 < int(m.group(1)) <= len(answers)
                  else m.group(0), question)


def read_questions(path):
    """(train, test) of a question file, each a list of (question, answers, id, hops); a ValueError that
    names the file (and the line) if it is malformed or leaves a split empty."""
    rows = [question_line(obj, where) for _, where, obj in json_lines(path, MAX_LINE)]
    if not rows:
        raise ValueError(f"{path}: no questions (one JSON object a line: question, answers, optional id, split)")
    hashed = lambda q: "test" if stable_seed("qa-split", normalize(q)) % TEST_SHARE == 0 else "train"  # noqa: E731
    test = [row[:4] for row in rows if (row[4] or hashed(row[0])) == "test"]
    held = {normalize(q) for q, *_ in test}
    train = [row[:4] for row in rows if (row[4] or hashed(row[0])) == "train" and normalize(row[0]) not in held]
    if not test:
        raise ValueError(f"{path}: no test questions: mark some \"split\": \"test\" (without splits 1 question "
                         f"in {TEST_SHARE} is held out, by a hash of its text)")
    if not train:
        raise ValueError(f"{path}: no training questions: every one is in the test split")
    return train, test


# ---------------------------------------------------------------------------------------
# The checkers: r_correct (eq. 4) with its F1, r_expert (eq. 5) without a judge
# ---------------------------------------------------------------------------------------
_PUNCT = str.maketrans("", "", string.punctuation)
STOP_WORDS = frozenset("""a about above after again all also am an and any are as at be because been before being
below between both but by can could did do does doing down during each few for from further had has have having he
her here hers herself him himself his how i if in into is it its itself just me more most my myself no nor not of off
on once only or other our ours ourselves out over own same she should so some such than that the their theirs them
themselves then there these they this those through to too under until up very was we were what when where which
while who whom why will with would yes you your yours yourself yourselves""".split())  # r_expert's: no answer alone


def normalize(s):
    """SQuAD's answer normalization: lower case, punctuation out, the articles a, an, the out, one space."""
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", s.lower().translate(_PUNCT)).split())


def holds_words(answer, texts):
    """Whether an answer, normalized, is whole words of any of the texts, normalized; an empty one never is."""
    a = normalize(answer or "")
    return bool(a) and any(f" {a} " in f" {normalize(t)} " for t in texts)


def word_f1(answer, gold):
    """SQuAD's F1 of two answers' normalized words (two empty answers: 1)."""
    a, g = normalize(answer).split(), normalize(gold).split()
    if not a or not g:
        return float(a == g)
    same = sum((Counter(a) & Counter(g)).values())
    return 0.0 if same == 0 else 2 * same / (len(a) + len(g))  # 2PR / (P + R), P = same/|a|, R = same/|g|


def passage_text(read):
    """The passages' words in a tool result: a search's result numbers and urls out ('[1] ', '(doc://7)'), so
    that an answer such as "1" or "doc" is not found in every list; a tool's error or an empty search: ''."""
    if read.startswith("error:") or read == "none":
        return ""
    return re.sub(r"(?m)^\[\d+\] |\(\w+://[^\s()]*\)", " ", read)  # no '(' in a url: linear (a run of
    # '(a://' pieces would each scan to its end)


# ---------------------------------------------------------------------------------------
# The task
# ---------------------------------------------------------------------------------------
class QaTask:
    """The task interface (toy_tools.py) over one question file; run.load_task("qa:PATH") makes it."""
    WORDS, SYSTEM, TOOLS = WORDS, SYSTEM, TOOLS

    def __init__(self, path):
        self.train, self.test = read_questions(path)
        self.held = {normalize(q) for q, *_ in self.test}  # a hop that is a test question never makes a demo
        self.search = None  # the run's search tool, for the demos (use_search)

    def make_question(self, seed, level):
        """A train question for a seed below EVAL_SEED, a test question (in the file's order) for one from there
        up to CHECK_SEED; from CHECK_SEED on (the cold start's checks) a train question again, in the file's
        order: a check that picks the cold start's rounds must not see the test split."""
        if level != 1:
            raise ValueError(f"a question file has one level, 1; got {level!r}")
        pool, i = ((self.train, seed - CHECK_SEED) if seed >= CHECK_SEED else (self.test, seed - EVAL_SEED)
                   if seed >= EVAL_SEED else (self.train, seed))
        return Question(seed, level, *pool[i % len(pool)])

    def answer_correct(self, q, answer):
        a = normalize(answer or "")
        return bool(a) and a in {normalize(g) for g in q.answers}

    def f1(self, q, answer):
        """Logged beside r_correct (mgrpo.main_side, eval_record): the best word F1 over the golds."""
        return 0.0 if answer is None else max(word_f1(answer, g) for g in q.answers)

    def expert_score(self, q, subtask, result, reads):
        """r_expert without a judge: S's answer, normalized, whole in a passage it read (its search results or
        visits), and with a word of its own: neither a stop word nor a word of the sub-task (else any word
        read, "of" or the sub-task's own "Ulm", would score). It checks that S's answer is grounded, not that
        it answers the sub-task: --judge does that. A choice the sub-task offers ("Ulm or Bonn?") may be the
        answer; a yes or a no never scores alone (both are stop words)."""
        a, words = normalize(result or ""), normalize(subtask or "").split()
        offered = {w for i, w in enumerate(words) if "or" in words[max(0, i - 1):i] + words[i + 1:i + 2]} - {"or"}
        asked = (set(words) - offered) | STOP_WORDS
        return float(any(w not in asked for w in a.split()) and holds_words(a, (passage_text(r) for r in reads)))

    def search_tool(self):
        raise SearchError("a qa task has no search tool of its own: give --search bm25:CORPUS.jsonl, or a "
                          "retriever's URL ending in /retrieve")

    def use_search(self, search):
        """The run's search tool (run.search_tool), which the demos search with."""
        self.search = search

    def demo(self, q, rng, p, kind, chat=False):
        """A scripted conversation of agent `kind` for the cold start, from train questions only. M delegates
        the question, or each of its hops in turn with the answers before filled in, and answers with S's
        last return, the gold answer (a perfect S); S and the single agent search the question (S: one of
        its hops, as M would delegate it) and answer with a result's words that hold a gold answer, quoted
        first. With probability p the answer is another question's (noise, as the toy task's demos have)."""
        if q.seed >= EVAL_SEED:
            raise ValueError("demos are made from train questions only")
        hops = q.hops or ((q.text, q.answers[0]),)
        if kind == "main":
            turns, answers = [{"role": "user", "content": q.text}], []
            for sub_q, answer in hops:
                turns += [{"role": "assistant", "content": action_text("call", filled(sub_q, answers), chat)},
                          {"role": "tool", "content": answer}]
                answers.append(answer)
            return turns + [{"role": "assistant", "content": action_text("answer", self.noisy(rng, q.answers[0], p),
                                                                         chat)}]
        q, results, found = self.findable(q, rng, hop=kind == "sub")
        thought, answer = (f"<think> {found[0]} </think>\n", found[1]) if found else ("", q.answers[0])
        final = action_text("return" if kind == "sub" else "answer", self.noisy(rng, answer, p), chat)
        return [{"role": "user", "content": q.text},
                {"role": "assistant", "content": action_text("search", q.text, chat)},
                {"role": "tool", "content": search_observation(results, chat)},
                {"role": "assistant", "content": thought + final}]

    def findable(self, q, rng, hop=False):
        """(a train question, its search results, (quote, answer) or None): q, or if its search finds no gold
        answer, the first of up to N_TRIES other train questions' whose search does (else the last tried);
        with `hop`, one of the question's hops (if it has them) as M delegates it, the answers before it
        filled in."""
        if self.search is None:
            raise RuntimeError("the qa task's demos search: the run hands it its search tool first (use_search)")
        for attempt in range(N_TRIES):
            if attempt:
                q = self.make_question(rng.randrange(2 ** 31), 1)
            if hop and q.hops:
                k = rng.randrange(len(q.hops))
                q = Question(q.seed, q.level, filled(q.hops[k][0], [a for _, a in q.hops[:k]]), [q.hops[k][1]])
                if normalize(q.text) in self.held:
                    continue
            try:
                results = self.search.search(q.text, q.seed, q.level)
            except SearchError:
                results = []
            found = next(filter(None, (quote(r["content"], q.answers) for r in results)), None)
            if found:
                break
        return q, results, found

    def noisy(self, rng, answer, p):
        return self.train[rng.randrange(len(self.train))][1][0] if rng.random() < p else answer


def quote(text, answers):
    """(the words of `text` around the first gold answer found whole in it, that answer as `text` writes
    it), or None."""
    for a in answers:
        m = re.search(r"(?<!\w)" + re.escape(a) + r"(?!\w)", text, re.I)
        if m:
            before, after = text[:m.start()].split()[-QUOTE_WORDS:], text[m.end():].split()[:QUOTE_WORDS]
            return " ".join(before + [m.group(0)] + after), m.group(0)
    return None
