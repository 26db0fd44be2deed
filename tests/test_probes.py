"""The probes of experiments/ (sub_probe, first_errors, answer_margin, update_probe, hops): what they read, on hand-made
trajectories and on the cold-started agents."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

import cold_start
import helpers
import mgrpo
import toy_tools
from experiments import answer_margin, first_errors, hops, recall, sub_probe, update_probe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def probe(*argv):
    """python -m experiments.sub_probe argv, from the repository's root."""
    return subprocess.run([sys.executable, "-m", "experiments.sub_probe", *argv], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)


@pytest.mark.slow
def test_sub_probe_script_runs():
    r = probe("--cold-start", '{"steps": 2, "levels": [1, 2]}')
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    i = lines.index("sub-agent, expert score greedy / sampled:")
    assert [line.split(":")[0] for line in lines[i + 1:]] == [
        "  level 1", "  level 2", "  level 3",
        "sub-agent's greedy misses by the place of the asked fact in its result list (0", "  level 1", "  level 2",
        "  level 3", "sub-agent, level 2's facts about a person read (greedy), by how many facts back they stand",
        "  friend, list of 8", "  friend, list of 12", "  friend, the head that attends most to the value, list of 8",
        "  city, list of 8", "  city, list of 12", "  city, the head that attends most to the value, list of 8",
        "main agent with a perfect sub-agent, success greedy / sampled", "  level 1", "  level 2", "  level 3"]
    for line in lines[i + 5:i + 8]:  # misses by place: none, or place: count pairs whose places are in a list
        places = line.split(": ", 1)[1]
        assert places == "none" or all(-1 <= int(p) < 12 and int(n) > 0 for p, n in
                                        (pair.split(": ") for pair in places.split(", ")))
    assert lines[i + 2].startswith("  level 2: friend ") and lines[i + 3].startswith("  level 3: friend1 0")
    for line in lines[-3:]:  # M with a perfect S: two shares in [0, 1]
        assert all(0 <= float(x) <= 1 for x in line.split(":")[1].split("/"))
    for line in lines[i + 1:i + 4]:  # S's share of first searches for its sub-task's own entity
        assert 0 <= float(line.rsplit(": ", 1)[1].rstrip(")")) <= 1
    # the single agent: every one of the 200 questions per level is right, or sorted by its first wrong search
    r = probe("--mode", "single-agent", "--cold-start", "2", "--max-turns", "5", "3")
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    levels = [line for line in lines if line.startswith("  level ")]
    for level, line in zip((1, 2, 3), levels):
        head, counts = line.split(": ", 1)
        kinds = dict(c.rsplit(" ", 1) for c in counts.split(", "))
        assert head == f"  level {level}" and sum(map(int, kinds.values())) == 200
        assert set(kinds) <= {"right", "other"} | {f"search {i} asks for a wrong entity" for i in range(1, level + 2)}
    for line in lines:  # each wrong first search: the places of the facts misread, each in its list
        if line.startswith("    search "):
            assert all(-1 <= int(p.split()[0]) < 12 for p in line.split("stood at places ")[1][:-12].split(", "))
    # the friend fact read, per distance back: k = 1 to the list's length, each a share; then per k
    # the head (layer.head of the 0.2M model's 2 layers of 8 heads) that attends most to the value
    for (rel, length), line in zip([(r, n) for r in ("friend", "city") for n in (8, 12, 0)], lines[-6:]):
        head, reads = line.split(": ", 1)
        reads = [r.split() for r in reads.split(", ")]
        heads = "the head that attends most to the value, list of 8"
        assert head == f"  {rel}, " + (f"list of {length}" if length else heads)
        assert [int(r[0]) for r in reads] == list(range(1, (length or 8) + 1))
        assert all(0 <= float(r[-1]) <= 1 for r in reads)
        assert length or all(int(r[1].split(".")[0]) < 2 and int(r[1].split(".")[1]) < 8 for r in reads)


def test_sub_probe_reads_the_first_search_of_either_format():
    from types import SimpleNamespace
    from agents import Traj
    agent = SimpleNamespace(tok=SimpleNamespace(decode=lambda ids: ids))
    first = [sub_probe.first_search(agent, Traj(text, [], [])) for text in (
        "<user> city of bo <search> bo </search> <tool> x <search> cy </search>",
        '<tool_call>\n{"name": "search", "arguments": {"query": "zed"}}\n</tool_call> "query": "ada"',
        "<return> avon </return>")]
    assert first == ["bo", "zed", None]


