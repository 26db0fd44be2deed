"""Shortcuts for the tests: an agent as mgrpo.py builds it, for the task its settings name."""
import agents
import run


def load_agent(name, args, seed=0, **kw):
    """agents.load_agent with the task of args.task."""
    return agents.load_agent(name, args, run.load_task(args.task), seed, **kw)


def crashing(train_step, at):
    """mgrpo.train_step as a kill at step `at` leaves it: a KeyboardInterrupt there, the steps before as they are."""
    def step(main, sub, n, *a, **kw):
        if n == at:
            raise KeyboardInterrupt
        return train_step(main, sub, n, *a, **kw)
    return step
