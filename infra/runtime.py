"""Infrastructure that mgrpo.py's run needs and its algorithm does not: checkpoints, CUDA-graph
decoding, the memory estimate, progress lines, a run's curves.png, and workers that end with
their run. Nothing here imports mgrpo.py; what it needs of it comes in as arguments.
"""
import dataclasses
import os
import random
import re
import secrets
import shutil
import sys
import threading
import time

import torch
import transformers


def exit_with_parent(parent):
    """In a worker process: exit as soon as `parent`, the pid of the process that started it, is
    gone (killed, say), instead of training on for nothing on the cores of whatever runs next.
    The parent passes its pid: a worker that asked for it late would get the pid of its new parent."""
    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        print(f"the process that started this one ({parent}) is gone: exiting", file=sys.stderr, flush=True)
        os._exit(1)
    threading.Thread(target=watch, daemon=True).start()


def checkpoints(out):
    """The checkpoint folders in <out>, oldest first."""
    names = sorted(os.listdir(out)) if os.path.isdir(out) else []
    return [os.path.join(out, n) for n in names if re.fullmatch(r"ckpt-\d{8}", n)]


def save_checkpoint(out, agents, index, n_metrics, sft_rounds=None):
    """<out>/ckpt-<index>: weights, tokenizers, optimizer and RNG states, the unsync batch and the place
    in the schedule, in a state.pt that loads with weights_only=True. Written to a temporary folder and
    renamed, so that a kill at any moment leaves the earlier ones whole; the last two are kept.
    sft_rounds: saved within the cold start, after that many rounds (None: the cold start is over)."""
    tmp = os.path.join(out, f"ckpt-tmp-{os.getpid()}-{secrets.token_hex(4)}")
    for name, a in agents.items():
        a.model.save_pretrained(os.path.join(tmp, name))
        a.tok.save_pretrained(os.path.join(tmp, name))
    torch.save({"index": index, "metrics_lines": n_metrics, "sft_rounds": sft_rounds,
                "opt": {n: a.opt.state_dict() for n, a in agents.items()},
                "pending": {n: ([dataclasses.asdict(t) for t in a.pending[0]], a.pending[1].tolist())
                            for n, a in agents.items() if a.pending},
                "rng": {"python": random.getstate(), "torch": torch.get_rng_state(),
                        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}},
               os.path.join(tmp, "state.pt"))
    final = os.path.join(out, f"ckpt-{index:08d}")
    if os.path.exists(final):  # a cold-start round's, or one from before a crash and --resume: set aside, not
        os.replace(final, tmp + "-old")  # deleted, so that only the instant between two renames has none
    os.replace(tmp, final)
    for path in checkpoints(out)[:-2] + [os.path.join(out, n) for n in os.listdir(out) if n.startswith("ckpt-tmp-")]:
        shutil.rmtree(path, ignore_errors=True)  # older ones, and what saves killed midway left


def load_checkpoint(out, names, load_agent, traj_class):
    """(agents, schedule position, metrics lines, cold-start rounds done or None when it is over) from the
    newest readable checkpoint in <out>, or None.
    load_agent(path) builds an agent from a saved folder; traj_class rebuilds the pending unsync batch."""
    for path in reversed(checkpoints(out)):
        try:
            state, agents = torch.load(os.path.join(path, "state.pt"), weights_only=True), {}  # never unpickles code
            for name in names:
                a = agents[name] = load_agent(os.path.join(path, name))
                a.opt.load_state_dict(state["opt"][name])
                if name in state["pending"]:
                    trajs, adv = state["pending"][name]
                    a.pending = ([traj_class(**t) for t in trajs], torch.tensor(adv))
            random.setstate((state["rng"]["python"][0], tuple(state["rng"]["python"][1]), state["rng"]["python"][2]))
            torch.set_rng_state(state["rng"]["torch"])
            if state["rng"]["cuda"] and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(state["rng"]["cuda"])
            rounds = state.get("sft_rounds")
            return agents, int(state["index"]), int(state["metrics_lines"]), None if rounds is None else int(rounds)
        except Exception as e:  # noqa: BLE001  (a broken checkpoint of any kind: try the one before)
            print(f"checkpoint {path} cannot be loaded ({type(e).__name__}: {e}); trying the one before", flush=True)
    return None


