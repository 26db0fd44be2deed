"""Benchmark (prints figures; not a test): time per M-GRPO step, split into generation,
log-prob recomputation (the training forward pass) and update (backward + optimizer),
with tokens/s, for the model sizes built in code.

    python -m benchmarks.bench                    # 0.1M, 0.2M (the default), 1M, 4M; a short cold start each
    python -m benchmarks.bench --sizes 1M --steps 5

A short cold start first, so that rollouts look like training ones (valid formats,
about two sub-agent calls per rollout) rather than a random model's garbage.
Figures are wall-clock on whatever machine runs it; compare sizes within one run.
"""
import argparse
import functools
import resource

import numpy as np

import mgrpo
import toy_tools
from agents import load_agent
from cold_start import cold_start
from tiny_models import SIZES


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=["0.1M", "0.2M", "1M", "4M"], choices=list(SIZES))
    p.add_argument("--steps", type=int, default=10, help="timed M-GRPO steps per size (after 2 warm-up steps)")
    p.add_argument("--sft-steps", type=int, default=300, help="cold-start steps before timing")
    p.add_argument("--device", default="cpu")
    b = p.parse_args()
    search = toy_tools.ToySearch()
    print(f"{'size':>5} {'params':>7} | {'gen s':>6} {'logp s':>6} {'update s':>8} {'step s':>6} | "
          f"{'gen tok/s':>9} {'train tok/s':>11} | {'rollouts':>8} {'sub calls':>9} | {'peak RSS so far':>16}")
    for size in b.sizes:
        args = mgrpo.parse_args(["--model-size", size, "--cold-start", str(b.sft_steps), "--device", b.device])
        main_a, sub_a = load_agent("", args, toy_tools, 0), load_agent("", args, toy_tools, 1)
        cold_start(main_a, "main", args, toy_tools, 0, b.sft_steps)
        cold_start(sub_a, "sub", args, toy_tools, 1, b.sft_steps)
        delegate = functools.partial(mgrpo.run_sub_agents, sub_a, args, search)
        recs = [mgrpo.train_step(main_a, sub_a, s, args, toy_tools, delegate, search) for s in range(b.steps + 2)][2:]
        m = {k: float(np.mean([r[k] for r in recs])) for k in
             ("t_gen", "t_fwd", "t_bwd", "t_step", "gen_tokens_per_s", "train_tokens_per_s", "sub_calls")}
        n = sum(p.numel() for p in main_a.model.parameters())
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # KiB -> GiB, Linux
        print(f"{size:>5} {n / 1e6:6.2f}M | {m['t_gen']:6.3f} {m['t_fwd']:6.3f} {m['t_bwd']:8.3f} "
              f"{m['t_step']:6.3f} | {m['gen_tokens_per_s']:9.0f} {m['train_tokens_per_s']:11.0f} | "
              f"{args.questions_per_step * args.group_size:8d} {m['sub_calls']:9.0f} | {rss:14.2f}GB", flush=True)


if __name__ == "__main__":
    main()
