"""Benchmark (prints figures; not a test): training's scoring pass with a shared prompt put through
the model once (`sampling.token_logprobs`), against every row scored whole, on the same batches.

A batch is the toy task's cold-start demos for one agent kind, built in code as `--chat` builds
its models (their system prompt is most of each row) or word-level. Each pass is a forward and a
backward of the summed log-probs of the mask-1 tokens, as in training; the two ways take turns.

    python -m benchmarks.bench_scoring                 # chat models, 16 and 64 demos per batch
    python -m benchmarks.bench_scoring --word          # the word-level models (short contexts)

Figures are wall-clock on whatever machine runs it; compare the rows of one run.
"""
import argparse
import random
import statistics
import time

import torch

import mgrpo
import toy_tools
from agents import load_agent
from cold_start import encode_demo
from sampling import collate, common_prefix, next_logp, token_logprobs
from tiny_models import SIZES


def whole(model, ids, attn):
    """token_logprobs without the shared prompt: every row through the model from its first token."""
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False).logits
    return torch.cat([torch.zeros_like(ids[:, :1], dtype=torch.float),
                      next_logp(logits[:, :-1], ids[:, 1:]) * (attn[:, 1:] * attn[:, :-1])], 1)


def timed(score, model, batch):
    """Seconds of one forward and backward of the summed mask-1 log-probs."""
    ids, attn, mask, _ = batch
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    (score(model, ids, attn) * mask).sum().backward()
    return time.perf_counter() - t0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model-size", default="0.2M", choices=list(SIZES))
    p.add_argument("--word", action="store_true", help="word-level models instead of chat models")
    p.add_argument("--batches", type=int, nargs="+", default=[16, 64], help="demos per batch")
    p.add_argument("--repeat", type=int, default=5, help="passes per way and batch; the median counts")
    b = p.parse_args()
    args = mgrpo.parse_args(["--model-size", b.model_size] + ([] if b.word else ["--chat"]))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {b.model_size}"
          f"{'' if b.word else ' chat'} models; median of {b.repeat} forward + backward passes")
    print(f"{'agent':>5} {'rows':>5} | {'tokens':>7} {'shared':>6} | {'whole s':>8} {'shared s':>8} | speed-up")
    rng = random.Random(0)
    for kind in ("main", "sub"):
        agent = load_agent("", args, toy_tools, seed=0)
        agent.model.train()
        for rows in b.batches:
            demos = [encode_demo(agent, toy_tools.demo(toy_tools.make_question(rng.randrange(2 ** 31), 1),
                                                       rng, 0.1, kind, agent.chat), kind) for _ in range(rows)]
            batch = collate(demos, agent.pad_id, "cpu")
            timed(token_logprobs, agent.model, batch)  # warm-up
            runs = [(timed(whole, agent.model, batch), timed(token_logprobs, agent.model, batch))
                    for _ in range(b.repeat)]  # the two ways take turns
            t_whole, t_shared = (statistics.median(r) for r in zip(*runs))
            print(f"{kind:>5} {rows:>5} | {int(batch[1].sum()):>7} {common_prefix(batch[0], batch[1]):>6} | "
                  f"{t_whole:8.3f} {t_shared:8.3f} | {t_whole / t_shared:7.2f}x")


if __name__ == "__main__":
    main()
