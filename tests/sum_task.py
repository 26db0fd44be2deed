"""A second tiny task, brought through the task interface that toy_tools.py describes:
"sum of kiwi and lime ?". Every question has its own values (0-9) for eight fruits; the sub-agent
looks one up ("value of kiwi": search, then read "kiwi is seven" among distractors), the main agent
asks for both and adds them. Another shape than the toy task's chain: two independent look-ups,
then arithmetic that only the main agent does.

    python mgrpo.py --task tests/sum_task.py --steps 50
"""
import random

import tools
from toy_tools import Question

NAMES = "kiwi lime fig date plum pear sloe yuzu".split()
NUMBERS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
           "sixteen seventeen eighteen").split()
WORDS = NAMES + NUMBERS + ["sum", "of", "and", "?", "value", "is"]
SYSTEM = {"main": "You add two numbers. You cannot search: call the sub_agent tool with 'value of <fruit>'.",
          "sub": "You are a search agent: find the value your task asks for and answer with it.",
          "single": "You add two numbers. Search for each value, then answer with the sum."}


def values(seed):
    rng = random.Random(seed)
    return {n: rng.randrange(10) for n in NAMES}


def make_question(seed, level):
    if level != 1:
        raise ValueError(f"level must be 1, got {level!r}")
    a, b = random.Random(seed + 1).sample(NAMES, 2)
    return Question(seed, level, f"sum of {a} and {b} ?", NUMBERS[values(seed)[a] + values(seed)[b]])


def answer_correct(q, answer):
    return answer is not None and answer.strip().lower() == q.answer


def expert_score(q, task, result, reads):
    w = task.lower().split()
    ok = len(w) == 3 and w[:2] == ["value", "of"] and w[2] in NAMES and result is not None
    return float(ok and result.strip().lower() == NUMBERS[values(q.seed)[w[2]]])


class Search:
    def search(self, query, seed, level):
        hits = [n for n in NAMES if n in query.lower().split()][:1]
        rng = random.Random(tools.stable_seed(seed, query))
        names = hits + rng.sample([n for n in NAMES if n not in hits], 3 - len(hits))
        rng.shuffle(names)
        return [{"url": f"sum://{seed}/{n}", "title": n, "content": f"{n} is {NUMBERS[values(seed)[n]]}"}
                for n in names]

    def visit(self, url, seed, level, max_chars=2000, allowed=()):
        raise tools.SearchError("this task has no pages")


def search_tool():
    return Search()


def demo(q, rng, p, kind, chat=False):
    """Scripted conversations with noise p: M asks for both values and adds them; S looks one up."""
    noisy = lambda value, pool: rng.choice(pool) if rng.random() < p else value  # noqa: E731
    if kind == "sub":
        name = rng.choice(NAMES)
        query = noisy(name, NAMES)
        results = Search().search(query, q.seed, q.level)
        found = [r["content"].split()[-1] for r in results if r["title"] == name]
        value = noisy(found[0] if found else rng.choice(NUMBERS[:10]), NUMBERS[:10])
        return [{"role": "user", "content": f"value of {name}"},
                {"role": "assistant", "content": tools.action_text("search", query, chat)},
                {"role": "tool", "content": tools.search_observation(results, chat)},
                {"role": "assistant", "content": tools.action_text("return", value, chat)}]
    v, (a, b) = values(q.seed), (q.text.split()[2], q.text.split()[4])
    msgs = [{"role": "user", "content": q.text}]
    for name in (a, b):
        tag, arg = ("search", name) if kind == "single" else ("call", f"value of {name}")
        obs = tools.search_observation(Search().search(name, q.seed, q.level), chat) if kind == "single" \
            else NUMBERS[v[name]]
        msgs += [{"role": "assistant", "content": tools.action_text(tag, arg, chat)}, {"role": "tool", "content": obs}]
    return msgs + [{"role": "assistant", "content": tools.action_text("answer", noisy(q.answer, NUMBERS), chat)}]
