"""Benchmark (prints figures; not a test): mgrpo's sampling loop against HF `generate`, replayed
on the identical calls.

First a few M-GRPO steps run after a short cold start, and every `generate` call they make is
recorded (agent, contexts, new-token limit, seed). Then each sampler replays all the calls, in a
process of its own (so that its peak memory is its own):

  hf          HF `generate`, fresh GenerationConfig (temperature 1, no top-k / top-p, pad and
              unk suppressed), sampling log-probs taken step by step by a logits processor
              (what mgrpo used before it had its own loop)
  mgrpo       `mgrpo.generate`: KV-cache loop, finished rows leave the batch
  mgrpo-keep  the same loop with finished rows kept in the batch (masked), to measure what
              leaving buys
  graphs      `mgrpo.generate` with CUDA graphs over a static cache (CUDA only)

    python scripts/bench_generate.py                  # CPU, the default demo's models
    python scripts/bench_generate.py --device cuda --models runs/gpu_check/models --chat --bf16

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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
import transformers  # noqa: E402

import mgrpo  # noqa: E402
import toy_tools  # noqa: E402
from agents import SIZES, load_agent  # noqa: E402
from cold_start import cold_start  # noqa: E402
from sampling import forward_last, sample_token  # noqa: E402


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
        new = agent.model.generate(input_ids=ids, attention_mask=attn, generation_config=cfg,
                                   logits_processor=transformers.LogitsProcessorList([rec]))[:, L:]
    torch.stack(rec.logp + [rec.prev.gather(-1, new[:, -1:])[:, 0]], 1).tolist()
    return [(row, None, None) for row in new.tolist()]  # tokens up to the first stop are the turn


@torch.no_grad()
def keep_rows_generate(agent, contexts, max_new_tokens, seed, greedy=False):
    """mgrpo.generate's eager loop, except that finished rows stay in the batch."""
    model, dev = agent.model, agent.model.device
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
    argv = ["--model-size", b.model_size, "--sft-steps", str(b.sft_steps), "--device", b.device,
            "--max-new-tokens", str(b.max_new_tokens)] + (["--chat", "--sft-batch", "16"] if b.chat else [])
    args = mgrpo.parse_args(argv)
    search = toy_tools.ToySearch()
    agents = {name: load_agent(os.path.join(b.models, name) if b.models else "", args, toy_tools, seed)
              for name, seed in (("main", 1), ("sub", 2))}
    for name, agent in agents.items():
        if not b.models:
            cold_start(agent, name, args, toy_tools, 0, b.sft_steps)
        agent.model.save_pretrained(os.path.join(folder, name))
        agent.tok.save_pretrained(os.path.join(folder, name))
    calls, real = [], mgrpo.generate

    def recording(agent, contexts, max_new_tokens, seed, greedy=False):
        calls.append(("main" if agent is agents["main"] else "sub", contexts, max_new_tokens, seed, greedy))
        return real(agent, contexts, max_new_tokens, seed, greedy)
    mgrpo.generate = recording
    delegate = functools.partial(mgrpo.run_sub_agents, agents["sub"], args, search)
    for step in range(b.steps):
        mgrpo.train_step(agents["main"], agents["sub"], step, args, toy_tools, delegate, search)
    mgrpo.generate = real
    with open(os.path.join(folder, "calls.json"), "w") as f:
        json.dump(calls, f)
    return len(calls)


