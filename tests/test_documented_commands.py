"""Every `python mgrpo.py` command in the README and the guides runs as written, a few steps long.

A command keeps its options; the test adds a short schedule after them (argparse takes the last
value): one step of 1 question x 2 rollouts, 2 evaluation questions, and its cold start's preset or
JSON cut to 2 steps without a check. What this machine cannot reach is stood in for, and said so:
a hub name (Qwen/...) by tiny chat models built here and saved as Hugging Face folders, a GPU by the CPU, a judge's or a server's URL by a server on a free port
(the tests' stand-in judge, toy_server.py, retriever.py serve), and data/questions.jsonl,
data/corpus.jsonl (which the pages make from downloads) by the tests' small world (test_qa.write_qa).
The pages' `python scripts/qa_files.py geo` commands need no download and run as written, first.
Two commands that run together (--role main, --role sub) run as two processes."""
import dataclasses
import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading

import pytest

import mgrpo
import retriever
import toy_server
from test_qa import fake_judge, needs_bm25s, write_qa

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md", "tutorial.md", *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]
SHORT = ["--steps", "1", "--questions-per-step", "1", "--group-size", "2", "--eval-questions", "2",
         "--eval-every", "0", "--max-new-tokens", "16"]


def documented_commands(script="mgrpo.py"):
    """[(page:line, argv after `python SCRIPT`, runs in the background)] of every command in a code block,
    its continuation lines joined, its comment cut, a shell variable set in the block ($OPTS) filled in."""
    found = []
    for page in PAGES:
        lines, block, env = open(os.path.join(ROOT, page)).read().split("\n"), False, {}
        i = 0
        while i < len(lines):
            where, line = f"{os.path.relpath(os.path.join(ROOT, page), ROOT)}:{i + 1}", lines[i]
            while line.rstrip().endswith("\\"):
                i += 1
                line = line.rstrip()[:-1] + " " + lines[i].strip()
            if line.startswith("```"):
                block, env = not block, {}
            elif block and re.match(r"[A-Z_]+=", line):
                name, value = line.split("=", 1)
                env[name] = " ".join(shlex.split(value))
            elif block and line.startswith(f"python {script} "):
                words = shlex.split(re.sub(r"\$(\w+)", lambda m: env[m.group(1)], line), comments=True)
                found.append((where, words[2:] if words[-1] != "&" else words[2:-1], words[-1] == "&"))
            i += 1
    return found


def short(argv):
    """The command with the short schedule: its cold start, as the command sets it or by default, cut to 2
    steps without a check (none where it has none: a model given, with no --cold-start)."""
    c = mgrpo.parse_args(argv).cold_start
    if c.steps > 0 or (c.steps < 0 and not any(a in argv for a in ("--main-model", "--sub-model"))):
        argv = argv + ["--cold-start", json.dumps({**dataclasses.asdict(c), "steps": 2, "until": 0})]
    return argv + SHORT


def stand_ins(argv, chat_dir, urls, n):
    """What this machine cannot reach, stood in for (see the module's docstring); a page's placeholder seed
    (S) is 1; a folder is the command's own (n), a store a folder of the test's."""
    out = []
    for a in argv:
        if out and out[-1] == "--seed" and not a.isdigit():
            a = "1"
        elif out and out[-1] == "--out":
            a = f"{a}-{n}"
        elif out and out[-1] == "--store":
            a = "store-" + os.path.basename(a)
        elif a.startswith("Qwen/"):
            a = chat_dir["main" if "1.5B" in a else "sub"]
        elif a.startswith("cuda"):
            a = "cpu"
        elif re.match(r"http://127\.0\.0\.1:(PORT|\d+)", a):
            kind = "judge" if out[-1] == "--judge" else "retrieve" if a.endswith("/retrieve") else "toy"
            a = urls[kind]
        out.append(a)
    return out


def test_the_pages_hold_the_commands_this_test_runs():
    found = documented_commands()
    pages = {where.split(":")[0] for where, _, _ in found}
    assert {"README.md", "docs/own-questions.md", "docs/real-models.md", "docs/toy-task.md"} <= pages, pages
    assert all("$" not in " ".join(argv) for _, argv, _ in found)
    assert sum(background for _, _, background in found) == 2  # the two roles, README's and real-models'
    assert any(argv[0] == "geo" for _, argv, _ in documented_commands("scripts/qa_files.py"))


@pytest.mark.slow
@needs_bm25s
def test_every_documented_command_starts_and_ends(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    mgrpo.main(["--chat", "--model-size", "0.1M", "--cold-start", "none", "--steps", "0", "--eval-questions", "1",
                "--out", "chat"])
    chat_dir = {name: os.path.join(tmp_path, "chat", name) for name in ("main", "sub")}
    shutil.copytree(os.path.join(ROOT, "tests"), tmp_path / "tests")  # docs/toy-task.md's --task tests/sum_task.py
    (tmp_path / "data").mkdir()
    questions, corpus = write_qa(tmp_path / "data")
    for name in ("questions.jsonl", "corpus.jsonl"):
        shutil.copy(tmp_path / "data" / name, tmp_path / name)
    for where, argv, _ in documented_commands("scripts/qa_files.py"):
        if argv[0] == "geo":
            done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "qa_files.py"), *argv],
                                  capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, (where, done.stderr[-2000:])
    toy = toy_server.make_server(0)
    search = retriever.make_server(retriever.Bm25Search(str(tmp_path / "corpus.jsonl")))
    for srv in (toy, search):
        threading.Thread(target=srv.serve_forever, daemon=True).start()
    with fake_judge() as (judge_url, _, _):
        urls = {"judge": judge_url, "toy": f"http://127.0.0.1:{toy.server_address[1]}",
                "retrieve": f"http://127.0.0.1:{search.server_address[1]}/retrieve"}
        pending = []
        for n, (where, argv, background) in enumerate(documented_commands()):
            argv = short(stand_ins(argv, chat_dir, urls, n))
            if "--out" not in argv:
                argv += ["--out", f"run{n}"]
            if background or pending:  # a decoupled pair: the first goes in the background
                pending.append((where, subprocess.Popen([sys.executable, os.path.join(ROOT, "mgrpo.py"), *argv],
                                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
                if not background:
                    for w, proc in pending:
                        tail = proc.communicate(timeout=600)[0][-2000:]
                        assert proc.returncode == 0, (w, tail)
                    pending = []
                continue
            summary = mgrpo.main(argv)
            assert summary["steps"] == 1, (where, summary)
    for srv in (toy, search):
        srv.shutdown()
