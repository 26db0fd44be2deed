"""GPU check: the two-process run on one GPU with chat models built in code (no download).

Builds a main agent and a sub-agent as 30M-parameter Qwen2 chat models (byte-level BPE,
Qwen-style template, JSON tool calls), gives each a short cold start on the GPU, saves
them as Hugging Face folders, then runs a few M-GRPO steps as two processes (--role main,
--role sub) on the same GPU in bf16, talking through the file store. Prints generation and
training tokens/s, peak memory per process against the start-up estimate, the training
step's model FLOPs utilisation (MFU), and how far bf16 sampling log-probs are from the
training ones (the ratio is 1 in exact arithmetic with one epoch). Last, the samplers side by side
(scripts/bench_generate.py): HF `generate`, mgrpo's eager loop and its CUDA-graph loop.

    python scripts/gpu_check.py                 # about 3 minutes on one H200
    python scripts/gpu_check.py --models runs/gpu_check/models --role-args "--grad-checkpointing --kl-coef 0.01"
    python scripts/gpu_check.py --device cpu --size 0.1M --steps 1 --sft-steps 5   # a dry run
"""
import argparse
import json
import os
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import transformers  # noqa: E402

import mgrpo  # noqa: E402
import toy_tools  # noqa: E402
from agents import load_agent  # noqa: E402
from cold_start import cold_start  # noqa: E402