def test_sub_probe_gives_a_given_model_no_cold_start_unless_asked(tmp_path, monkeypatch):
    """sub_probe reads --cold-start as mgrpo.py does: by default a model built here gets 600 steps and
    a stage 1 given by path none, so probing a checkpoint never changes it first."""
    agent = helpers.load_agent("", mgrpo.parse_args([]), seed=0)
    agent.model.save_pretrained(tmp_path / "main")
    agent.tok.save_pretrained(tmp_path / "main")
    asked = []

    def stop(agents, steps, args, task, rnd=0):
        asked.append(dict(steps))
        raise KeyboardInterrupt  # what follows the cold start is not under test here

    monkeypatch.setattr(cold_start, "cold_start_round", stop)
    for argv in (["--main-model", str(tmp_path / "main")], ["--main-model", str(tmp_path / "main"), "--cold-start", "7"],
                 ["--mode", "single-agent", "--main-model", str(tmp_path / "main")]):
        with pytest.raises(KeyboardInterrupt):
            sub_probe.main(argv)
    assert asked == [{"main": 0, "sub": 600}, {"main": 7, "sub": 7}, {"main": 0}]


def test_first_errors_names_each_rollouts_first_mistake():
    from types import SimpleNamespace
    from agents import Traj
    q = toy_tools.make_question(5, 2)  # country of friend of X: three hops
    kb, x = toy_tools.knowledge_base(q.seed, 2), q.text.split()[-2]
    friend, city = kb[("friend", x)], kb[("city", kb[("friend", x)])]
    chain = [f"friend of {x}", f"city of {friend}", f"country of {city}"]
    right = [Traj([], [], [], task=chain[0], result=friend), Traj([], [], [], task=chain[1], result=city),
             Traj([], [], [], task=chain[2], result=q.answer)]
    wrong_value = next(p for p in toy_tools.PERSONS if p != friend)

    def system(subs, n=3):
        return first_errors.system_error(q, chain, Traj([], [], [], calls=list(range(n))), subs)
    assert system(right, 2) == "M answered after 2 calls"
    assert system([right[0], Traj([], [], [], task=f"city of {wrong_value}", result=city), right[2]]) == \
        "M wrote sub-task 2 wrong"
    assert system([Traj([], [], [], task=chain[0], result=wrong_value), *right[1:]]) == "S misread hop 1"
    assert system(right) == "M's answer is not the value S returned"
    agent = SimpleNamespace(tok=SimpleNamespace(decode=lambda ids: ids))
    searches = [f"<search> {e} </search> <tool> ..." for e in (x, friend, city)]
    assert first_errors.single_error(agent, chain, Traj(" ".join(searches[:1]), [], [])) == "answered after 1 searches"
    assert first_errors.single_error(agent, chain, Traj(f"{searches[0]} <search> {wrong_value} </search>", [], [])) \
        == "search 2 for a wrong entity"
    assert first_errors.single_error(agent, chain, Traj(" ".join(searches), [], [])) == \
        "answer wrong after every search right"


def test_first_errors_reproduces_the_runs_evaluation(cold_start_dir, capsys, monkeypatch):
    """The script samples the very rollouts of mgrpo.evaluate (same questions, seeds, token ids), so
    its success is the run's; and it counts every question once."""
    argv = ["--level", "1", "--cold-start", "0", "--eval-questions", "24", "--main-model", cold_start_dir["main"],
            "--sub-model", cold_start_dir["sub"]]
    rollouts, rollout = [], mgrpo.rollout

    def spy(*a, **kw):
        out = rollout(*a, **kw)
        rollouts.append([t.ids for t in out[0]] + [t.ids for t in out[1]])
        return out
    monkeypatch.setattr(mgrpo, "rollout", spy)
    first_errors.main(argv)
    lines, theirs = capsys.readouterr().out.splitlines(), rollouts[:]
    rollouts.clear()
    args = mgrpo.parse_args(argv)
    main_agent = helpers.load_agent(args.main_model, args, seed=0)
    sub = helpers.load_agent(args.sub_model, args, seed=1)
    delegate = lambda *a: mgrpo.run_sub_agents(sub, args, toy_tools.ToySearch(), *a)  # noqa: E731
    for line, greedy in zip(lines, (False, True)):
        success = mgrpo.evaluate(main_agent, args, toy_tools, delegate, None, greedy)
        assert line.startswith(f"{'greedy' if greedy else 'sampled'}: success {success:.3f}")
    assert len(theirs) == 2 and theirs == rollouts  # sampled, then greedy: token for token
    for line in lines:
        right = round(float(line.split("success ")[1].split(";")[0]) * 24)
        mistakes = re.findall(r" (\d+)(?:,|$)", line.split("first mistakes: ")[1])
        assert right + sum(map(int, mistakes)) == 24, line


