"""Benchmark (prints figures; not a test): mgrpo's sampling loop against HF `generate` and a raw
decode loop, replayed on the identical calls, in float32 and in bf16.

First a few M-GRPO steps run after a short cold start, and every `generate` call they make is
recorded (agent, contexts, new-token limit, seed, which conversation each row is, the step); the
weights are put back after each step, so that the saved models sampled every recorded call and a
conversation's kept KV in the replay is that of its recorded turns. Then
each sampler replays all the calls, in a process of its own (so that its peak memory is its own):

  raw         a raw batched decode loop: the HF model, transformers' DynamicCache, the call's contexts
              prefilled whole, one token per forward for every row until all have stopped (what one
              writes first; the rate the sampler is held against)
  hf          HF `generate`, fresh GenerationConfig (temperature 1, no top-k / top-p, pad and
              unk suppressed), sampling log-probs taken step by step by a logits processor
  mgrpo       `sampling.generate` as the agents' loop calls it: each conversation's KV kept from
              one turn to the next, new conversations started from their shared prompt's KV
              (computed once per step, as after each update), the cache written in place (Slab),
              finished rows leaving once they are half the batch
  mgrpo-whole the same with every context prefilled whole at every turn
  mgrpo-before `sampling.generate` as it was before its cache was written in place: DynamicCache (a
              copy of the whole cache at every token), finished rows leaving at once, bf16 by autocast
              over the fp32 weights at every step, draws by torch.multinomial
  graphs      `sampling.generate` with CUDA graphs over a static cache (CUDA only)

In bf16, raw and hf run the bf16 copy of the weights that mgrpo samples from (sampling.sampler). Besides
tokens/s, it counts the tokens each sampler prefills per M-GRPO step, against the floor (each distinct
token once; a prompt that a step's conversations share, once per step), and splits mgrpo's time into
prefill, decode steps, the draws, rows leaving and kept KV, and the rest (Python between them).

    python -m benchmarks.bench_generate                  # CPU, the default demo's models
    python -m benchmarks.bench_generate --device cuda --models runs/gpu_check/models --chat --dtypes bfloat16
    python -m benchmarks.bench_generate --models <run>/ --questions 2 --group-size 4 --max-new-tokens 40
        # the agents of a run (its main/ and sub/), e.g. SmolLM2 after its cold start

Figures are wall-clock on whatever machine runs it; compare the rows of one run.
"""
import argparse
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import transformers

import mgrpo
import toy_tools
import agents as agents_module
from agents import load_agent
from cold_start import cold_start
import sampling
from sampling import forward_last, sample_token
from tiny_models import SIZES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class StepLogprobs(transformers.LogitsProcessor):
    """HF generate's side: log p(sampled token) under the raw logits, one step at a time."""
    def __init__(self, suppress):
        self.suppress, self.prev, self.logp = list(suppress), None, []

    def __call__(self, input_ids, scores):
        if self.prev is not None:
            self.logp.append(self.prev.gather(-1, input_ids[:, -1:])[:, 0])
        self.prev = scores.float().log_softmax(-1)
        scores = scores.clone()
        scores[:, self.suppress] = -math.inf
        return scores


@torch.no_grad()
def hf_generate(agent, contexts, max_new_tokens, seed, greedy=False):
    L = max(map(len, contexts))
    ids = torch.tensor([[agent.pad_id] * (L - len(c)) + c for c in contexts], device=agent.model.device)
    attn = torch.tensor([[0] * (L - len(c)) + [1] * len(c) for c in contexts], device=agent.model.device)
    torch.manual_seed(seed)
    cfg = transformers.GenerationConfig(max_new_tokens=max_new_tokens, pad_token_id=agent.pad_id,
                                        eos_token_id=list(agent.stop_ids), do_sample=not greedy, top_k=0, top_p=1.0)
    rec = StepLogprobs(agent.suppress)
    with agent.autocast():
        new = sampling.sampler(agent).generate(input_ids=ids, attention_mask=attn, generation_config=cfg,
                                   logits_processor=transformers.LogitsProcessorList([rec]))[:, L:]
    torch.stack(rec.logp + [rec.prev.gather(-1, new[:, -1:])[:, 0]], 1).tolist()
    return [(row, None, None) for row in new.tolist()]  # tokens up to the first stop are the turn


