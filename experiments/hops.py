"""How trained agents go about a question file's multi-hop questions (those with a
`question_decomposition`), on the held-out questions that mgrpo.py evaluates: the same questions and
sampling seeds, so its sampled success is the run's evaluation.

Per rollout it counts M's delegations to S, against answering from what M knows (no delegation), and
for each hop whether S ever returned that hop's answer (normalized, whole words, in any of its
results). A wrong answer is put down to its first cause in this order: M answered without
delegating; the first hop's fact never came back from S; a later hop's fact never came back; M's
answer was wrong although S returned every hop's fact; each cause's questions are listed by their
number in the evaluation (experiments/recall.py numbers them alike). Sampled at temperature 1, then greedy.
experiments/geo.md uses it on the SmolLM2 runs:

    python -m experiments.hops --task qa:data/geo/questions.jsonl --search bm25:data/geo/corpus.jsonl \\
        --max-new-tokens 64 --main-model <run>/main --sub-model <run>/sub
"""
import collections
import functools
import sys

import transformers

import mgrpo
import run
from agents import load_agent
from qa_task import QaTask, holds_words
from tools import EVAL_SEED


def returned(answer, subs):
    """Whether any of S's results holds the hop's answer as whole words."""
    return holds_words(answer, (s.result or "" for s in subs))


def first_cause(task, q, traj, subs):
    """The rollout's outcome: right, or the first cause of its wrong answer (see the docstring)."""
    if traj.ok and task.answer_correct(q, traj.result):
        return "right"
    if not traj.calls:
        return "answered without delegating"
    calls = [subs[i] for i in traj.calls]
    for h, (_, answer) in enumerate(q.hops, 1):
        if not returned(answer, calls):
            return "first hop's fact never came back" if h == 1 else f"hop {h}'s fact never came back"
    return "M's answer wrong though S returned every hop's fact"


def probe(agent, args, task, delegate, search, greedy):
    """(outcomes, M's delegations per rollout, per hop: rollouts whose S returned its fact, per outcome: the
    numbers of its questions in the evaluation, from 1) over the evaluation."""
    causes, calls, facts = collections.Counter(), collections.Counter(), collections.Counter()
    which = collections.defaultdict(list)
    for batch, trajs, subs in mgrpo.eval_rollouts(agent, args, task, delegate, search, greedy):
        for t, q in zip(trajs, batch):
            cause = first_cause(task, q, t, subs)
            causes[cause] += 1
            which[cause].append(q.seed - EVAL_SEED + 1)  # the evaluation's question number (recall.py's too)
            calls[min(len(t.calls), 3)] += 1
            mine = [subs[i] for i in t.calls]
            facts.update(h for h, (_, a) in enumerate(q.hops, 1) if returned(a, mine))
    return causes, calls, facts, which


def report(name, causes, calls, facts, which):
    n = sum(causes.values())
    share = lambda c: f"{c / n:.3f}"  # noqa: E731
    print(f"{name}: success {share(causes['right'])} of {n}; M's delegations per rollout: "
          + ", ".join(f"{k if k < 3 else '3+'}: {share(calls[k])}" for k in sorted(calls))
          + "; S returned hop " + ", ".join(f"{h}'s fact {share(facts[h])}" for h in sorted(facts)), flush=True)
    wrong = n - causes["right"]
    print(f"  first causes of the {wrong} wrong answers: "
          + (", ".join(f"{k} {v}" for k, v in causes.most_common() if k != "right") or "none"), flush=True)
    for k, _ in causes.most_common():
        if k != "right":
            print(f"    {k}: questions {', '.join(map(str, which[k]))}", flush=True)


def main(argv=None):
    args = mgrpo.parse_args(argv)
    task = run.load_task(args.task)
    if not isinstance(task, QaTask) or args.mode == "single-agent" or not args.main_model or not args.sub_model:
        sys.exit("hops.py probes trained agents on a question file: give --task qa:FILE, --main-model and --sub-model")
    search, _ = run.outside(args, task)
    transformers.utils.logging.disable_progress_bar()
    agent = load_agent(args.main_model, args, task, seed=args.seed)
    sub = load_agent(args.sub_model, args, task, seed=args.seed + 1)
    delegate = functools.partial(mgrpo.run_sub_agents, sub, args, search)
    for greedy in (False, True):
        report("greedy" if greedy else "sampled", *probe(agent, args, task, delegate, search, greedy))


if __name__ == "__main__":
    main()
