"""Mutation testing: small, plausible M-GRPO bugs, applied one at a time to a copy of the code;
the fast test tier (`pytest -m "not slow"`) must catch every one.

Each mutant replaces one exact piece of `mgrpo.py` or a sibling module. A piece that is no longer
in the code, or is there more than once, stops the script: the list must follow the code.

    python tests/mutate.py             # every mutant: caught by which test, or survived
    python tests/mutate.py --list      # the mutants, numbered
    python tests/mutate.py --only 3 7  # some of them

Exit status 1 if any mutant survives (or is stale).
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (what the bug is, file, the piece of code, what it becomes)
MUTANTS = [
    ("sample std instead of population std (eq. 10, 13)", "mgrpo.py",
     "r.std(-1, unbiased=False, keepdim=True)", "r.std(-1, unbiased=True, keepdim=True)"),
    ("advantage sign flipped", "mgrpo.py", "adv = (r - mu) / (sigma + eps)", "adv = (mu - r) / (sigma + eps)"),
    ("a zero-variance group keeps its (0/eps) advantage", "mgrpo.py",
     "return torch.where(sigma > eps, adv, torch.zeros_like(adv))", "return adv"),
    ("M's groups formed across queries", "mgrpo.py",
     "adv = group_advantages(r_main.view(-1, K)).view(-1)", "adv = group_advantages(r_main.view(1, -1)).view(-1)"),
    ("a slot gets the correctness of the rollout whose slot it fills, not of the one that made it", "mgrpo.py",
     "for n, (k, _) in zip(made, pairs)]", "for n, (k, _) in zip(made, [(j // D, 0) for j in range(len(pairs))])]"),
    ("S's groups formed across queries", "mgrpo.py",
     "adv.append(group_advantages(r))", "adv.append(torch.tensor(r))"),
    ("d_k > D keeps the first D instead of D at random", "mgrpo.py",
     "out += [(k, i) for i in sorted(rng.sample(range(d), D))]", "out += [(k, i) for i in range(D)]"),
    ("d_k < D pads with copies of the first instead of random ones", "mgrpo.py",
     "[(k, rng.randrange(d)) for _ in range(D - d)]", "[(k, 0) for _ in range(D - d)]"),
    ("d_k = 0 borrows nothing (its slots dropped)", "mgrpo.py",
     "out += [rng.choice(pool) for _ in range(D)]", "pass"),
    ("R_M ignores the format", "mgrpo.py",
     "return w_format + (1 - w_format) * float(correct) if format_ok else 0.0",
     "return w_format + (1 - w_format) * float(correct)"),
    ("R_S weights of r_correct_main and r_expert swapped", "mgrpo.py",
     "w[1] * float(main_correct) + w[2] * float(expert)", "w[2] * float(main_correct) + w[1] * float(expert)"),
    ("clip range swapped", "mgrpo.py", "ratio.clamp(1 - eps_low, 1 + eps_high)", "ratio.clamp(1 - eps_high, 1 + eps_low)"),
    ("max instead of min in the clipped surrogate", "mgrpo.py",
     "torch.minimum(ratio * a, clipped_ratio * a)", "torch.maximum(ratio * a, clipped_ratio * a)"),
    ("off by one between logits and targets", "sampling.py",
     "lp = head_logp(model, h[:, :-1], ids[:, 1:], keep, mask is None)",
     "lp = head_logp(model, h[:, 1:], ids[:, 1:], keep, mask is None)"),
    ("positions ignore left padding", "sampling.py",
     "    pos = (attn.cumsum(-1) - 1).clamp(min=0)\n",
     "    pos = torch.arange(attn.shape[1], device=attn.device)[None].expand_as(attn)\n"),
    ("tool output and returned text given mask 1", "agents.py",
     "self.mask += [0 if logp is None else 1] * len(ids)", "self.mask += [1] * len(ids)"),
    ("the loss mask ignored", "mgrpo.py", "per_tok = -surr * m", "per_tok = -surr"),
    ("micro-batches normalised on their own", "mgrpo.py",
     'yield sl, (min(mb, B - s) / B) if agg == "seq-mean" else mask[sl].sum() / n_tok', "yield sl, 1.0"),
    ("the attention mask built from token ids (pad == eos drops the final eos)", "sampling.py",
     "ids[b, :n], attn[b, :n] = torch.tensor(t.ids), 1", "ids[b, :n], attn[b, :n] = torch.tensor(t.ids), torch.tensor(t.ids) != pad_id"),
    ("unsync behaves as sync", "mgrpo.py", "        batch, adv = previous\n", ""),
    ("main-only trains S", "mgrpo.py", "        batch = []  # S frozen", "        pass  # S frozen"),
    ("sampling at temperature 0.8", "sampling.py",
     "cdf = allowed.double().exp().cumsum(-1)", "cdf = (allowed / 0.8).double().exp().cumsum(-1)"),
    ("bf16: the sampler's log-probs kept as the old ones, no truncated importance weight", "mgrpo.py",
     "            old[rows] = logp.detach()\n", ""),
    ("bf16: the importance weight not truncated", "mgrpo.py",
     "w = (old_logp - sampled_logp).clamp(max=math.log(cap)).exp()", "w = (old_logp - sampled_logp).exp()"),
    ("a finished row that rode along keeps the KV of tokens past its end", "sampling.py",
     "real = self.attn[r].nonzero()[:k.n, 0]", "real = self.attn[r].nonzero()[-k.n:, 0]"),
    ("pad and unk not suppressed when sampling", "sampling.py",
     "allowed = logp.index_fill(-1, suppress, -math.inf) if len(suppress) else logp", "allowed = logp"),
    ("stored log-prob of the renormalised (suppressed) distribution", "sampling.py",
     "return tok, logp.gather(-1, tok[:, None])[:, 0]", "return tok, allowed.log_softmax(-1).gather(-1, tok[:, None])[:, 0]"),
    ("a second action in a turn gets format credit", "tools.py",
     "return (tag, arg) if arg and not _TAG.search(arg) and clean_text(arg) == arg else None",
     "return (tag, arg) if arg and clean_text(arg) == arg else None"),
    ("r_expert from the task's check although a judge is given", "mgrpo.py", "    if judge:\n", "    if False:\n"),
    ("S's tool results not kept as what it read", "mgrpo.py",
     "                trajs[j].reads.append(message)", "                pass"),
    ("the judge asked once per sub-trajectory, the same prompt again", "judge.py",
     "distinct = list(dict.fromkeys(a for a in asks if a is not None))", "distinct = [a for a in asks if a is not None]"),
    ("a judge that is down asked for every answer of the step", "judge.py",
     "        if self.in_a_row >= THREADS:\n", "        if False:\n"),
    ("training questions drawn from the test split too", "qa_task.py",
     "if seed >= EVAL_SEED else (self.train, seed)", "if seed >= EVAL_SEED else (self.train + self.test, seed)"),
    ("SQuAD's normalization keeps the articles", "qa_task.py",
     're.sub(r"\\b(a|an|the)\\b", " ", s.lower().translate(_PUNCT))', "s.lower().translate(_PUNCT)"),
    ("r_expert without a judge counts a result's number as a passage's word", "qa_task.py",
     'return re.sub(r"(?m)^\\[\\d+\\] |\\(\\w+://[^\\s()]*\\)", " ", read)', "return read"),
]


def first_failure(output):
    m = re.search(r"^FAILED (\S+)", output, re.M) or re.search(r"^ERROR (\S+)", output, re.M)
    return m.group(1) if m else "(the run failed: " + output.strip().splitlines()[-1][:120] + ")"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--list", action="store_true", help="list the mutants and exit")
    p.add_argument("--only", type=int, nargs="+", help="run only these mutants (numbers from --list)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per mutant's test run")
    a = p.parse_args()
    if a.list:
        for i, (what, file, _, _) in enumerate(MUTANTS, 1):
            print(f"{i:3d}. {what} ({file})")
        return 0
    picked = [(i, m) for i, m in enumerate(MUTANTS, 1) if not a.only or i in a.only]
    if not picked:
        print(f"no such mutant: {a.only} (there are {len(MUTANTS)}; --list shows them)")
        return 1
    stale = [(i, m[0]) for i, m in picked if open(os.path.join(ROOT, m[1])).read().count(m[2]) != 1]
    if stale:
        for i, what in stale:
            print(f"stale mutant {i} ({what}): its piece of code is not in the file exactly once; update MUTANTS")
        return 1
    survived, t_all = [], time.time()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = os.path.join(tmp, "repo")  # the whole checkout but its git, virtual environment and runs
        shutil.copytree(ROOT, tmp, ignore=shutil.ignore_patterns(".git", ".venv", "runs", "__pycache__", ".pytest_cache"))
        fast_tier = [sys.executable, "-m", "pytest", "-q", "-x", "-m", "not slow", "-p", "no:cacheprovider", "tests"]
        r = subprocess.run(fast_tier, cwd=tmp, capture_output=True, text=True, timeout=a.timeout)
        if r.returncode != 0:  # else every mutant would count as caught
            print(f"the unmutated copy fails the fast tier ({first_failure(r.stdout + r.stderr)}): fix that first")
            return 1
        for i, (what, file, old, new) in picked:
            original = open(os.path.join(ROOT, file)).read()
            with open(os.path.join(tmp, file), "w") as f:
                f.write(original.replace(old, new))
            t0 = time.time()
            try:
                r = subprocess.run(fast_tier, cwd=tmp, capture_output=True, text=True, timeout=a.timeout)
                caught, by = r.returncode != 0, first_failure(r.stdout + r.stderr)
            except subprocess.TimeoutExpired:
                caught, by = True, f"(the fast tier ran past {a.timeout:.0f}s: a hang)"
            with open(os.path.join(tmp, file), "w") as f:
                f.write(original)
            print(f"{i:3d}. {'caught  ' if caught else 'SURVIVED'} {what}" + (f"\n       by {by}" if caught else "")
                  + f"  ({time.time() - t0:.0f}s)", flush=True)
            if not caught:
                survived.append(what)
    print(f"\n{len(picked) - len(survived)} of {len(picked)} mutants caught by the fast tier "
          f"({(time.time() - t_all) / 60:.1f} min)" + (f"; survived: {'; '.join(survived)}" if survived else ""))
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