def test_answer_margin_reads_where_m_answers(cold_start_dir, capsys):
    """Cut before each greedy answer, the context's next token is <answer> for the M that ran: its
    margin over <call> is never below 0, and another M is read at the very same places."""
    argv = ["--level", "1", "--cold-start", "0", "--eval-questions", "16", "--main-model", cold_start_dir["main"],
            "--sub-model", cold_start_dir["sub"], "--compare", cold_start_dir["main"]]
    contexts = answer_margin.main(argv)
    out = capsys.readouterr().out.splitlines()
    assert contexts and out[0].startswith(f"{len(contexts)} of 16 questions answered")
    assert all(c[-1] == contexts[0][-1] for c in contexts)  # each ends where M's turn begins
    mine, again = out[1].split(": ", 1)[1], out[2].split(": ", 1)[1]
    assert mine == again and f"below 0 at 0 of {len(contexts)}" in mine
    agent = helpers.load_agent(cold_start_dir["main"], mgrpo.parse_args(argv[:-2]), seed=0)
    ids = agent.tok.convert_tokens_to_ids(["<answer>", "<call>"])
    got = answer_margin.margins(agent, contexts, *ids)
    assert (got >= 0).all() and (answer_margin.margins(agent, contexts, *ids[::-1]) == -got).all()
    from sampling import token_logprobs  # the training path: the next token of each context, one per row
    with torch.no_grad():
        last = [[float(token_logprobs(agent.model, torch.tensor([c + [t]]), torch.ones(1, len(c) + 1,
                                                                                       dtype=torch.long))[0, -1])
                 for t in ids] for c in contexts[:4]]
    assert all(abs(g - (a - b)) < 1e-4 for g, (a, b) in zip(got, last)) and len(last) > 0
    with pytest.raises(SystemExit):
        answer_margin.main(["--main-model", cold_start_dir["main"]])  # no sub-agent to run


def test_update_probe_measures_each_update_of_each_agent(cold_start_dir, tmp_path):
    """One line per update of each agent, after its step; an agent's first update with a signal moves
    some weight by about lr however hard its gradient is clipped (AdamW's first step is lr times the
    gradient's sign); and mgrpo's functions are its own again after the probe."""
    argv = ["--level", "1", "--cold-start", "0", "--steps", "2", "--questions-per-step", "4", "--eval-questions", "8",
            "--grad-clip", "0.001", "--main-model", cold_start_dir["main"], "--sub-model", cold_start_dir["sub"],
            "--out", str(tmp_path / "probe")]
    update_agent = mgrpo.update_agent
    with open(update_probe.main(argv)) as f:
        recs = [json.loads(line) for line in f]
    assert mgrpo.update_agent is update_agent
    assert [(r["agent"], r["step"]) for r in recs] == [("main", 1), ("sub", 1), ("main", 2), ("sub", 2)]
    for r in recs:
        assert 0 <= r["rows_signal"] <= r["rows"] and r["tokens_signal"] >= r["rows_signal"] and r["step_norm"] > 0
        assert (r["grad_rms_over_v"] is None) == (r["step"] == 1)  # AdamW has a second moment from its 2nd step
        assert r["dlogp_max"] >= abs(r["kl_batch"]) and r["dlogp_max"] > 0  # the update moved the policy
    first = [r for r in recs if r["step"] == 1 and r["rows_signal"]]
    assert first and all(0.99 < r["step_max_over_lr"] < 1.5 and r["grad_norm"] > 0.001 for r in first)


