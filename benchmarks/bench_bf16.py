"""Benchmark (prints figures; not a test): what bf16 buys on this machine, and what it costs in log-probs.

1. Matmul rates, fp32 and bf16, at a decode step's shape and at training's. 1b: SmolLM2's head (49,152 x 576)
   on the last states of 8 rows of 9 tokens, given as HF's logits_to_keep=1 gives it (a strided [8, 1, 576]
   slice) and as sampling.forward_last does (2-D rows).
2. SmolLM2-135M (or --model), forward + backward of --rows x --tokens in fp32, in bf16 by autocast over the
   fp32 weights (what mgrpo trains with), and over bf16 weights; the ratios to fp32. 2b: the same at a length
   new at each pass, as training meets them, unpadded and padded to a multiple of 64 tokens.
3. A decode step with a KV cache of 200 tokens at 8, 16 and 64 rows, in the same three ways.
4. The sampler/trainer gap: --rollouts rows of the toy task's main-agent prompt, one turn of --new-tokens
   sampled by `sampling.generate` from the bf16 copy (what --dtype bfloat16 samples with) and from the fp32
   weights under autocast, each scored as training scores it (autocast over fp32 weights): the mean and
   largest |log p_train - log p_sample| per sampled token, and the share whose importance weight meets
   mgrpo.IS_CAP (truncated there).

On a CPU without AMX or AVX512-BF16 torch runs large bf16 matmuls by a generic kernel, very slowly: parts 2
and 3 then run fp32 only unless --force, and part 4 still runs (a few minutes).

    python -m benchmarks.bench_bf16                       # SmolLM2, converted once (smollm2.py)
    python -m benchmarks.bench_bf16 --model runs/smollm2-seed1/main --rollouts 16

Figures are wall-clock on whatever machine runs it; compare the rows of one run.
"""
import argparse
import copy
import statistics
import time

import torch
import transformers

import agents
import mgrpo
import toy_tools
import sampling
from agents import Traj, load_agent, prompt_ids
from sampling import collate, generate, token_logprobs

WAYS = ("fp32", "autocast", "bf16 weights")
PAD = 64  # part 2b's multiple


def median_seconds(fn, repeat):
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_rate(m, k, n, dtype, seconds=1.0):
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        reps += 1
    return 2 * m * k * n * reps / (time.perf_counter() - t0) / 1e9


def head_inputs():
    """Part 1b: the head on a strided [B, 1, H] slice against the same rows as a 2-D tensor."""
    weight = torch.randn(49152, 576)
    for dtype in (torch.float32, torch.bfloat16):
        w, h = weight.to(dtype), torch.randn(8, 9, 576, dtype=dtype)
        ms = [1e3 * median_seconds(lambda: torch.nn.functional.linear(x, w), 5) for x in (h[:, -1:], h[:, -1])]
        print(f"1b. the head, 8 rows, {str(dtype)[6:]}: a [8, 1, 576] slice {ms[0]:.1f} ms, "
              f"2-D rows {ms[1]:.1f} ms", flush=True)


def model_in(model, way, train=False):
    """The model as `way` runs it: (model, autocast on?); bf16 weights: the copy mgrpo samples with, or for
    training a bf16 copy that takes gradients (the sampler's holds none)."""
    if way == "bf16 weights":
        return (copy.deepcopy(model).to(torch.bfloat16) if train else
                sampling.sampler(agents.Agent(model, None, bf16=True))), False
    return model, way == "autocast"


def train_pass(model, ac, ids):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=ac):
        loss = model(input_ids=ids).logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None]).mean()
    loss.backward()
    model.zero_grad(set_to_none=True)


@torch.no_grad()
def decode_step(model, ac, rows, context=200):
    cache = {sampling.cache_keyword(type(model)): transformers.DynamicCache(config=model.config)}
    ids = torch.randint(0, model.config.vocab_size, (rows, context))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=ac):
        model(input_ids=ids, use_cache=True, logits_to_keep=1, **cache)
        return median_seconds(lambda: model(input_ids=ids[:, :1], use_cache=True, logits_to_keep=1, **cache), 5)


def speeds(model, b, ways):
    print(f"\n2-3. {b.model}: forward + backward of {b.rows} x {b.tokens} tokens; a decode step, 200-token KV cache")
    print(f"{'':>14} | {'fwd+bwd s':>9} {'vs fp32':>7} | " + " ".join(f"{r:>3} rows ms (tok/s)" for r in (8, 16, 64)))
    ids = torch.randint(0, model.config.vocab_size, (b.rows, b.tokens))
    base = None
    for way in ways:
        m, ac = model_in(model, way, train=True)
        t = median_seconds(lambda: train_pass(m, ac, ids), b.repeat)
        m, ac = model_in(model, way)
        base = base or t
        steps = [decode_step(m, ac, r) for r in (8, 16, 64)]
        print(f"{way:>14} | {t:9.2f} {base / t:6.2f}x | "
              + " ".join(f"{1e3 * s:8.0f} ({r / s:5.0f})  " for r, s in zip((8, 16, 64), steps)), flush=True)


