"""How sure the main agent is to answer rather than delegate once more, where it answers.

On the held-out questions that mgrpo.py evaluates, the agents given (--main-model, --sub-model)
run greedy; at each place where M opens its answer, this prints, for M and for each model of
--compare (other main agents, e.g. the same run a step later), log p(<answer>) - log p(<call>)
at that token: its median, its least value and the share below 0 (where that M would delegate
again instead). For the M that ran greedy it is never below 0. experiments/paper.md uses it on a
run whose M began to delegate a fourth time after one update:

    python -m experiments.answer_margin --level 2 --max-sub 3 --seed 3 --eval-questions 64 \\
        --main-model <run at 17 steps>/main --sub-model <run at 17 steps>/sub \\
        --compare <stage 1>/main <run at 18 steps>/main
"""
import argparse
import sys

import numpy as np
import torch

import mgrpo
import toy_tools
from agents import load_agent
from experiments.first_errors import trained_agents


def answer_contexts(agent, args, delegate, search, open_id):
    """M's greedy rollouts on the held-out questions, each cut just before its answer's first token."""
    contexts = []
    for _, trajs, _ in mgrpo.eval_rollouts(agent, args, toy_tools, delegate, search, greedy=True):
        for t in trajs:
            ids = list(t.ids)
            if open_id in ids:
                contexts.append(ids[:ids.index(open_id)])
    return contexts


@torch.no_grad()
def margins(agent, contexts, open_id, call_id):
    """log p(open_id) - log p(call_id) at the next token of each context."""
    out = []
    for c in contexts:
        logits = agent.model(input_ids=torch.tensor([c], device=agent.model.device)).logits[0, -1]
        lp = torch.log_softmax(logits.float(), -1)
        out.append(float(lp[open_id] - lp[call_id]))
    return np.array(out)


def main(argv=None):
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--compare", nargs="*", default=[], help="other main agents to read at the same places")
    own, rest = p.parse_known_args(argv)
    args = mgrpo.parse_args(rest)
    if args.mode == "single-agent":
        sys.exit("answer_margin.py reads a system's main agent: --mode co-train, with --sub-model")
    agent, search, delegate = trained_agents(args, "answer_margin.py")
    open_id, call_id = agent.tok.convert_tokens_to_ids("<answer>"), agent.tok.convert_tokens_to_ids("<call>")
    contexts = answer_contexts(agent, args, delegate, search, open_id)
    print(f"{len(contexts)} of {args.eval_questions} questions answered (greedy) by {args.main_model}")
    for name in [args.main_model, *own.compare]:
        m = margins(agent if name == args.main_model else load_agent(name, args, toy_tools), contexts,
                    open_id, call_id)
        if len(m):
            print(f"{name}: log p(<answer>) - log p(<call>) median {np.median(m):.2f}, least {m.min():.2f}, "
                  f"below 0 at {int((m < 0).sum())} of {len(m)}", flush=True)
    return contexts


if __name__ == "__main__":
    main()
