"""Peak memory of one training micro-batch at a real model's shape, measured against mgrpo's estimate.

A model with Qwen2.5-0.5B-Instruct's configuration is built in code with random weights (the shape is
what sets the memory), or a real one is loaded (--model, e.g. smollm2: SmolLM2-135M-Instruct). Each
setting runs in a process of its own: build the model and its AdamW, then one step (the policy's
log-probs, backward, AdamW), after a first step on 8 tokens that allocates AdamW's states, as any
step after a run's first has them. The peak memory of the process (on a CPU its resident memory,
ru_maxrss, with glibc's mmap threshold fixed so that freed tensors leave it; on a GPU torch's peak
allocation) is printed with the time of the step and the estimate
that mgrpo prints at start-up (run.memory_estimate). The settings (--modes):

- whole: full training, the head and log-softmax at every position (token_logprobs before it took a mask)
- masked: full training, the head only where the loss reads a log-prob (mask 1: the sampled tokens)
- lora: as masked, with the base frozen and LoRA adapters of --lora-rank on all linear layers
  (agents.add_adapter, as `mgrpo.py --lora-rank` sets them up)

    python -m benchmarks.bench_memory                      # 2 rows of 512 tokens, 64 sampled per row
    python -m benchmarks.bench_memory --rows 4 --tokens 1024 --sampled 128 --modes masked lora
    python -m benchmarks.bench_memory --device cuda --dtype bfloat16 --rows 8 --tokens 2048
    python -m benchmarks.bench_memory --table              # the estimate alone, for common sizes
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch
import transformers

import smollm2
from agents import Agent, add_adapter
from run import memory_estimate
from sampling import token_logprobs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                  max_position_embeddings=32768, rope_theta=1e6)
QWEN25 = {  # Qwen2.5-*-Instruct's shapes, from their published config.json files
    "0.5B": QWEN25_05B,
    "1.5B": dict(QWEN25_05B, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12),
    "3B": dict(QWEN25_05B, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
               num_attention_heads=16),
    "7B": dict(QWEN25_05B, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)}


def peak_gib(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2 ** 30  # kB on Linux


def one(a):
    """One setting in this process: {"peak_gib", "step_s", "estimate_gib", "params", "trained"}."""
    torch.manual_seed(0)
    torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    cfg = dict(QWEN25_05B, **({"num_hidden_layers": a.layers} if a.layers else {}),
               **({"vocab_size": a.vocab} if a.vocab else {}))
    if a.model:
        model = transformers.AutoModelForCausalLM.from_pretrained(smollm2.resolve(a.model), dtype=torch.float32).to(dev)
        cfg = model.config.to_dict()
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**cfg)).to(dev)
    agent = Agent(model, None, opt=torch.optim.AdamW(model.parameters(), lr=1e-6),
                  bf16=a.dtype == "bfloat16")
    if a.mode == "lora":
        add_adapter(agent, a.lora_rank, a.model or "Qwen2.5-0.5B's shape")
    ids = torch.randint(0, cfg["vocab_size"], (a.rows, a.tokens), device=dev)
    attn = torch.ones_like(ids)
    mask = torch.zeros_like(ids)
    mask[:, -a.sampled:] = 1  # the sampled turn at the end of each row
    for rows in (ids[:1, :8], ids):  # a first step on 8 tokens allocates AdamW's states, as in a run
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.time()
        m = mask[:len(rows), -rows.shape[1]:]
        with agent.autocast():
            lp = token_logprobs(agent.model, rows, attn[:len(rows), :rows.shape[1]],
                                None if a.mode == "whole" else m)
        (-(lp * m).sum() / mask.sum()).backward()
        agent.opt.step()
        agent.opt.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()
    static, batch, _, _ = memory_estimate(agent, a.tokens, a.rows,
                                          sampled=None if a.mode == "whole" else a.sampled)
    return {"peak_gib": peak_gib(dev), "step_s": time.time() - t0, "estimate_gib": static + batch,
            "params": sum(p.numel() for p in model.parameters()),
            "trained": sum(p.numel() for p in model.parameters() if p.requires_grad)}


def table(a):
    """The start-up estimate for Qwen2.5's sizes (built on the meta device: no memory, no download)."""
    gpus = (24, 48, 80, 140)
    print(f"estimate, not measured: bf16 (autocast over fp32 weights when trained in full; a bf16 frozen base "
          f"with LoRA rank {a.lora_rank}), gradient checkpointing, one micro-batch of {a.rows} x {a.tokens} "
          f"tokens, {a.sampled} sampled per row, per agent; fits: the smallest of {', '.join(map(str, gpus))} "
          "GiB that holds it at 90%\n")
    print("| model | full: one agent | LoRA: one agent | two agents, full | two agents, LoRA "
          "| two LoRA agents, one shared base |\n|---|---|---|---|---|---|")
    for name, cfg in QWEN25.items():
        with torch.device("meta"):
            agent = Agent(transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**cfg)), None, bf16=True)
        est = {r: memory_estimate(agent, a.tokens, a.rows, grad_checkpointing=True, sampled=a.sampled, lora=r)
               for r in (0, a.lora_rank)}
        full, lora = (sum(est[r][:2]) for r in (0, a.lora_rank))
        base = sum(p.numel() for p in agent.model.parameters()) * 2 / 2 ** 30
        cells = [full, lora, 2 * full, 2 * lora, 2 * lora - base]

        def fit(gib):
            return next((f"{g} GiB" for g in gpus if gib <= 0.9 * g), "none of them")
        print(f"| Qwen2.5-{name} | " + " | ".join(f"{c:.1f} GiB ({fit(c)})" for c in cells) + " |")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--tokens", type=int, default=512, help="tokens per row")
    p.add_argument("--sampled", type=int, default=64, help="tokens per row with loss mask 1")
    p.add_argument("--model", default="", help="a model to load (a Hugging Face name or path, or smollm2); "
                   "empty: Qwen2.5-0.5B's shape with random weights")
    p.add_argument("--layers", type=int, default=0, help="0: the model's own (24)")
    p.add_argument("--vocab", type=int, default=0, help="0: the model's own (151,936); smaller for a dry run")
    p.add_argument("--modes", nargs="+", default=["whole", "masked", "lora"], choices=["whole", "masked", "lora"])
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="as mgrpo.py's: bfloat16 is autocast over fp32 weights, and a bf16 frozen base with LoRA")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--table", action="store_true", help="print the estimate for Qwen2.5's sizes and stop")
    p.add_argument("--mode", default="", help=argparse.SUPPRESS)  # one setting, in a child process
    a = p.parse_args()
    if not 0 < a.sampled <= a.tokens or a.lora_rank < 1:
        p.error("--sampled must be in [1, --tokens] and --lora-rank >= 1")
    if a.table:
        return table(a)
    if a.mode:
        return print(json.dumps(one(a)))
    print(f"{a.model or 'Qwen2.5-0.5B' + chr(39) + 's shape'}{f' with {a.layers} layers' if a.layers else ''}, {a.dtype} on {a.device}, "
          f"AdamW, {a.rows} rows x {a.tokens} tokens, {a.sampled} sampled per row, {a.threads} threads", flush=True)
    res = {}
    for mode in a.modes:
        argv = [sys.executable, "-m", "benchmarks.bench_memory", "--mode", mode] + [f"--{k.replace('_', '-')}={getattr(a, k)}" for k in (
            "rows", "tokens", "sampled", "layers", "vocab", "threads", "lora_rank", "dtype", "device", "model")]
        # glibc keeps freed large blocks in its heap once its mmap threshold has grown, so that the
        # resident peak would count the allocator's slack; a fixed threshold returns them at once
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=os.environ.get("MALLOC_MMAP_THRESHOLD_", "65536"))
        done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT)
        if done.returncode:  # -9: killed, on Linux most likely by the kernel's out-of-memory killer
            print(f"  {mode:6s}: the process ended with code {done.returncode} "
                  f"({'killed: out of memory?' if done.returncode == -9 else done.stderr[-500:]})")
            continue
        r = res[mode] = json.loads(done.stdout)
        print(f"  {mode:6s}: peak {r['peak_gib']:.2f} GiB (mgrpo's start-up estimate {r['estimate_gib']:.2f}, "
              f"{100 * (r['estimate_gib'] / r['peak_gib'] - 1):+.0f}%), step {r['step_s']:.1f}s "
              f"({r['params'] / 1e6:.0f}M params, {r['trained'] / 1e6:.1f}M trained)", flush=True)
    if "whole" in res and "masked" in res:
        saved = res["whole"]["peak_gib"] - res["masked"]["peak_gib"]
        print(f"  the head only where the loss reads it: {saved:.2f} GiB less at peak "
              f"({saved * 2 ** 30 / (a.rows * (a.tokens - a.sampled)) / 1e6:.2f} MB per unscored token)")
    print(json.dumps({"results": res}))


if __name__ == "__main__":
    main()