def test_curves_reads_each_runs_steps_and_evaluations_and_draws_them(tmp_path):
    from experiments import curves
    rows = [{"step": 0, "eval": "sampled", "eval_success": 0.2}, {"step": 0, "eval": "greedy", "eval_success": 0.9},
            {"step": 1, "success": 0.25}, {"step": 2, "success": 0.5}, {"step": 2, "eval": "sampled", "eval_success": 0.6}]
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    steps, success, evals = curves.read(str(tmp_path / "a"))
    assert (steps, success) == ([1, 2], [0.25, 0.5])
    assert evals == {"sampled": [(0, 0.2), (2, 0.6)], "greedy": [(0, 0.9)]}
    try:
        import matplotlib  # noqa: F401  (optional: without it, a message says how to install it)
    except ImportError:
        with pytest.raises(SystemExit, match="pip install matplotlib"):
            curves.main([str(tmp_path / "c.png"), str(tmp_path / "a")])
        return
    curves.main([str(tmp_path / "c.png"), str(tmp_path / "a"), str(tmp_path / "b")])
    assert (tmp_path / "c.png").stat().st_size > 1000


def test_the_hops_probe_puts_a_wrong_answer_down_to_its_first_cause():
    from agents import Traj
    from qa_task import Question, QaTask
    task = QaTask.__new__(QaTask)  # answer_correct reads only the question
    q = Question(0, 1, "What is the capital of the country where Ulm is?", ["Berlin"],
                 hops=(("In which country is Ulm?", "Germany"), ("What is the capital of #1?", "Berlin")))
    sub = lambda text: Traj([], [], [], result=text)  # noqa: E731
    subs = [sub("Ulm lies in Germany."), sub("Berlin"), sub("germanys"), sub("none")]
    main = lambda answer, calls, ok=True: Traj([], [], [], result=answer, ok=ok, calls=calls)  # noqa: E731
    assert hops.first_cause(task, q, main("berlin", [0, 1]), subs) == "right"
    assert hops.first_cause(task, q, main("Berlin", [0, 1], ok=False), subs) != "right"  # a broken format scores 0
    assert hops.first_cause(task, q, main("Paris", []), subs) == "answered without delegating"
    assert hops.first_cause(task, q, main("Paris", [2, 3]), subs) == "first hop's fact never came back"  # not whole words
    assert hops.first_cause(task, q, main("Paris", [0, 3]), subs) == "hop 2's fact never came back"
    assert hops.first_cause(task, q, main("Bonn", [1, 0]), subs) == "M's answer wrong though S returned every hop's fact"
    assert not hops.returned("", subs) and hops.returned("GERMANY", subs[:1])


@pytest.mark.slow
def test_the_hops_probe_runs_on_a_question_file_with_hops(tmp_path, capsys):
    pytest.importorskip("bm25s")
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import qa_files
    qa_files.geo(str(tmp_path), per_hops=60, hops=(2,))
    mgrpo.main(["--chat", "--model-size", "0.1M", "--cold-start", "none", "--steps", "0", "--eval-questions", "1",
                "--out", str(tmp_path / "chat")])
    capsys.readouterr()
    hops.main(["--task", f"qa:{tmp_path}/questions.jsonl", "--search", f"bm25:{tmp_path}/corpus.jsonl",
               "--main-model", str(tmp_path / "chat" / "main"), "--sub-model", str(tmp_path / "chat" / "sub"),
               "--eval-questions", "6", "--max-new-tokens", "16"])
    lines = capsys.readouterr().out.splitlines()
    found = [line for line in lines if line.startswith(("sampled: ", "greedy: ", "  first causes"))]
    assert [line.split(":")[0] for line in found] == ["sampled", "  first causes of the " + found[1].split()[4]
                                                      + " wrong answers", "greedy", found[3].split(":")[0]]
    for head, causes in zip(found[::2], found[1::2]):
        right = round(float(head.split()[2]) * 6)
        wrong = sum(int(c.rsplit(" ", 1)[1]) for c in causes.split(": ", 1)[1].split(", ") if c != "none")
        assert right + wrong == 6 and int(causes.split()[4]) == wrong
        calls = head.split("per rollout: ")[1].split("; S returned")[0].split(", ")
        assert abs(sum(float(c.split(": ")[1]) for c in calls) - 1) < 1e-3
    for block in "\n".join(lines).split("greedy: "):  # each cause's questions by number: every wrong one, once
        listed = [line.split(": questions ") for line in block.splitlines() if ": questions " in line]
        numbers = [int(n) for _, ns in listed for n in ns.split(", ")]
        causes = block.split("wrong answers: ")[1].splitlines()[0]
        assert len(numbers) == len(set(numbers)) == sum(int(c.rsplit(" ", 1)[1]) for c in causes.split(", ") if c != "none")
        assert set(numbers) <= set(range(1, 7)) and all(f"{k.strip()} {len(ns.split(', '))}" in causes for k, ns in listed)


