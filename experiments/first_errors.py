"""Where each rollout of trained agents first goes wrong, on the held-out questions that mgrpo.py
evaluates (the same questions and sampling seeds, so its sampled success is the run's evaluation).

The system (--mode co-train): per hop of the question's chain, in order, whether M called S at all,
whether M wrote the right sub-task ("friend of ada": the name that S returned at the hop before
copied right), and whether S returned the right value; then whether M's answer is the value that S
returned last. The single agent (--mode single-agent): per hop, whether it searched for the right
entity (the first search copies the question's name; each later one the value read from the list
before), then whether its answer is right. Sampled at temperature 1 as in evaluation, then greedy;
with the tokens each agent sampled per question (each one a chance to go wrong at temperature 1).
It probes the toy task only; experiments/single.md uses it on the single experiment's runs:

    python -m experiments.first_errors --level 3 --max-sub 4 --max-turns 5 3 \\
        --main-model <run>/main --sub-model <run>/sub
    python -m experiments.first_errors --mode single-agent --level 3 --max-sub 4 --max-turns 5 3 \\
        --main-model <run>/main
"""
import collections
import functools
import re
import sys

import mgrpo
import toy_tools
from agents import load_agent
from experiments.sub_probe import sub_tasks


def system_error(q, chain, traj, subs):
    """The system's first mistake on question q: chain holds the right sub-task of each hop."""
    calls = [subs[i] for i in traj.calls]
    for h, task in enumerate(chain, 1):
        if h > len(calls):
            return f"M answered after {h - 1} calls"
        if calls[h - 1].task.strip() != task:
            return f"M wrote sub-task {h} wrong"
        if not toy_tools.expert_score(q, task, calls[h - 1].result, calls[h - 1].reads):
            return f"S misread hop {h}"
    return "M's answer is not the value S returned"


def single_error(agent, chain, traj):
    """The single agent's first mistake: its searches against the entity of each hop's sub-task."""
    asked = re.findall(r"<search> (\S+) </search>", agent.tok.decode(traj.ids))
    for h, task in enumerate(chain, 1):
        if h > len(asked):
            return f"answered after {h - 1} searches"
        if asked[h - 1] != task.split()[-1]:
            return f"search {h} for a wrong entity"
    return "answer wrong after every search right"


def trained_agents(args, script):
    """The trained main agent (or single agent), the toy search, and its delegate to S (None alone),
    seeded as mgrpo.py's evaluation seeds them; a clear exit where the options name no such agents."""
    if args.task != "toy_tools" or not args.main_model or (args.mode != "single-agent" and not args.sub_model):
        sys.exit(f"{script} probes trained agents on the toy task: give --main-model (and --sub-model)")
    agent = load_agent(args.main_model, args, toy_tools, seed=args.seed)
    search, delegate = toy_tools.ToySearch(), None
    if args.mode != "single-agent":
        sub = load_agent(args.sub_model, args, toy_tools, seed=args.seed + 1)
        delegate = functools.partial(mgrpo.run_sub_agents, sub, args, search)
    return agent, search, delegate


def main(argv=None):
    args = mgrpo.parse_args(argv)
    agent, search, delegate = trained_agents(args, "first_errors.py")
    qs, tasks = sub_tasks(args.level[0], args.eval_questions)  # the questions of mgrpo.evaluate, in its order
    for greedy in (False, True):
        chains = zip(*tasks.values())  # per question, its sub-task per hop
        kinds, tokens = collections.Counter(), [0, 0]  # tokens sampled by M (or the single agent), by S
        for batch, trajs, subs in mgrpo.eval_rollouts(agent, args, toy_tools, delegate, search, greedy):
            tokens[0] += sum(sum(t.mask) for t in trajs)
            tokens[1] += sum(sum(t.mask) for t in subs)
            for t, q, chain in zip(trajs, batch, chains):
                kinds["right" if t.ok and toy_tools.answer_correct(q, t.result) else
                      single_error(agent, chain, t) if delegate is None else system_error(q, chain, t, subs)] += 1
        per_q = f"{tokens[0] / len(qs):.1f}" + (f" by M, {tokens[1] / len(qs):.1f} by S" if delegate else "")
        print(f"{'greedy' if greedy else 'sampled'}: success {kinds['right'] / len(qs):.3f}; tokens sampled per "
              f"question {per_q}; first mistakes: "
              + (", ".join(f"{k} {v}" for k, v in kinds.most_common() if k != "right") or "none"), flush=True)


if __name__ == "__main__":
    main()
