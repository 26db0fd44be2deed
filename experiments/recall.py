"""The search tool's ceiling on a question file's multi-hop questions: for each hop, asked once as its
own sub-question with the answers before it filled in (the gold wording, as the cold start's demos
delegate it), whether the passages the retriever returns hold that hop's answer as whole words, in
a title or a text. No model runs: this is what a searcher that asks each gold sub-question once and
reads its results perfectly could bring back. An agent can do more (search again in other words,
visit a passage, answer from what it knows), so it is not a bound on a system's success.

    python -m experiments.recall data/geo/questions.jsonl data/geo/corpus.jsonl [--first 32]

It prints, per hop, how many sub-questions' results hold the answer; how many questions' every hop's
do; with --first, the numbers of the questions that miss a hop (as experiments/hops.py numbers the
evaluation's); and the sub-questions missed most often, as they were asked.
"""
import argparse
import collections

from qa_task import QaTask, filled, holds_words
from retriever import MAX_TOPK, TOPK, Bm25Search, passage_result
from tools import EVAL_SEED


def count(low, high):
    """An argparse type: an integer from low to high, else one line that says so."""
    def parse(text):
        if not (text.lstrip("-").isdigit() and low <= int(text) <= high):
            raise argparse.ArgumentTypeError(f"must be an integer from {low} to {high}, got {text!r}")
        return int(text)
    return parse


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("questions", help="a question file whose questions carry question_decomposition")
    p.add_argument("corpus", help="the corpus the search tool reads (bm25)")
    p.add_argument("--split", choices=["test", "train"], default="test", help="which questions (default: test)")
    p.add_argument("--k", type=count(1, MAX_TOPK), default=TOPK, help=f"passages a search (default: the tool's {TOPK})")
    p.add_argument("--first", type=count(1, 10 ** 6), default=None, metavar="N",
                   help="the questions mgrpo.py evaluates with --eval-questions N: the split's first N in the file's "
                        "order, from its start again past its end (default: the whole split, once)")
    a = p.parse_args(argv)
    try:
        task = QaTask(a.questions)
        first, pool = (EVAL_SEED, task.test) if a.split == "test" else (0, task.train)  # as make_question picks
        questions = [q for q in (task.make_question(first + i, 1) for i in range(a.first or len(pool))) if q.hops]
        if not questions:
            raise ValueError(f"{a.questions}: no {a.split} question carries question_decomposition")
        search = Bm25Search(a.corpus)
    except (OSError, ValueError, ImportError) as e:
        raise SystemExit(str(e)) from None
    found, asked, whole, missed = collections.Counter(), collections.Counter(), 0, collections.Counter()
    short = []  # the numbers, from 1, of the questions with a hop not found
    for q in questions:
        every = True
        for k, (sub_q, answer) in enumerate(q.hops):
            text = filled(sub_q, [ans for _, ans in q.hops[:k]])
            results = [passage_result(search.ids[n], search.contents[n]) for n, _ in search.retrieve(text, a.k)]
            ok = holds_words(answer, (r["title"] + " " + r["content"] for r in results))
            asked[k + 1] += 1
            found[k + 1] += ok
            every &= ok
            if not ok:
                missed[text] += 1
        whole += every
        if not every:
            short.append(q.seed - first + 1)
    print(f"{len(questions)} {a.split} questions with hops; top {a.k} passages a search")
    for h in sorted(asked):
        print(f"  hop {h}: the results hold the answer for {found[h]} of {asked[h]} ({found[h] / asked[h]:.3f})")
    print(f"  every hop's: {whole} of {len(questions)} ({whole / len(questions):.3f})")
    if missed and a.first:
        print(f"  the questions with a hop not found, by their number in the evaluation: {', '.join(map(str, short))}")
    if missed:
        print("missed most often: " + "; ".join(f"{t!r} x{n}" for t, n in missed.most_common(8)))


if __name__ == "__main__":
    main()
