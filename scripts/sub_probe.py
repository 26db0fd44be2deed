"""How well does the sub-agent read after its cold start? Expert score per relation.

Builds the sub-agent exactly as `python mgrpo.py <options>` does (same seeds), runs its
cold start alone, then gives it 200 held-out sub-tasks per relation and level and
prints the share it answers right (r_expert), greedy and sampled at temperature 1.
The tutorial's figures on the comparison's cold-start settings come from it:

    python scripts/sub_probe.py --sft-levels 1,2,2 --sft-lr 1e-3
    python scripts/sub_probe.py --sub-model runs/compare/stage1-system/sub --sft-steps 0
    python scripts/sub_probe.py --help     # any mgrpo.py option
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import mgrpo  # noqa: E402
import toy_tools  # noqa: E402


def sub_tasks(level, n=200):
    """n held-out questions of this level and, per relation of its chain, the sub-task
    that a perfect main agent would write."""
    qs = [toy_tools.make_question(mgrpo.EVAL_SEED + i, level) for i in range(n)]
    tasks = {rel: [] for rel in toy_tools.chain(level)}
    for q in qs:
        kb, x = toy_tools.knowledge_base(q.seed, level), q.text.split()[-2]
        for rel in toy_tools.chain(level):
            tasks[rel].append(f"{rel} of {x}")
            x = kb[(rel, x)]
    return qs, tasks


def main(argv=None):
    args = mgrpo.parse_args(argv)
    t0 = time.time()
    sub = mgrpo.load_agent(args.sub_model, args, seed=args.seed + 1)
    if args.sft_steps:
        mgrpo.cold_start(sub, "sub", args, toy_tools.stable_seed(args.seed, "sft-sub"))
    search = toy_tools.ToySearch()
    what = [f"from {args.sub_model}"] if args.sub_model else []
    if args.sft_steps:
        what.append(f"after {args.sft_steps} cold-start steps (levels {args.sft_levels or args.level}, "
                    f"lr {args.sft_lr}, seed {args.seed})")
    print(f"sub-agent {' '.join(what)}, {time.time() - t0:.0f}s; expert score greedy / sampled:")
    for level in (1, 2):
        qs, tasks = sub_tasks(level)
        scores = []
        for rel, ts in tasks.items():
            acc = []
            for greedy in (True, False):
                trajs = mgrpo.run_sub_agents(sub, ts, qs, args, search, seed=0, greedy=greedy)
                acc.append(sum(toy_tools.expert_score(q, t.task, t.result) for q, t in zip(qs, trajs)) / len(qs))
            scores.append(f"{rel} {acc[0]:.2f} / {acc[1]:.2f}")
        print(f"  level {level}: " + ", ".join(scores), flush=True)


if __name__ == "__main__":
    main()
