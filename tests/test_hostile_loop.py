"""Hostile model output through mgrpo's own loops: every turn a fuzzed string, as a model might
write it, goes through the parser, the tools, the context's token ids and a training step."""
import copy
import functools
import itertools

import pytest

import helpers
import mgrpo
import toy_tools
from test_hostile_tools import TAG_IN_ARG, fuzz_strings

# 12,000 strings of at most 4,000 characters each (the huge ones are in test_hostile_tools)
STRINGS = [s for s in fuzz_strings() if len(s) <= 4000]


def scripted(strings, sampled):
    """A stand-in for `generate`: each turn is the next fuzzed string, tokenized as a model's output
    would be, closed by the turn's end token."""
    it = itertools.cycle(strings)

    def generate(agent, contexts, max_new_tokens, seed, greedy=False, kept=None):
        out = []
        for _ in contexts:
            text = next(it).encode("utf-8", "replace").decode("utf-8")  # a tokenizer's text has no surrogates
            ids = agent.tok(text, add_special_tokens=False).input_ids[:max_new_tokens - 1] + [agent.end[0]]
            sampled.append(text)
            out.append((ids, [-1.0] * len(ids), True))
        return out
    return generate


@pytest.mark.slow
@pytest.mark.parametrize("chat", [False, True])
def test_fuzzed_turns_through_the_tool_loop_and_a_training_step(chat, monkeypatch):
    args = mgrpo.parse_args(["--cold-start", "0", "--max-turns", "4", "4",
                             "--max-new-tokens", "64", "--questions-per-step", "4", "--group-size", "4"]
                            + (["--chat", "--model-size", "0.1M"] if chat else []))
    sub = helpers.load_agent("", args, seed=0)
    main = helpers.load_agent("", args, seed=1)
    sampled = []
    monkeypatch.setattr(mgrpo, "generate", scripted(STRINGS, sampled))
    search = toy_tools.ToySearch()
    qs = [toy_tools.make_question(s, 1 + s % 2) for s in range(600)]
    ok = 0
    while len(sampled) < len(STRINGS):  # the sub-agent's loop: search, visit, return
        trajs = mgrpo.run_sub_agents(sub, args, search, [f"city of {toy_tools.PERSONS[i % 30]}" for i in range(len(qs))],
                                     qs, seed=0)
        for t in trajs:
            assert len(t.ids) == len(t.mask) == len(t.logp) and t.mask[-1] in (0, 1)
            ok += t.ok
            assert not t.ok or (t.result.strip() and not TAG_IN_ARG.search(t.result))
    # the whole system, fuzzed on both sides, through rewards, alignment and both updates
    delegate = functools.partial(mgrpo.run_sub_agents, sub, args, search)
    before = len(sampled)
    for step in range(3):
        rec = mgrpo.train_step(main, copy.deepcopy(sub) if step else sub, step, args, toy_tools, delegate, search)
        assert rec["main_reward"] >= 0 and rec["sub_calls"] >= 0
    assert len(sampled) > before
    print(f"{len(sampled)} fuzzed turns, {ok} valid final answers")
    assert len(sampled) >= 10_000


def test_a_tool_that_raises_anything_is_an_observation(monkeypatch, capsys):
    """A bug in a tool (here: any exception, not a SearchError) is read by the agent as an
    error, shown once as a warning, and the run goes on."""
    class Broken(toy_tools.ToySearch):
        def search(self, query, seed, level):
            raise KeyError(query)
    args = mgrpo.parse_args(["--cold-start", "0"])
    sub = helpers.load_agent("", args, seed=0)
    monkeypatch.setattr(mgrpo, "generate", scripted(["<search> ada </search>", "<return> avon </return>"], []))
    (t,) = mgrpo.run_sub_agents(sub, args, Broken(), ["city of ada"], [toy_tools.make_question(1, 1)], seed=0)
    inserted = sub.tok.decode([i for i, m in zip(t.ids, t.mask) if not m])
    assert t.ok and t.result == "avon" and "<tool> <unk> <unk> <assistant>" in inserted  # "error: KeyError"
    assert "warning: the search tool raised KeyError" in capsys.readouterr().out