def test_the_recall_probe_counts_the_hops_whose_search_holds_the_answer(tmp_path, capsys):
    pytest.importorskip("bm25s")
    hop = lambda city, country, capital: [{"question": f"In which country is {city}?", "answer": country},  # noqa: E731
                                          {"question": "What is the capital of #1?", "answer": capital}]
    rows = [("Ulm", "Germany", "Berlin", "test"), ("Lyon", "France", "Paris", "test"), ("Graz", "Austria", "Vienna", "train")]
    with open(tmp_path / "q.jsonl", "w") as f:
        for city, country, capital, split in rows:
            f.write(json.dumps({"question": f"What is the capital of the country where {city} is?", "answers": [capital],
                                "split": split, "question_decomposition": hop(city, country, capital)}) + "\n")
    passages = ["Ulm is a city in Germany.", "Lyon is a city in France.", "Graz is a city in Austria.",
                "Germany is a country in Europe. Its capital is Berlin.", "Bonn was the capital of Germany.",
                "France is a country in Europe. Its capital is Parisville."]  # Paris is not there as a whole word
    with open(tmp_path / "c.jsonl", "w") as f:
        f.writelines(json.dumps({"id": str(i), "title": c.split()[0], "contents": c}) + "\n"
                     for i, c in enumerate(passages))
    run = lambda *extra: (recall.main([str(tmp_path / "q.jsonl"), str(tmp_path / "c.jsonl"), *extra]),  # noqa: E731
                          capsys.readouterr().out)[1]
    out = run("--k", "1")  # Bonn's shorter passage comes first for Germany's capital
    assert "hop 1: the results hold the answer for 2 of 2" in out and "hop 2: the results hold the answer for 0 of 2" in out
    out = run("--k", "2")
    assert "hop 2: the results hold the answer for 1 of 2" in out and "every hop's: 1 of 2" in out
    assert "'What is the capital of France?' x1" in out
    assert "every hop's: 1 of 1" in run("--first", "1")  # Ulm alone
    out = run("--first", "3")  # Ulm, Lyon, Ulm again: as mgrpo.py's evaluation wraps
    assert "every hop's: 2 of 3" in out and "by their number in the evaluation: 2\n" in out
    assert "every hop's: 0 of 1" in run("--split", "train")  # no Austria passage
    with open(tmp_path / "plain.jsonl", "w") as f:
        f.write(json.dumps({"question": "Where is Ulm?", "answers": ["Germany"], "split": "test"}) + "\n"
                + json.dumps({"question": "Where is Graz?", "answers": ["Austria"]}) + "\n")
    with pytest.raises(SystemExit, match="no test question carries question_decomposition"):
        recall.main([str(tmp_path / "plain.jsonl"), str(tmp_path / "c.jsonl")])
    (tmp_path / "bad.jsonl").write_text('{"id": "1", "title": "x", "contents": "y"}\nnot json\n')
    for corpus, says in (("missing.jsonl", "missing.jsonl"), ("bad.jsonl", "bad.jsonl, line 2")):
        with pytest.raises(SystemExit, match=says):
            recall.main([str(tmp_path / "q.jsonl"), str(tmp_path / corpus)])
    for bad in (["--k", "0"], ["--first", "-3"], ["--k", "x"]):
        with pytest.raises(SystemExit):
            recall.main([str(tmp_path / "q.jsonl"), str(tmp_path / "c.jsonl"), *bad])
        assert "must be an integer from 1 to" in capsys.readouterr().err
