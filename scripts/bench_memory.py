"""Peak memory of one training micro-batch at a real model's shape, measured on the CPU.

A model with Qwen2.5-0.5B-Instruct's configuration is built in code with random weights (the hub
cannot be reached from the machines this was measured on; the shape is what sets the memory). Each
setting runs in a process of its own: build the model and its AdamW, then one step (the policy's
log-probs, backward, AdamW), after a first step on 8 tokens that allocates AdamW's states, as any
step after a run's first has them. The peak resident memory of the process (ru_maxrss) is printed
with the time of the step and the estimate that mgrpo prints at start-up (run.memory_estimate), for the
loss mask's two ways of scoring:

- whole: the head and log-softmax at every position (what token_logprobs did before it took a mask)
- masked: the head only where the loss reads a log-prob (mask 1: the sampled tokens)

    python scripts/bench_memory.py                      # 2 rows of 512 tokens, 64 sampled per row
    python scripts/bench_memory.py --rows 4 --tokens 1024 --sampled 128
    python scripts/bench_memory.py --layers 2           # a quick look: fewer layers, same vocabulary
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
import transformers  # noqa: E402

from agents import Agent  # noqa: E402
from run import memory_estimate  # noqa: E402
from sampling import token_logprobs  # noqa: E402

QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                  max_position_embeddings=32768, rope_theta=1e6)


def one(a):
    """One setting in this process: {"peak_gib", "step_s", "params"}."""
    torch.manual_seed(0)
    torch.set_num_threads(a.threads)
    cfg = dict(QWEN25_05B, **({"num_hidden_layers": a.layers} if a.layers else {}))
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    ids = torch.randint(0, cfg["vocab_size"], (a.rows, a.tokens))
    attn = torch.ones_like(ids)
    mask = torch.zeros_like(ids)
    mask[:, -a.sampled:] = 1  # the sampled turn at the end of each row
    for rows in (ids[:1, :8], ids):  # a first step on 8 tokens allocates AdamW's states, as in a run
        t0 = time.time()
        lp = token_logprobs(model, rows, attn[:len(rows), :rows.shape[1]],
                            mask[:len(rows), -rows.shape[1]:] if a.mode == "masked" else None)
        loss = -(lp * mask[:len(rows), -rows.shape[1]:]).sum() / mask.sum()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux
    static, batch, _, _ = memory_estimate(Agent(model, None), a.tokens, a.rows,
                                          sampled=a.sampled if a.mode == "masked" else None)
    return {"peak_gib": peak / 2 ** 30, "step_s": time.time() - t0, "estimate_gib": static + batch,
            "params": sum(p.numel() for p in model.parameters())}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--tokens", type=int, default=512, help="tokens per row")
    p.add_argument("--sampled", type=int, default=64, help="tokens per row with loss mask 1")
    p.add_argument("--layers", type=int, default=0, help="0: the model's own (24)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--mode", default="", help=argparse.SUPPRESS)  # one setting, in a child process
    a = p.parse_args()
    if not 0 < a.sampled <= a.tokens:
        p.error("--sampled must be in [1, --tokens]")
    if a.mode:
        return print(json.dumps(one(a)))
    print(f"Qwen2.5-0.5B's shape{f' with {a.layers} layers' if a.layers else ''}, fp32 weights + AdamW, "
          f"{a.rows} rows x {a.tokens} tokens, {a.sampled} sampled per row, {a.threads} threads")
    res = {}
    for mode in ("whole", "masked"):
        argv = [sys.executable, __file__, "--mode", mode] + [f"--{k}={getattr(a, k)}" for k in
                                                             ("rows", "tokens", "sampled", "layers", "threads")]
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode:  # -9: killed, on Linux most likely by the kernel's out-of-memory killer
            print(f"  {mode:6s}: the process ended with code {done.returncode} "
                  f"({'killed: out of memory?' if done.returncode == -9 else done.stderr[-500:]})")
            continue
        res[mode] = json.loads(done.stdout)
        print(f"  {mode:6s}: peak {res[mode]['peak_gib']:.2f} GiB (mgrpo's start-up estimate "
              f"{res[mode]['estimate_gib']:.2f}), step {res[mode]['step_s']:.1f}s "
              f"({res[mode]['params'] / 1e6:.0f}M params)", flush=True)
    if len(res) < 2:
        return
    saved = res["whole"]["peak_gib"] - res["masked"]["peak_gib"]
    print(f"  the head only where the loss reads it: {saved:.2f} GiB less at peak "
          f"({saved * 2 ** 30 / (a.rows * (a.tokens - a.sampled)) / 1e6:.2f} MB per unscored token)")


if __name__ == "__main__":
    main()