def matmul_tflops(device, n=8192, reps=10):
    """Measured bf16 matmul rate: the practical ceiling next to the datasheet's."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    return 2 * n ** 3 * reps / (time.perf_counter() - t0) / 1e12


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--size", default="30M", help="--model-size of both agents")
    p.add_argument("--steps", type=int, default=6, help="M-GRPO steps of the two-process run")
    p.add_argument("--sft-steps", type=int, default=300, help="cold-start steps per agent")
    p.add_argument("--questions", type=int, default=8, help="questions per step (K = 8 rollouts each)")
    p.add_argument("--lr", type=float, default=3e-5, help="M-GRPO learning rate (at the tiny models' "
                   "3e-4 the 30M ones collapsed within 4 steps)")
    p.add_argument("--role-args", default="", help="more mgrpo.py options for both roles, e.g. '--grad-checkpointing'")
    p.add_argument("--models", default="", help="a folder with main/ and sub/ from an earlier check: skip the build")
    p.add_argument("--device", default="cuda", help="cuda, cuda:1, ...; cpu for a dry run")
    p.add_argument("--peak-tflops", type=float, default=989.0,
                   help="the GPU's dense bf16 peak for MFU (H100/H200 SXM datasheet: 989)")
    p.add_argument("--out", default="runs/gpu_check", help="models, logs, metrics and gpu_check.json go here")
    p.add_argument("--samplers", action=argparse.BooleanOptionalAction, default=True,
                   help="last, time the samplers side by side (scripts/bench_generate.py)")
    b = p.parse_args()
    os.makedirs(b.out, exist_ok=True)
    cuda = b.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        sys.exit("no CUDA GPU here; run with --device cpu for a dry run")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if cuda else 'cpu'}", flush=True)

    # 1. Build and cold-start the two chat models in this process, then free the GPU
    build = mgrpo.parse_args(["--chat", "--model-size", b.size, "--device", b.device, "--dtype",
                              "bfloat16" if cuda else "float32", "--sft-steps", str(b.sft_steps),
                              "--sft-batch", "32", "--sft-lr", "1e-3", "--max-new-tokens", "48"])
    t0 = time.time()
    models = b.models or os.path.join(b.out, "models")
    for name, seed, who in [] if b.models else (("main", 1, "main"), ("sub", 2, "sub")):
        agent = load_agent("", build, toy_tools, seed)
        loss = cold_start(agent, who, build, toy_tools, seed, b.sft_steps) if b.sft_steps else float("nan")
        agent.model.save_pretrained(os.path.join(models, name))
        agent.tok.save_pretrained(os.path.join(models, name))
        print(f"{name}: {sum(x.numel() for x in agent.model.parameters()) / 1e6:.1f}M params, cold start {b.sft_steps} steps, loss {loss:.3f}",
              flush=True)
        del agent
    print(f"built and cold-started in {time.time() - t0:.0f}s" if not b.models else f"models from {b.models}",
          flush=True)
    peak_measured = matmul_tflops(b.device) if cuda else float("nan")
    if cuda:
        torch.cuda.empty_cache()

    # 2. The two-process run: both roles on the same device, one store
    store = os.path.join(b.out, "store")
    common = ["--steps", str(b.steps), "--questions-per-step", str(b.questions), "--group-size", "8",
              "--sft-steps", "0", "--device", b.device, "--dtype", "bfloat16" if cuda else "float32",
              "--max-new-tokens", "48", "--eval-questions", "16", "--eval-every", "0", "--store", store,
              "--run-id", f"check{int(time.time())}", "--peer-timeout", "300", "--lr", str(b.lr)] + b.role_args.split()
    procs = {}
    for role in ("main", "sub"):
        cmd = [sys.executable, os.path.join(ROOT, "mgrpo.py"), "--role", role, "--overwrite",
               f"--{role}-model", os.path.join(models, role), "--out", os.path.join(b.out, role)] + common
        log = open(os.path.join(b.out, f"{role}.log"), "w")
        procs[role] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                        env=dict(os.environ, PYTHONUNBUFFERED="1")), log)
    t0 = time.time()
    failed = False
    for role, (proc, log) in procs.items():
        failed |= proc.wait() != 0
        log.close()
    wall = time.time() - t0
    for role in procs:
        text = open(os.path.join(b.out, f"{role}.log")).read()
        print(f"--- {role} process log (last lines) ---\n" + "\n".join(text.splitlines()[-8:]), flush=True)
    if failed:
        sys.exit("a process failed; logs above")

    # 3. The figures
    def rows(role):
        with open(os.path.join(b.out, role, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f if '"eval"' not in line]
    main_rows, sub_rows = rows("main")[1:], rows("sub")[1:]  # the first step warms up kernels and caches
    summary = {role: json.load(open(os.path.join(b.out, role, "summary.json"))) for role in procs}
    cfg = transformers.AutoConfig.from_pretrained(os.path.join(models, "main"))
    n_params = {role: summary[role]["params"] for role in procs}
    res = {"device": torch.cuda.get_device_name() if cuda else "cpu", "size": b.size, "params": n_params,
           "role_args": b.role_args, "steps": b.steps, "wall_s": round(wall, 1),
           "matmul_tflops_measured": peak_measured}
    print(f"\n{b.steps} steps of the two-process run in {wall:.0f}s (first step left out below)")
    t_gen = sum(r["t_gen"] for r in main_rows)
    tok_m = sum(r["gen_tokens"] for r in main_rows)  # in the main role: M's own sampled tokens
    tok_s, t_gen_s = sum(r["gen_tokens_sub"] for r in sub_rows), sum(r["t_gen_sub"] for r in sub_rows)
    res["rollout_tokens_per_s"] = (tok_m + tok_s) / t_gen
    res["sub_generation_tokens_per_s"] = tok_s / max(t_gen_s, 1e-9)
    print(f"generation: {res['rollout_tokens_per_s']:.0f} sampled tokens/s over the rollout (M and S, "
          f"{tok_m} + {tok_s} tokens); S alone {res['sub_generation_tokens_per_s']:.0f} tokens/s")
    for role, rs in (("main", main_rows), ("sub", sub_rows)):
        t_train = sum(r.get(f"t_train_{role}", 0.0) for r in rs)
        tok_in = sum(r.get(f"tokens_in_{role}", 0.0) for r in rs)
        if not tok_in:
            print(f"{role}: no training tokens (no sub-agent calls?)")
            continue
        T = tok_in / sum(r[f"sequences_{role}"] for r in rs if f"sequences_{role}" in r)  # mean length
        flops_per_tok = 6 * n_params[role] + 12 * cfg.num_hidden_layers * cfg.hidden_size * T
        achieved = flops_per_tok * tok_in / t_train / 1e12
        res[role] = {"train_tokens_per_s": tok_in / t_train, "achieved_tflops": achieved,
                     "mfu": achieved / b.peak_tflops, "peak_mem_gib": summary[role].get("peak_gpu_mem_gib"),
                     "approx_kl": sum(r.get(f"approx_kl_{role}", 0.0) for r in rs) / len(rs),
                     "clip_frac": sum(r.get(f"clip_frac_{role}", 0.0) for r in rs) / len(rs),
                     "kl_ref": sum(r.get(f"kl_ref_{role}", 0.0) for r in rs) / len(rs)}
        mem = res[role]["peak_mem_gib"]
        est = next((line for line in open(os.path.join(b.out, f"{role}.log")) if "memory estimate" in line), "")
        print(f"{role}: training {res[role]['train_tokens_per_s']:.0f} tokens/s, {achieved:.1f} TFLOP/s = "
              f"MFU {100 * res[role]['mfu']:.1f}% of {b.peak_tflops:.0f} (measured matmul {peak_measured:.0f}); "
              f"peak memory {mem if mem is None else f'{mem:.2f} GiB'}; "
              f"sampling vs training log-probs: approx KL {res[role]['approx_kl']:.1e}, "
              f"clipped {100 * res[role]['clip_frac']:.2f}% of tokens" +
              (f"; KL to the reference {res[role]['kl_ref']:.1e}" if res[role]["kl_ref"] else ""))
        print(f"  start-up {est.strip()}")
    print(f"success (sampled, 16 questions) before / after: {summary['main']['eval_success_start']:.3f} / "
          f"{summary['main']['eval_success_end']:.3f}")
    with open(os.path.join(b.out, "gpu_check.json"), "w") as f:
        json.dump(res, f, indent=1)

    # 4. The samplers side by side on the same recorded rollout calls: HF generate, mgrpo's
    # eager loop, and (on a GPU) its CUDA-graph loop
    if not b.samplers:
        return
    print("\nsamplers, replaying the generate calls of 2 M-GRPO steps with these models:", flush=True)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_generate.py"), "--models", models,
                        "--chat", "--device", b.device, "--steps", "2", "--repeat", "2", "--max-new-tokens", "48",
                        "--folder", os.path.join(b.out, "replay")] + (["--bf16"] if cuda else []),
                       capture_output=True, text=True, cwd=ROOT)
    print(r.stdout[-3000:] + (r.stderr[-3000:] if r.returncode else ""), flush=True)


if __name__ == "__main__":
    main()
