"""The benchmarks (benchmarks/) run, and their figures have the shape they print."""
import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bench(module, *argv):
    """python -m benchmarks.<module> argv, from the repository's root."""
    return subprocess.run([sys.executable, "-m", f"benchmarks.{module}", *argv], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)


@pytest.mark.slow
def test_bench_script_runs():
    r = bench("bench", "--sizes", "0.1M", "--steps", "1", "--sft-steps", "2")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "0.1M" in r.stdout.splitlines()[-1]


@pytest.mark.slow  # tens of seconds: out of the fast tier
def test_bench_generate_script_runs(tmp_path):
    """The replay benchmark records a step and replays it with each sampler: every rate is shown against the
    raw decode loop's; mgrpo's samplers never prefill fewer tokens than the floor it prints, and the parts
    of their time are no more than the whole."""
    r = bench("bench_generate", "--model-size", "0.1M", "--sft-steps", "2", "--steps", "1", "--rounds", "1",
              "--repeat", "1", "--methods", "raw", "mgrpo", "mgrpo-before", "--folder", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    start = lines.index(next(x for x in lines if x.startswith("float32 (matmul")))
    rows = {x.split()[0]: x.split() for x in lines[start + 2:start + 5]}
    floor = float(lines[start + 5].split(": ")[1].split()[0])
    assert set(rows) == {"raw", "mgrpo", "mgrpo-before"} and floor > 0 and rows["raw"][3] == "1.00x"
    assert all(float(rows[m][-1]) >= floor for m in ("mgrpo", "mgrpo-before"))
    parts = {x.split()[0]: [float(v) for v in x.split()[2:]] for x in lines[start + 7:start + 9]}
    assert set(parts) == {"mgrpo", "mgrpo-before"} and all(min(v) >= 0 for v in parts.values())


@pytest.mark.slow  # tens of seconds: out of the fast tier
def test_bench_scoring_script_runs():
    """The scoring benchmark's rows: each agent kind, its prompt shared by every row, two timings."""
    r = bench("bench_scoring", "--model-size", "0.1M", "--batches", "3", "--repeat", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [line.split() for line in r.stdout.splitlines()[-2:]]
    assert [row[:2] for row in rows] == [["main", "3"], ["sub", "3"]]
    assert all(int(row[4]) > 250 and float(row[6]) > 0 and float(row[7]) > 0 for row in rows)  # the system prompt, shared


@pytest.mark.skipif(importlib.util.find_spec("bm25s") is None, reason="needs bm25s: pip install bm25s")
def test_bench_retriever_script_runs():
    """The retriever's benchmark: a build, a cache load (no second build) and both latency rows."""
    r = bench("bench_retriever", "--passages", "500", "--queries", "10", "--vocabulary", "2000")
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert sum("indexing 500 passages" in line for line in lines) == 1
    rows = [line.split() for line in lines[-2:]]
    assert [row[0] for row in rows] == ["in-process", "over"] and all(float(row[-2]) > 0 for row in rows)