@torch.no_grad()
def raw_generate(agent, contexts, max_new_tokens, seed, greedy=False):
    """A raw batched decode loop: contexts prefilled whole, one token per forward for every row until all stop."""
    model, dev = sampling.sampler(agent), agent.model.device
    B, L = len(contexts), max(map(len, contexts))
    ids = torch.tensor([[agent.pad_id] * (L - len(c)) + c for c in contexts], device=dev)
    attn = torch.tensor([[0] * (L - len(c)) + [1] * len(c) for c in contexts], device=dev)
    gen = torch.Generator(dev).manual_seed(seed)
    suppress = torch.tensor(agent.suppress, device=dev)
    stop = torch.tensor(agent.stop_ids, device=dev)
    cache, next_pos = transformers.DynamicCache(config=model.config), attn.sum(-1, keepdim=True)
    running, out = torch.ones(B, dtype=torch.bool, device=dev), []
    with agent.autocast():
        logits = forward_last(model, ids, attn, (attn.cumsum(-1) - 1).clamp(min=0), cache)
    for t in range(max_new_tokens):
        tok, lp = sample_token(logits, suppress, gen, greedy)
        out.append((tok, lp))
        running &= ~torch.isin(tok, stop)
        if t == max_new_tokens - 1 or not running.any():
            break
        attn = torch.cat([attn, attn.new_ones(B, 1)], 1)
        with agent.autocast():
            logits = forward_last(model, tok[:, None], attn, next_pos + t, cache)
    torch.stack([lp for _, lp in out], 1).tolist()
    return [(row, None, None) for row in torch.stack([t for t, _ in out], 1).tolist()]