def replay(b, folder, method):
    """Time one sampler on every recorded call; print one JSON line of figures."""
    args = mgrpo.parse_args(["--device", b.device] + (["--dtype", "bfloat16"] if b.bf16 else [])
                            + ([] if method == "graphs" else ["--no-cuda-graphs"]))
    agents = {n: load_agent(os.path.join(folder, n), args, toy_tools) for n in ("main", "sub")}
    with open(os.path.join(folder, "calls.json")) as f:
        calls = json.load(f)
    fn = {"hf": hf_generate, "mgrpo": mgrpo.generate, "mgrpo-keep": keep_rows_generate,
          "graphs": mgrpo.generate}[method]
    sync = torch.cuda.synchronize if b.device.startswith("cuda") else (lambda: None)
    for name, ctx, n, seed, greedy in calls[:4]:  # warm-up (and graph captures)
        fn(agents[name], ctx, n, seed, greedy)
    sync()
    if b.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    rss0 = proc_status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # Linux: resets the peak (VmHWM) to the current RSS
        f.write("5")
    lat, tokens = [], 0
    for _ in range(b.repeat):
        for name, ctx, n, seed, greedy in calls:
            t0 = time.perf_counter()
            outs = fn(agents[name], ctx, n, seed, greedy)
            sync()
            lat.append(time.perf_counter() - t0)
            stop = set(agents[name].stop_ids)
            tokens += sum(next((i + 1 for i, t in enumerate(row) if t in stop), len(row)) for row, _, _ in outs)
    peak = (torch.cuda.max_memory_allocated() / 2 ** 20 if b.device.startswith("cuda")
            else (proc_status("VmHWM") - rss0) / 1024)
    print(json.dumps({"method": method, "calls": len(lat), "tokens": tokens, "seconds": sum(lat),
                      "median_ms": 1000 * statistics.median(lat), "p90_ms": 1000 * sorted(lat)[int(0.9 * len(lat))],
                      "peak_mib": peak}))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model-size", default="0.2M", choices=list(SIZES))
    p.add_argument("--chat", action="store_true", help="chat models (Qwen2, byte-level BPE), long contexts")
    p.add_argument("--steps", type=int, default=3, help="M-GRPO steps whose generate calls are recorded")
    p.add_argument("--sft-steps", type=int, default=300, help="cold-start steps before recording")
    p.add_argument("--models", default="", help="a folder with main/ and sub/ to record with (no cold start)")
    p.add_argument("--max-new-tokens", type=int, default=0, help="per turn; 0: mgrpo.py's default")
    p.add_argument("--repeat", type=int, default=3, help="replays of the recorded calls per sampler and round")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each sampler once per round; the median round counts")
    p.add_argument("--device", default="cpu")
    p.add_argument("--bf16", action="store_true", help="replay under bf16 autocast")
    p.add_argument("--methods", nargs="+", default=None, help="default: hf mgrpo mgrpo-keep (+ graphs on CUDA)")
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
    methods = b.methods or ["hf", "mgrpo", "mgrpo-keep"] + (["graphs"] if b.device.startswith("cuda") else [])
    runs = {m: [] for m in methods}
    for _ in range(b.rounds):  # the samplers take turns, so that a busy moment of the machine hits them alike
        for m in methods:
            cmd = [sys.executable, os.path.abspath(__file__), "--replay", m, "--folder", folder] + sys.argv[1:]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                print(f"{m}: failed\n{r.stderr[-2000:]}")
                continue
            runs[m].append(json.loads(r.stdout.strip().splitlines()[-1]))
    # per sampler, the round with the median tokens/s
    rows = {m: sorted(rs, key=lambda r: r["tokens"] / r["seconds"])[len(rs) // 2] for m, rs in runs.items() if rs}
    print(f"\n{torch.__version__}, transformers {transformers.__version__}, {b.device}, {torch.get_num_threads()} "
          f"threads; {b.models or b.model_size}{' chat' if b.chat else ''}; every recorded call x {b.repeat}, median of "
          f"{b.rounds} rounds")
    print("peak MiB: on a GPU the peak allocated; on a CPU how far the peak RSS rose above the RSS before the replay")
    print(f"{'sampler':>10} | {'tokens/s':>9} {'vs hf':>6} | {'median ms':>9} {'p90 ms':>7} | {'peak MiB':>8}")
    for m, r in rows.items():
        tps = r["tokens"] / r["seconds"]
        ratio = f"{tps / (rows['hf']['tokens'] / rows['hf']['seconds']):5.2f}x" if "hf" in rows else "     -"
        print(f"{m:>10} | {tps:9.0f} {ratio} | {r['median_ms']:9.2f} {r['p90_ms']:7.2f} | {r['peak_mib']:8.1f}")


if __name__ == "__main__":
    main()