def lengths(model, b, ways):
    """Part 2b: forward + backward of batches whose length is new at each pass, as training's are, against the
    same batches padded to a multiple of PAD tokens, whose shapes repeat (oneDNN builds a bf16 kernel per new
    shape: does it cost a pass much?)."""
    print(f"\n2b. forward + backward of {b.rows} rows, a new length each pass ({b.tokens + 1} and up), "
          f"unpadded and padded to a multiple of {PAD}: the median of {b.repeat} passes")
    for i, way in enumerate(ways):
        m, ac = model_in(model, way, train=True)
        row = []
        for step in (1, PAD):
            times = []
            for j in range(b.repeat + 1):  # the padded lengths' first shape is new once
                n = -(-(b.tokens + 1 + j + 10 * i + 5 * (step > 1)) // step) * step
                ids = torch.randint(0, model.config.vocab_size, (b.rows, n))
                t0 = time.perf_counter()
                train_pass(m, ac, ids)
                times.append(time.perf_counter() - t0)
            row.append(statistics.median(times[1:]))
        print(f"{way:>14} | unpadded {row[0]:6.2f} s, padded {row[1]:6.2f} s: {row[0] / row[1]:.2f}x", flush=True)


def gap(b, args):
    """Part 4: the sampler's log-probs against training's, for each way of sampling in bf16."""
    print(f"\n4. sampler/trainer log-prob gap, {b.rollouts} rollouts x {b.new_tokens} new tokens, the toy task's "
          "main-agent prompt; training: autocast over fp32 weights")
    print(f"{'sampler':>22} | {'mean |gap|':>10} {'max |gap|':>9} {'capped':>7} | tokens")
    agent = load_agent(b.model, args, toy_tools)
    qs = [toy_tools.make_question(s, 1) for s in range(b.rollouts)]
    contexts = [prompt_ids(agent, "main", q.text) for q in qs]
    own = sampling.sampler
    for name, sampler in (("bf16 copy (mgrpo's)", own), ("autocast, fp32 weights", lambda a: a.model)):
        sampling.sampler = sampler
        outs = generate(agent, contexts, b.new_tokens, seed=0)
        sampling.sampler = own
        trajs = [Traj(c + new, [0] * len(c) + [1] * len(new), [0.0] * len(c) + lp) for c, (new, lp, _) in zip(contexts, outs)]
        ids, attn, mask, sampled = collate(trajs, agent.pad_id, "cpu")
        with torch.no_grad(), agent.autocast():
            trained = token_logprobs(agent.model, ids, attn, mask)
        d = (trained - sampled)[mask.bool()]
        print(f"{name:>22} | {float(d.abs().mean()):10.4f} {float(d.abs().max()):9.4f} "
              f"{float((d >= torch.log(torch.tensor(mgrpo.IS_CAP))).float().mean()):7.3f} | {len(d)}", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2", help="a model by name or path (smollm2: SmolLM2-135M-Instruct)")
    p.add_argument("--rows", type=int, default=8, help="rows of the forward + backward pass")
    p.add_argument("--tokens", type=int, default=256, help="tokens per row of the forward + backward pass")
    p.add_argument("--repeat", type=int, default=3, help="timed repeats per figure (the median counts)")
    p.add_argument("--rollouts", type=int, default=8, help="rows sampled for the log-prob gap")
    p.add_argument("--new-tokens", type=int, default=40, help="tokens sampled per row for the log-prob gap")
    p.add_argument("--force", action="store_true", help="time bf16 even where the CPU has no fast bf16")
    b = p.parse_args()
    transformers.utils.logging.disable_progress_bar()
    fast = agents.bf16_hardware("cpu")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; bf16 hardware: {', '.join(fast) or 'none'}")
    print("1. matmul GFLOP/s:  " + "   ".join(
        f"{m}x{k}x{n} fp32 {matmul_rate(m, k, n, torch.float32):.0f}, bf16 {matmul_rate(m, k, n, torch.bfloat16):.0f}"
        for m, k, n in ((64, 576, 1536), (2048, 576, 1536))))
    head_inputs()
    args = mgrpo.parse_args(["--main-model", b.model, "--dtype", "bfloat16", "--max-new-tokens", str(b.new_tokens)])
    model = load_agent(b.model, args, toy_tools).model
    speeds(model, b, WAYS if fast or b.force else WAYS[:1])
    lengths(model, b, WAYS[:2] if fast or b.force else WAYS[:1])
    if not (fast or b.force):
        print("   (bf16 not timed: this CPU has no AMX or AVX512-BF16; --force times it)")
    gap(b, args)


if __name__ == "__main__":
    main()
