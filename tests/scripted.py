"""Scripted agents for tests: rollouts whose structure is known in advance.

`forced(policy)` stands in for `mgrpo.generate`: each turn is the text the policy chooses,
tokenized, and its log-probs are the real model's for those tokens (teacher forcing), so an
update on a scripted batch sees the ratio 1 as after real sampling.

`Plan` scripts the word-level toy agents: per rollout k of a question, M's turns (so M
delegates exactly d_k times and answers right, wrong or in a broken format); per sub-task, what
S does (reads the fact off its search results, returns a wrong entity, or breaks its format).
"""
import re

import torch

import tools
import toy_tools
from agents import Traj
from sampling import collate, token_logprobs


def forced(policy):
    """generate(agent, contexts, ...) -> the policy's turns: policy(agent, context text, row) -> text."""
    def generate(agent, contexts, max_new_tokens, seed, greedy=False, kept=None):
        turns = []
        for row, ctx in enumerate(contexts):
            text = policy(agent, agent.tok.decode(ctx), row)
            turns.append(agent.tok(text, add_special_tokens=False).input_ids + [agent.end[0]])
        trajs = [Traj(c + t, [0] * len(c) + [1] * len(t), [0.0] * (len(c) + len(t)))
                 for c, t in zip(contexts, turns)]
        ids, attn, _, _ = collate(trajs, agent.pad_id, agent.model.device)
        with torch.no_grad():
            lp = token_logprobs(agent.model, ids, attn)
        return [(t, lp[b, len(c):len(c) + len(t)].tolist(), True) for b, (c, t) in enumerate(zip(contexts, turns))]
    return generate


class Plan:
    """M's turns per rollout, S's behaviour per sub-task, for the word-level toy agents.

    main: {k: [("call", task) ..., ("answer", text) or ("bad", None)]}, the same plan for rollout
    k of every question; an argument may be a function of the question's text. A rollout's
    first turn carries the marker <think> PERSONS[k] </think>, so that its later turns find
    their plan in the context.
    sub: {task: "ok" | "wrong" | "bad"}; tasks not listed are "ok".
    """

    def __init__(self, main, sub=None):
        self.main, self.sub = main, sub or {}

    def __call__(self, agent, text, row):
        if text.startswith("<user> country"):  # M (or the single agent): its question
            turns = text.count("<eos>")
            k = row % len(self.main) if turns == 0 else toy_tools.PERSONS.index(
                re.search(r"<think> (\w+) </think>", text).group(1))
            tag, arg = self.main[k][turns]
            arg = arg(text.split("<assistant>")[0].replace("<user>", "").strip()) if callable(arg) else arg
            marker = f"<think> {toy_tools.PERSONS[k]} </think> " if turns == 0 else ""
            return marker + ("<answer> </answer>" if tag == "bad" else tools.action_text(tag, arg))
        task = text.split("<assistant>")[0].replace("<user>", "").strip()
        rel, entity = task.split(" of ")
        if "<tool>" not in text:
            return tools.action_text("search", entity)
        results = text.split("<tool>")[-1]
        fact = re.search(rf"\b{entity} {toy_tools.RELATIONS[rel][0]} (\w+)", results)
        how = self.sub.get(task, "ok")
        if how == "bad":
            return "<return> </return>"
        value = fact.group(1) if fact else "none"
        if how == "wrong":
            value = next(v for v in toy_tools.RELATIONS[rel][2] if v != value)
        return tools.action_text("return", value)