def proc_status(key):
    """A kB figure of /proc/self/status (Linux), e.g. VmRSS, VmHWM (peak RSS)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def record(b, folder):
    """Cold-start two agents briefly, run b.steps M-GRPO steps, save the agents and every call."""
    cold = {"steps": b.sft_steps, **({"batch": 16} if b.chat else {})}
    argv = ["--model-size", b.model_size, "--cold-start", json.dumps(cold), "--device", b.device,
            "--max-new-tokens", str(b.max_new_tokens), "--questions-per-step", str(b.questions),
            "--group-size", str(b.group_size)] + (["--chat"] if b.chat else [])
    args = mgrpo.parse_args(argv)
    search = toy_tools.ToySearch()
    agents = {name: load_agent(os.path.join(b.models, name) if b.models else "", args, toy_tools, seed)
              for name, seed in (("main", 1), ("sub", 2))}
    for name, agent in agents.items():
        if not b.models:
            cold_start(agent, name, args, toy_tools, 0, b.sft_steps)
        agent.model.save_pretrained(os.path.join(folder, name))
        agent.tok.save_pretrained(os.path.join(folder, name))
    calls, real, convs, step = [], mgrpo.generate, {}, [0]

    def recording(agent, contexts, max_new_tokens, seed, greedy=False, kept=None):
        ids = [convs.setdefault(id(k), (len(convs), k))[0] for k in kept]  # which conversation each row is
        # (the Kept is held, so that its id is not reused by another conversation's)
        calls.append(["main" if agent is agents["main"] else "sub", [list(c) for c in contexts],  # copies: the
                      max_new_tokens, seed, greedy, ids, step[0]])  # loop appends to its contexts after the call
        out = real(agent, contexts, max_new_tokens, seed, greedy, kept)
        calls[-1].append([len(new) for new, _, _ in out])  # what each row sampled (for the floor)
        return out
    mgrpo.generate = recording
    delegate = functools.partial(mgrpo.run_sub_agents, agents["sub"], args, search)
    for step[0] in range(b.steps):  # the weights put back after each step: the saved models sampled every call
        saved = {n: {k: v.clone() for k, v in a.model.state_dict().items()} for n, a in agents.items()}
        mgrpo.train_step(agents["main"], agents["sub"], step[0], args, toy_tools, delegate, search)
        for n, a in agents.items():
            a.model.load_state_dict(saved[n])
    mgrpo.generate = real
    with open(os.path.join(folder, "calls.json"), "w") as f:
        json.dump(calls, f)
    return len(calls)


def counting(counts, seconds):
    """Wrap the sampler's parts so that they count the tokens they prefill and the seconds each part takes:
    prefill (the kept KV loaded, the shared prompt, the block), decode steps, draws, rows leaving and kept."""
    prefill, prompt_kv = sampling.EagerDecoder.prefill, sampling.kv_alone

    def counted(self, contexts, n_new):
        out = prefill(self, contexts, n_new)  # kept rows still count what they held before this turn
        kept = self.kept or [sampling.Kept() for _ in contexts]
        counts["prefill"] += sum(len(c) - k.n for c, k in zip(contexts, kept))
        return out

    def kv(agent, ids):
        counts["prompts"] += len(ids)
        return prompt_kv(agent, ids)
    sampling.EagerDecoder.prefill, sampling.kv_alone = counted, kv
    for part, owner, name in (("prefill", sampling.EagerDecoder, "prefill"), ("decode", sampling.EagerDecoder, "step"),
                              ("draws", sampling, "sample_token"), ("leave", sampling.EagerDecoder, "keep"),
                              ("leave", sampling.EagerDecoder, "finish")):
        setattr(owner, name, timed(getattr(owner, name), part, seconds))


def timed(fn, part, seconds):
    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            seconds[part] = seconds.get(part, 0.0) + time.perf_counter() - t0
    return wrapper


def as_before():
    """sampling.generate as it was before its KV cache was written in place: DynamicCache, finished rows
    leaving at once, bf16 by autocast over the fp32 weights, draws by torch.multinomial."""
    sampling.new_cache = lambda model, capacity: transformers.DynamicCache(config=model.config)
    sampling.LEAVE = 0.0
    sampling.sampler = lambda agent: agent.model
    sampling.sample_token = multinomial_token


def multinomial_token(logits, suppress, generator, greedy=False):
    """sampling.sample_token as it was: the draw by torch.multinomial."""
    logp = logits.float().log_softmax(-1)
    allowed = logp.index_fill(-1, suppress, -math.inf) if len(suppress) else logp
    tok = allowed.argmax(-1) if greedy else torch.multinomial(allowed.exp(), 1, generator=generator)[:, 0]
    return tok, logp.gather(-1, tok[:, None])[:, 0]


def replay(b, folder, method):
    """Time one sampler on every recorded call; print one JSON line of figures."""
    args = mgrpo.parse_args(["--device", b.device, "--dtype", b.dtype])
    agents = {n: load_agent(os.path.join(folder, n), args, toy_tools) for n in ("main", "sub")}
    for a in agents.values():
        a.graphs = a.graphs if method == "graphs" else None  # CUDA graphs on a GPU only for "graphs"
    with open(os.path.join(folder, "calls.json")) as f:
        calls = json.load(f)
    if method == "mgrpo-before":
        as_before()
    kept, counts, seconds = {}, {"prefill": 0, "prompts": 0}, {}
    counting(counts, seconds)

    def call(name, ctx, n, seed, greedy, convs, step, sampled):
        if method == "hf":
            return hf_generate(agents[name], ctx, n, seed, greedy)
        if method == "raw":
            return raw_generate(agents[name], ctx, n, seed, greedy)
        if method in ("mgrpo-whole", "graphs"):
            return sampling.generate(agents[name], ctx, n, seed, greedy)
        if kept.get("step") != step:  # a new step: new weights in training, so the prompts' KV anew
            kept.clear()
            kept["step"] = step
            for a in agents.values():
                a.prefixes.clear()
        return sampling.generate(agents[name], ctx, n, seed, greedy, [kept.setdefault(c, sampling.Kept())
                                                                      for c in convs])
    sync = torch.cuda.synchronize if b.device.startswith("cuda") else (lambda: None)
    for c in calls[:4]:  # warm-up (and graph captures)
        call(*c)
    sync()
    if b.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    rss0 = proc_status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # Linux: resets the peak (VmHWM) to the current RSS
        f.write("5")
    lat, tokens, flop = [], 0, 0.0
    params = {n: sum(p.numel() for p in a.model.parameters()) for n, a in agents.items()}
    counts.update(prefill=0, prompts=0)
    seconds.clear()
    for _ in range(b.repeat):
        kept.clear()
        for c in calls:
            t0 = time.perf_counter()
            outs = call(*c)
            sync()
            lat.append(time.perf_counter() - t0)
            stop = set(agents[c[0]].stop_ids)
            new = sum(next((i + 1 for i, t in enumerate(row) if t in stop), len(row)) for row, _, _ in outs)
            tokens, flop = tokens + new, flop + 2 * params[c[0]] * new  # a token's matmuls: 2 x params
    peak = (torch.cuda.max_memory_allocated() / 2 ** 20 if b.device.startswith("cuda")
            else (proc_status("VmHWM") - rss0) / 1024)
    steps = b.repeat * len({c[6] for c in calls})
    print(json.dumps({"method": method, "calls": len(lat), "tokens": tokens, "flop": flop, "seconds": sum(lat),
                      "median_ms": 1000 * statistics.median(lat), "p90_ms": 1000 * sorted(lat)[int(0.9 * len(lat))],
                      "peak_mib": peak, "parts": seconds if method.startswith("mgrpo") else None,
                      "prefill_per_step": (counts["prefill"] + counts["prompts"]) / steps
                      if method.startswith("mgrpo") else None}))


def matmul_gflops(device, dtype, n=1024, seconds=1.0):
    """The machine's measured matmul rate in `dtype`: what a sampler's rate is held against."""
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    a @ b
    sync()
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        reps += 1
    sync()
    return 2 * n ** 3 * reps / (time.perf_counter() - t0) / 1e9


def floor_per_step(calls):
    """Tokens a step must prefill at the least: every token of a context that no turn sampled, and the
    last token of each turn before (sampled, but not yet through the model), each once; a prompt that
    its step's conversations of one agent share, once per step (the weights change every step)."""
    last, first, prompts, total = {}, {}, {}, 0
    for name, ctx, _, _, _, convs, step, sampled in calls:
        for c, x, g in zip(convs, ctx, sampled):
            total += len(x) - last.get(c, (0, 1))[0] - (last.get(c, (0, 1))[1] - 1)  # new since its last turn
            last[c] = (len(x), g)
            first.setdefault(c, (name, step, x))
    for c, (name, step, x) in first.items():
        prompts.setdefault((name, step), []).append(x)
    shared = 0
    for group in prompts.values():
        ids = torch.tensor([g[:min(map(len, group)) - 1] for g in group])
        common = sampling.common_prefix(ids, torch.ones_like(ids))
        shared += common * (len(group) - 1) if common >= sampling.MIN_PREFIX else 0
    return (total - shared) / len({c[6] for c in calls})


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model-size", default="0.2M", choices=list(SIZES))
    p.add_argument("--chat", action="store_true", help="chat models (Qwen2, byte-level BPE), long contexts")
    p.add_argument("--steps", type=int, default=3, help="M-GRPO steps whose generate calls are recorded")
    p.add_argument("--questions", type=int, default=8, help="questions per recorded step")
    p.add_argument("--group-size", type=int, default=8, help="rollouts per question (K) in the recorded steps")
    p.add_argument("--sft-steps", type=int, default=300, help="cold-start steps before recording")
    p.add_argument("--models", default="", help="a folder with main/ and sub/ to record with (no cold start)")
    p.add_argument("--max-new-tokens", type=int, default=0, help="per turn; 0: mgrpo.py's default")
    p.add_argument("--repeat", type=int, default=3, help="replays of the recorded calls per sampler and round")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each sampler once per round; the median round counts")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtypes", nargs="+", default=None, help="float32 and/or bfloat16; default: float32, and "
                   "bfloat16 where the device multiplies it fast (agents.bf16_hardware)")
    p.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)  # internal: the replay's
    p.add_argument("--methods", nargs="+", default=None,
                   help="default: raw hf mgrpo mgrpo-whole mgrpo-before (+ graphs on CUDA)")
    p.add_argument("--folder", default="", help="reuse the recording in this folder")
    p.add_argument("--replay", default="", help=argparse.SUPPRESS)  # internal: one sampler, in a child process
    b = p.parse_args()
    transformers.utils.logging.disable_progress_bar()
    if b.replay:
        return replay(b, b.folder, b.replay)
    folder = b.folder or tempfile.mkdtemp(prefix="bench-generate-")
    if not os.path.exists(os.path.join(folder, "calls.json")):
        print(f"recording {b.steps} M-GRPO steps' generate calls ("
              + (f"models from {b.models}" if b.models else f"after {b.sft_steps} cold-start steps") + ") ...",
              flush=True)
        print(f"  {record(b, folder)} calls recorded in {folder}", flush=True)
    methods = b.methods or ["raw", "hf", "mgrpo", "mgrpo-whole", "mgrpo-before"] + (
        ["graphs"] if b.device.startswith("cuda") else [])
    fast = agents_module.bf16_hardware(b.device)
    dtypes = b.dtypes or ["float32"] + (["bfloat16"] if fast else [])
    if not b.dtypes and not fast:
        print("bfloat16: not replayed, this device has no fast bf16 (AMX, AVX512-BF16 or a GPU's); --dtypes "
              "bfloat16 runs it anyway", flush=True)
    runs = {(d, m): [] for d in dtypes for m in methods}
    for _ in range(b.rounds):  # the samplers take turns, so that a busy moment of the machine hits them alike
        for d, m in runs:
            cmd = [sys.executable, "-m", "benchmarks.bench_generate", "--replay", m, "--dtype", d, "--folder", folder,
                   "--device", b.device, "--repeat", str(b.repeat)]
            r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            if r.returncode != 0:
                print(f"{m} {d}: failed\n{r.stderr[-2000:]}")
                continue
            runs[d, m].append(json.loads(r.stdout.strip().splitlines()[-1]))
    # per sampler, the round with the median tokens/s
    rows = {k: sorted(rs, key=lambda r: r["tokens"] / r["seconds"])[len(rs) // 2] for k, rs in runs.items() if rs}
    print(f"\n{torch.__version__}, transformers {transformers.__version__}, {b.device} "
          f"({', '.join(fast) or 'no fast bf16'}), {torch.get_num_threads()} threads; models of "
          f"{b.models or (folder if b.folder else b.model_size)}"
          f"{' chat' if b.chat else ''}; every recorded call x {b.repeat}, median of {b.rounds} rounds")
    print("peak MiB: on a GPU the peak allocated; on a CPU how far the peak RSS rose above the RSS before the replay")
    print("GFLOP/s: 2 x params per sampled token (prefill and attention left out, so a floor), against this "
          "machine's measured matmul rate in the same dtype")
    with open(os.path.join(folder, "calls.json")) as f:
        floor = floor_per_step(json.load(f))
    for d in dtypes:
        print_table(d, {m: r for (dd, m), r in rows.items() if dd == d}, matmul_gflops(b.device, getattr(torch, d)),
                    floor)


def print_table(dtype, rows, peak, floor):
    """One dtype's figures: each sampler's rate against the raw loop, HF generate and the sampler before, and
    where mgrpo's time went."""
    print(f"\n{dtype} (matmul {peak:.0f} GFLOP/s)")
    print(f"{'sampler':>12} | {'tokens/s':>8} {'of raw':>6} {'vs hf':>6} {'vs before':>9} | {'GFLOP/s':>7} "
          f"{'of mm':>5} | {'median ms':>9} {'p90 ms':>7} | {'peak MiB':>8} | {'prefilled tokens per step':>25}")
    speed = {m: r["tokens"] / r["seconds"] for m, r in rows.items()}
    for m, r in rows.items():
        ratios = [f"{speed[m] / speed[base]:{w - 1}.2f}x" if base in speed else " " * (w - 1) + "-"
                  for base, w in (("raw", 6), ("hf", 6), ("mgrpo-before", 9))]
        prefill = f"{r['prefill_per_step']:25.0f}" if r["prefill_per_step"] is not None else f"{'':>25}"
        rate = r["flop"] / r["seconds"] / 1e9
        print(f"{m:>12} | {speed[m]:8.0f} {' '.join(ratios)} | {rate:7.1f} {100 * rate / peak:4.0f}% | "
              f"{r['median_ms']:9.2f} {r['p90_ms']:7.2f} | {r['peak_mib']:8.1f} | {prefill}")
    print(f"{'floor':>12} | each distinct token once: {floor:.0f} prefilled tokens per step")
    print(f"{'where it went':>12} | " + " ".join(f"{p:>8}" for p in PARTS) + "  (seconds of the replay)")
    for m, r in rows.items():
        if r["parts"] is not None:
            parts = dict(r["parts"], rest=r["seconds"] - sum(r["parts"].values()))
            print(f"{m:>12} | " + " ".join(f"{parts.get(p, 0.0):8.2f}" for p in PARTS))


PARTS = ("prefill", "decode", "draws", "leave", "rest")


if __name__ == "__main__":
    main()
