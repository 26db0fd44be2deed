"""Shortcuts for the tests: an agent as mgrpo.py builds it, for the task its settings name."""
import agents
import run


def load_agent(name, args, seed=0, **kw):
    """agents.load_agent with the task of args.task."""
    return agents.load_agent(name, args, run.load_task(args.task), seed, **kw)
