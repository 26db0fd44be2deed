"""What the two roles of a decoupled run (mgrpo.py --role main / sub) write to each other through
the store, besides the run's settings and the heartbeats: per main turn, the sub-tasks one way and
S's answers the other; after the rollouts, M's statistics (`exchange`). A store is untrusted input:
a record read must have the shape its writer gives it, or it is an error that names the record.
"""
from store import StoreError


def phase_key(idx):
    return f"p{idx:06d}"


def questions_ok(pairs):
    return all(type(seed) is int and type(level) is int for seed, level in pairs)


def tasks_ok(rec):
    return (all(type(t) is str for t in rec["tasks"]) and len(rec["tasks"]) == len(rec["questions"])
            and questions_ok(rec["questions"]) and type(rec["seed"]) is int
            and type(rec["greedy"]) is bool)


def results_ok(rec, n_tasks):
    """S's answers: one (text or None, format ok) per sub-task asked."""
    answers_ok = [(a is None or type(a) is str) and type(ok) is bool for a, ok in rec["results"]]
    return len(answers_ok) == n_tasks and all(answers_ok)


def exchange_ok(rec, n_subs):
    """M's statistics: per rollout a query among the questions, and sub-trajectories S holds."""
    for e in rec["exchange"]:
        subs_ok = all(type(i) is int and 0 <= i < n_subs for i in e["subs"])
        if not (0 <= e["query"] < len(rec["questions"]) and type(e["rollout"]) is int
                and type(e["correct"]) is bool and subs_ok):
            return False
    return questions_ok(rec["questions"])


def store_record(store, key, rec, check, task=None):
    """(rec, the questions it names, if a task is given) if check(rec) holds; else a StoreError."""
    try:
        if check(rec) and task is None:
            return rec, None
        if check(rec):
            return rec, [task.make_question(seed, level) for seed, level in rec["questions"]]
    except (KeyError, TypeError, ValueError, IndexError):
        pass
    raise StoreError(f"store {store.dir}: record {key} is not what the {store.peer} role writes; "
                     f"start both roles on an empty store")
