"""GPU check: the two-process run on one GPU, full and LoRA, the samplers, and memory at a real shape.

Needs no download: every model is built in code.
1. Two 30M-parameter Qwen2 chat models (byte-level BPE, Qwen-style template, JSON tool calls) get a
   short cold start on the GPU and are saved as Hugging Face folders.
2. A few M-GRPO steps as two processes (--role main, --role sub) on the same GPU in bf16, talking
   through the file store: once training the whole models, once with LoRA adapters (--lora-rank).
   Per run: sampled tokens/s, training tokens/s and MFU, peak memory per process against the
   start-up estimate, and how far the bf16 sampling log-probs are from the training ones.
3. CUDA-graph decoding against eager decoding on the same contexts and seeds: the same tokens, and
   log-probs within bf16 tolerance.
4. mgrpo's own loop (eager and CUDA graphs) against HF `generate` in sampled tokens/s, on a model of
   Qwen2.5-0.5B's shape in bf16 (random weights: sampling speed depends on the shape only).
5. One training step at Qwen2.5-0.5B's shape, full against LoRA: peak memory and step time against
   the estimate (benchmarks/bench_memory.py on the GPU).
6. Optionally, the recorded rollout calls replayed by each sampler (benchmarks/bench_generate.py).
It prints as it goes and writes a Markdown report (--report) and the figures as JSON (<out>/gpu_check.json).

    python -m benchmarks.gpu_check                 # not yet timed; with one two-process run it took 3 minutes on an H200
    python -m benchmarks.gpu_check --models runs/gpu_check/models --role-args "--grad-checkpointing"
    python -m benchmarks.gpu_check --device cpu --size 0.1M --steps 2 --sft-steps 3 --questions 2 \\
        --shape tiny --report /tmp/report.md  # a dry run on a CPU
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import torch
import transformers

import mgrpo
import sampling
import toy_tools
from agents import load_agent, load_tokenizer, prompt_ids
from benchmarks import bench_generate, bench_memory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from cold_start import cold_start

TINY = dict(bench_memory.QWEN25_05B, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=2048)  # --shape tiny: dry runs


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_args(b, *more):
    """mgrpo options for the agents this check loads itself."""
    return mgrpo.parse_args(["--chat", "--device", b.device, "--dtype", b.dtype, "--max-new-tokens", "48"]
                            + list(more))


# ---------------------------------------------------------------------------------------
# 1-2. Build and cold-start the chat models; the two-process run
# ---------------------------------------------------------------------------------------
def build(b):
    """Two cold-started chat models saved under <out>/models (or those of --models)."""
    if b.models:
        print(f"models from {b.models}", flush=True)
        return b.models
    models, t0 = os.path.join(b.out, "models"), time.time()
    build_args = run_args(b, "--model-size", b.size, "--cold-start", json.dumps({"batch": 32, "lr": 1e-3}))
    for name, seed in (("main", 1), ("sub", 2)):
        agent = load_agent("", build_args, toy_tools, seed)
        loss = cold_start(agent, name, build_args, toy_tools, seed, b.sft_steps) if b.sft_steps else float("nan")
        agent.model.save_pretrained(os.path.join(models, name))
        agent.tok.save_pretrained(os.path.join(models, name))
        n = sum(x.numel() for x in agent.model.parameters())
        print(f"{name}: {n / 1e6:.1f}M params, cold start {b.sft_steps} steps, loss {loss:.3f}", flush=True)
        del agent
    print(f"built and cold-started in {time.time() - t0:.0f}s", flush=True)
    return models


def two_process(b, models, name, extra):
    """--role main and --role sub as two processes on one device, one store; returns the wall time."""
    out = os.path.join(b.out, name)
    common = ["--steps", str(b.steps), "--questions-per-step", str(b.questions), "--group-size", "8",
              "--cold-start", "none", "--device", b.device, "--dtype", b.dtype, "--max-new-tokens", "48",
              "--eval-questions", "16", "--eval-every", "0", "--store", os.path.join(out, "store"),
              "--lr", str(b.lr)] + extra
    shutil.rmtree(os.path.join(out, "store"), ignore_errors=True)  # an earlier check's records
    procs = {}
    for role in ("main", "sub"):
        cmd = [sys.executable, os.path.join(ROOT, "mgrpo.py"), "--role", role, "--overwrite",
               f"--{role}-model", os.path.join(models, role), "--out", os.path.join(out, role)] + common
        log = open(os.path.join(out + f"-{role}.log"), "w")
        procs[role] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                        env=dict(os.environ, PYTHONUNBUFFERED="1")), log)
    t0, failed = time.time(), False
    for role, (proc, log) in procs.items():
        failed |= proc.wait() != 0
        log.close()
    wall = time.time() - t0
    for role in procs:
        text = open(out + f"-{role}.log").read()
        print(f"--- {name}, {role} process log (last lines) ---\n" + "\n".join(text.splitlines()[-6:]), flush=True)
    if failed:
        sys.exit(f"a process of the {name} run failed; logs above")
    return wall


def figures(b, models, name, wall, peak_tflops):
    """The two-process run's figures, from its metrics, summaries and logs (the first step left out:
    it warms up kernels and caches)."""
    out = os.path.join(b.out, name)

    def rows(role):
        with open(os.path.join(out, role, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f if '"eval"' not in line][1:]
    rs = {role: rows(role) for role in ("main", "sub")}
    summary = {role: json.load(open(os.path.join(out, role, "summary.json"))) for role in rs}
    cfg = transformers.AutoConfig.from_pretrained(os.path.join(models, "main"))
    t_gen = sum(r["t_gen"] for r in rs["main"])
    tok_m = sum(r["gen_tokens"] for r in rs["main"])  # in the main role: M's own sampled tokens
    tok_s, t_gen_s = sum(r["gen_tokens_sub"] for r in rs["sub"]), sum(r["t_gen_sub"] for r in rs["sub"])
    res = {"wall_s": round(wall, 1), "rollout_tokens_per_s": (tok_m + tok_s) / t_gen,
           "sub_generation_tokens_per_s": tok_s / max(t_gen_s, 1e-9),
           "step_s": sum(r["t_step"] for r in rs["main"]) / max(len(rs["main"]), 1),
           "success": (summary["main"]["eval_success_start"], summary["main"]["eval_success_end"])}
    print(f"\n{name}: {b.steps} steps in {wall:.0f}s; generation {res['rollout_tokens_per_s']:.0f} sampled tokens/s "
          f"over the rollout (M and S, {tok_m} + {tok_s} tokens), S alone {res['sub_generation_tokens_per_s']:.0f}")
    for role in rs:
        t_train = sum(r.get(f"t_train_{role}", 0.0) for r in rs[role])
        tok_in = sum(r.get(f"tokens_in_{role}", 0.0) for r in rs[role])
        if not tok_in:
            print(f"{role}: no training tokens (no sub-agent calls?)")
            continue
        T = tok_in / sum(r[f"sequences_{role}"] for r in rs[role] if f"sequences_{role}" in r)  # mean length
        n = summary[role]["params"]
        achieved = (6 * n + 12 * cfg.num_hidden_layers * cfg.hidden_size * T) * tok_in / t_train / 1e12
        mean = {k: sum(r.get(f"{k}_{role}", 0.0) for r in rs[role]) / len(rs[role])
                for k in ("approx_kl", "clip_frac", "kl_ref")}
        est = next((line.strip() for line in open(out + f"-{role}.log") if "memory estimate," in line), "")
        res[role] = dict(mean, train_tokens_per_s=tok_in / t_train, achieved_tflops=achieved, params=n,
                         mfu=achieved / b.peak_tflops, peak_mem_gib=summary[role].get("peak_gpu_mem_gib"),
                         estimate=est)
        mem = res[role]["peak_mem_gib"]
        print(f"{role}: training {tok_in / t_train:.0f} tokens/s, {achieved:.1f} TFLOP/s = MFU "
              f"{100 * res[role]['mfu']:.1f}% of {b.peak_tflops:.0f} (measured matmul {peak_tflops:.0f}); peak "
              f"memory {mem if mem is None else f'{mem:.2f} GiB'}; sampling vs training log-probs: approx KL "
              f"{mean['approx_kl']:.1e}, clipped {100 * mean['clip_frac']:.2f}% of tokens\n  start-up {est}")
    return res


# ---------------------------------------------------------------------------------------
# 3-5. The samplers, and memory at a real model's shape
# ---------------------------------------------------------------------------------------
def contexts(agent, n):
    """n sub-agent first turns: its prompt with 'city of <person>' sub-tasks."""
    return [prompt_ids(agent, "sub", f"city of {toy_tools.PERSONS[i % len(toy_tools.PERSONS)]}") for i in range(n)]


def graphs_vs_eager(b, models):
    """The cold-started sub-agent decodes the same contexts with CUDA graphs and eagerly, greedy and
    sampled, same seeds: the share of rows with the same tokens, and the largest log-prob gap over
    the tokens both drew alike (bf16: kernels differ, so a near-tie may go the other way)."""
    agent = load_agent(os.path.join(models, "sub"), run_args(b), toy_tools)
    ctx, out = contexts(agent, 24), {}  # 24 rows: a graph's 32, with 8 padding rows
    for mode in ("eager", "graphs"):
        agent.graphs = {} if mode == "graphs" and b.device.startswith("cuda") else None
        out[mode] = [sampling.generate(agent, ctx, 48, seed=7, greedy=g) for g in (True, False)]
    res = {}
    for i, kind in enumerate(("greedy", "sampled")):
        same, gap = 0, 0.0
        for (t1, lp1, _), (t2, lp2, _) in zip(out["eager"][i], out["graphs"][i]):
            same += t1 == t2
            k = next((j for j, (x, y) in enumerate(zip(t1, t2)) if x != y), min(len(t1), len(t2)))
            gap = max([gap] + [abs(x - y) for x, y in zip(lp1[:k], lp2[:k])])
        res[kind] = {"same_rows": same / len(ctx), "max_logprob_gap": gap}
        print(f"CUDA graphs vs eager, {kind}: {same}/{len(ctx)} rows the same tokens; largest log-prob gap "
              f"{gap:.2e} over the tokens drawn alike" + ("" if b.device.startswith("cuda") else
                                                         " (a CPU has no graphs: eager against eager)"), flush=True)
    return res


def shape_model(b, models):
    """A folder with a model of --shape (Qwen2.5's config, random weights, saved in bf16) and the sub-agent's
    tokenizer, whose ids are all valid for it."""
    folder = os.path.join(b.out, f"shape-{b.shape}")
    if not os.path.exists(os.path.join(folder, "config.json")):
        tok = load_tokenizer(os.path.join(models, "sub"))
        cfg = TINY if b.shape == "tiny" else bench_memory.QWEN25[b.shape]
        torch.manual_seed(0)
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            **cfg, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id))
        model.to(torch.bfloat16).save_pretrained(folder)
        tok.save_pretrained(folder)
    return folder


def own_loop_vs_hf(b, models, rows=64, new=128, reps=3):
    """Sampled tokens/s of HF generate, mgrpo's eager loop and its CUDA-graph loop on the same contexts."""
    agent = load_agent(shape_model(b, models), run_args(b), toy_tools)
    ctx, res = contexts(agent, rows), {}
    samplers = {"hf": bench_generate.hf_generate, "eager": sampling.generate, "graphs": sampling.generate}
    for name, fn in samplers.items():
        if name == "graphs" and not b.device.startswith("cuda"):
            continue
        agent.graphs = {} if name == "graphs" else None
        fn(agent, ctx, new, seed=0)  # warm-up (and the graph's capture)
        sync(b.device)
        t0, tokens = time.perf_counter(), 0
        for r in range(reps):
            tokens += sum(len(row) for row, _, _ in fn(agent, ctx, new, seed=r + 1))
        sync(b.device)
        res[name] = tokens / (time.perf_counter() - t0)
    n = sum(p.numel() for p in agent.model.parameters())
    print(f"samplers at {b.shape} ({n / 1e6:.0f}M params, {b.dtype}), {rows} rows x {new} new tokens: " + ", ".join(
        f"{k} {v:.0f} tokens/s ({v / res['hf']:.2f}x hf)" for k, v in res.items()), flush=True)
    return dict(res, params=n, rows=rows, new_tokens=new)


def memory_at_shape(b):
    """benchmarks/bench_memory.py on this device: one training step, full (masked) and LoRA."""
    size = ["--layers", "1", "--vocab", "2048", "--rows", "1", "--tokens", "64", "--sampled", "8"] \
        if b.shape == "tiny" else ["--rows", "8", "--tokens", "1024", "--sampled", "256"]
    cmd = [sys.executable, "-m", "benchmarks.bench_memory", "--device", b.device, "--dtype", b.dtype,
           "--modes", "masked", "lora"] + size
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    print(r.stdout.rsplit("\n", 2)[0] if r.returncode == 0 else f"bench_memory failed:\n{r.stderr[-2000:]}", flush=True)
    return json.loads(r.stdout.strip().splitlines()[-1])["results"] if r.returncode == 0 else {}


# ---------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------
def report(b, res, path):
    """The figures as Markdown, with the command that made them."""
    gib = lambda x: "-" if x is None else f"{x:.2f} GiB"  # noqa: E731
    runs = [n for n in ("full", "lora") if n in res]
    lines = [f"# GPU check: {res['device']}", "",
             f"`python -m benchmarks.gpu_check {' '.join(sys.argv[1:])}` (benchmarks/gpu_check.py explains each part); "
             f"torch {torch.__version__}, transformers {transformers.__version__}, {time.strftime('%Y-%m-%d')}. "
             f"Chat models of {b.size}, {b.steps} steps of {b.questions} questions x 8 rollouts, {b.dtype}; "
             "the first step left out.", "",
             "## The two-process run (--role main, --role sub on one device)", "",
             "| | " + " | ".join(runs) + " |", "|---|" + "---|" * len(runs)]
    rows = [("wall time", lambda r: f"{r['wall_s']:.0f} s"), ("step", lambda r: f"{r['step_s']:.2f} s"),
            ("sampled tokens/s, M and S", lambda r: f"{r['rollout_tokens_per_s']:.0f}"),
            ("success before / after (16 questions)", lambda r: "%.3f / %.3f" % tuple(r["success"]))]
    for role in ("main", "sub"):
        rows += [(f"{role}: training tokens/s, MFU", lambda r, k=role: f"{r[k]['train_tokens_per_s']:.0f}, "
                  f"{100 * r[k]['mfu']:.1f}%" if k in r else "-"),
                 (f"{role}: peak memory", lambda r, k=role: gib(r.get(k, {}).get("peak_mem_gib"))),
                 (f"{role}: approx KL, sampling vs training", lambda r, k=role: f"{r[k]['approx_kl']:.1e}"
                  if k in r else "-")]
    lines += [f"| {name} | " + " | ".join(f(res[n]) for n in runs) + " |" for name, f in rows]
    lines += ["", "## CUDA graphs against eager decoding (sub-agent, 24 rows x 48 tokens, same seeds)", "",
              "| | rows with the same tokens | largest log-prob gap where the tokens agree |", "|---|---|---|"]
    lines += [f"| {k} | {v['same_rows']:.2f} | {v['max_logprob_gap']:.2e} |" for k, v in res["graphs"].items()]
    s = res["samplers"]
    lines += ["", f"## Sampling speed at {b.shape} ({s['params'] / 1e6:.0f}M params, random weights, {b.dtype}; "
              f"{s['rows']} rows x {s['new_tokens']} new tokens)", "", "| sampler | tokens/s | against HF generate |",
              "|---|---|---|"] + [f"| {k} | {s[k]:.0f} | {s[k] / s['hf']:.2f}x |"
                                  for k in ("hf", "eager", "graphs") if k in s]
    lines += ["", "## One training step at Qwen2.5-0.5B's shape (benchmarks/bench_memory.py)", "",
              "| | peak | start-up estimate | step | trained parameters |", "|---|---|---|---|---|"]
    lines += [f"| {k} | {gib(v['peak_gib'])} | {gib(v['estimate_gib'])} | {v['step_s']:.2f} s | "
              f"{v['trained'] / 1e6:.1f}M |" for k, v in res["memory"].items()]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"report: {path}", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--size", default="30M", help="--model-size of both agents")
    p.add_argument("--steps", type=int, default=6, help="M-GRPO steps of each two-process run")
    p.add_argument("--sft-steps", type=int, default=300, help="cold-start steps per agent")
    p.add_argument("--questions", type=int, default=8, help="questions per step (K = 8 rollouts each)")
    p.add_argument("--lr", type=float, default=3e-5, help="M-GRPO learning rate (at the tiny models' "
                   "3e-4 the 30M ones collapsed within 4 steps)")
    p.add_argument("--lora-rank", type=int, default=16, help="the LoRA run's rank (0: no LoRA run)")
    p.add_argument("--role-args", default="", help="more mgrpo.py options for both runs, e.g. '--grad-checkpointing'")
    p.add_argument("--models", default="", help="a folder with main/ and sub/ from an earlier check: skip the build")
    p.add_argument("--shape", default="0.5B", choices=list(bench_memory.QWEN25) + ["tiny"],
                   help="Qwen2.5's shape for the sampling speeds (tiny: a dry run's); memory is at 0.5B's")
    p.add_argument("--device", default="cuda", help="cuda, cuda:1, ...; cpu for a dry run")
    p.add_argument("--peak-tflops", type=float, default=989.0,
                   help="the GPU's dense bf16 peak for MFU (H100/H200 SXM datasheet: 989)")
    p.add_argument("--out", default="runs/gpu_check", help="models, logs, metrics and gpu_check.json go here")
    p.add_argument("--report", default="benchmarks/gpu-check-report.md", help="the Markdown report")
    p.add_argument("--samplers", action=argparse.BooleanOptionalAction, default=False,
                   help="last, replay two steps' rollout calls with each sampler (benchmarks/bench_generate.py)")
    b = p.parse_args()
    transformers.utils.logging.disable_progress_bar()
    cuda = b.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        sys.exit("no CUDA GPU here; run with --device cpu for a dry run")
    b.dtype = "bfloat16" if cuda else "float32"
    os.makedirs(b.out, exist_ok=True)
    res = {"device": torch.cuda.get_device_name() if cuda else "cpu", "size": b.size, "role_args": b.role_args}
    print(f"torch {torch.__version__}, {res['device']}", flush=True)
    models = build(b)
    peak = bench_generate.matmul_gflops(b.device, n=8192) / 1000 if cuda else float("nan")  # bf16
    res["matmul_tflops_measured"] = peak
    for name, extra in (("full", []), ("lora", ["--lora-rank", str(b.lora_rank), "--lr", str(10 * b.lr)])):
        if name == "full" or b.lora_rank:
            if cuda:
                torch.cuda.empty_cache()
            wall = two_process(b, models, name, extra + b.role_args.split())
            res[name] = figures(b, models, name, wall, peak)
    res["graphs"] = graphs_vs_eager(b, models)
    res["samplers"] = own_loop_vs_hf(b, models)
    res["memory"] = memory_at_shape(b)
    with open(os.path.join(b.out, "gpu_check.json"), "w") as f:
        json.dump(res, f, indent=1)
    report(b, res, b.report)
    if b.samplers:
        print("\nsamplers, replaying the generate calls of 2 M-GRPO steps with these models:", flush=True)
        r = subprocess.run([sys.executable, "-m", "benchmarks.bench_generate", "--models", models, "--chat",
                            "--device", b.device, "--steps", "2", "--repeat", "2", "--max-new-tokens", "48",
                            "--folder", os.path.join(b.out, "replay")] + (["--bf16"] if cuda else []),
                           capture_output=True, text=True, cwd=ROOT)
        print(r.stdout[-3000:] + (r.stderr[-3000:] if r.returncode else ""), flush=True)


if __name__ == "__main__":
    main()