class GraphDecoder:
    """--cuda-graphs: decode steps over a static KV cache, replayed as a CUDA graph (a small model's
    step is many tiny kernels; a graph launches them at once). Fixed shapes: `rows` (batches padded to
    a power of two) and `length` cache slots. The first replay is checked against the eager step before
    it; on a mismatch `generate` falls back to the eager loop. Without CUDA (the tests) steps run eagerly."""

    def __init__(self, agent, rows, length, forward_last):
        self.agent, self.forward_last, dev = agent, forward_last, agent.model.device
        self.cache = transformers.StaticCache(config=agent.model.config, max_cache_len=length)
        self.x, self.pos = (torch.zeros(rows, 1, dtype=torch.long, device=dev) for _ in range(2))
        self.attn, self.graph = torch.zeros(rows, length, dtype=torch.long, device=dev), None

    def forward(self, ids, attn, pos, cache_enabled=True):  # a capture needs autocast's cache off
        with self.agent.autocast(cache_enabled):
            return self.forward_last(self.agent.model, ids, attn, pos, self.cache)

    def prefill(self, ids, attn, pos):
        self.cache.reset()
        self.attn.zero_()
        self.attn[:, :ids.shape[1]] = attn
        logits = self.forward(ids, self.attn, pos)
        if any(type(layer) is not transformers.cache_utils.StaticLayer for layer in self.cache.layers):
            raise RuntimeError("the model's cache layers are not plain static layers (sliding windows?)")
        return logits

    def step(self, tok, pos, slot):
        """One token per row, written to cache slot `slot`, at rope position `pos`."""
        self.x.copy_(tok[:, None]), self.pos.copy_(pos), self.attn[:, slot].fill_(1)
        if self.x.device.type != "cuda":
            return self.forward(self.x, self.attn, self.pos)
        if self.graph is None:  # warm up on a side stream, capture, then replay this very step
            counts, stream = [layer.cumulative_length.clone() for layer in self.cache.layers], torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                want = self.forward(self.x, self.attn, self.pos).clone()
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.logits = self.forward(self.x, self.attn, self.pos, cache_enabled=False)
            for layer, n in zip(self.cache.layers, counts):  # the warm-up wrote this slot: write it again
                layer.cumulative_length.copy_(n)
            self.graph.replay()
            if not torch.allclose(self.logits.float(), want.float(), rtol=1e-3, atol=1e-3):
                raise RuntimeError("the graph's logits differ from the eager forward's")
        else:
            self.graph.replay()
        return self.logits.clone()


def memory_estimate(agent, kind, args, prompt_len, new_per_turn):
    """A rough estimate of one agent's training memory in GiB, printed at start-up: fp32 weights, grads
    and AdamW states at 16 bytes a parameter (plus the reference), and one micro-batch of the longest
    contexts the turn limits allow: activations (~34 h bytes a layer and token in 16 bits, ~2 h kept
    with checkpointing), logits + their fp32 log-softmax + its gradient (~10-12 bytes a vocabulary entry)."""
    cfg = getattr(agent.model.config, "text_config", agent.model.config)
    obs = 30 if kind == "main" else (args.visit_max_chars // 3 if agent.chat else 60)  # tokens per tool result
    T = prompt_len + (args.sub_max_turns if kind == "sub" else args.main_max_turns) * (new_per_turn + obs)
    B = args.questions_per_step * args.group_size * (args.max_sub if kind == "sub" else 1)
    mb = min(args.micro_batch or B, B)
    act = cfg.num_hidden_layers * cfg.hidden_size * (2 if args.grad_checkpointing else 34) * (1 if agent.bf16 else 2)
    static = sum(p.numel() for p in agent.model.parameters()) * (16 + (2 if agent.bf16 else 4) * (args.kl_coef > 0))
    return static / 2 ** 30, mb * T * (act + (10 if agent.bf16 else 12) * cfg.vocab_size) / 2 ** 30, mb, T


def progress_line(rec, steps):
    if "eval" in rec:
        return f"eval after step {rec['step']}: {rec['eval']} success {rec['eval_success']:.3f}"
    return " | ".join([f"step {rec['step']:4d}/{steps}"] + [text.format(**rec) for key, text in (
        ("main_reward", "R_M {main_reward:.3f} success {success:.3f} zero-var M {zero_var_main:.2f}"),
        ("sub_reward", "R_S {sub_reward:.3f} zero-var S {zero_var_sub:.2f} dup {n_dup} drop {n_drop}"),
        ("approx_kl_main", "kl {approx_kl_main:.1e} gn {grad_norm_main:.2f}"), ("t_step", "{t_step:.2f}s"),
        ("t_store", "store {t_store:.2f}s")) if key in rec])


def plot_curves(out, rows):
    """<out>/curves.png (rewards per step, held-out success per evaluation) when matplotlib is installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
    for key in ("main_reward", "sub_reward", "success"):
        if points := [(r["step"], r[key]) for r in rows if key in r]:
            ax.plot(*zip(*points), lw=1, label=key)
    for how, marker in (("sampled", "o"), ("greedy", "s")):
        ax.plot(*zip(*[(r["step"], r["eval_success"]) for r in rows if r.get("eval") == how]), marker, label=how)
    ax.set(xlabel="M-GRPO step", ylim=(0, 1.02), title="rewards; held-out success (sampled, greedy)")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.savefig(os.path.join(out, "curves.png"))
    plt.close(fig)
    return os.path.join(out, "curves.png")
