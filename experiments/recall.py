"""The search tool's ceiling on a question file's multi-hop questions: for each hop, asked as its own
sub-question with the answers before it filled in (as the cold start's demos delegate it), whether
the retriever's results hold that hop's answer as whole words. No model runs: this is what a searcher
that asks exactly the gold sub-questions, and reads its results perfectly, could bring back.

    python -m experiments.recall data/geo/questions.jsonl data/geo/corpus.jsonl [--first 32]

It prints, per hop, the share of sub-questions whose results hold the answer; the share of questions
whose every hop's do (a bound on exact match for such a searcher); and the sub-questions missed most
often, by their first words and the entity asked about.
"""
import argparse
import collections

from qa_task import filled, normalize, read_questions
from retriever import TOPK, Bm25Search, passage_result


def holds(answer, results):
    a = normalize(answer)
    return bool(a) and any(f" {a} " in f" {normalize(r['content'])} " for r in results)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("questions", help="a question file whose questions carry question_decomposition")
    p.add_argument("corpus", help="the corpus the search tool reads (bm25)")
    p.add_argument("--split", choices=["test", "train"], default="test", help="which questions (default: test)")
    p.add_argument("--k", type=int, default=TOPK, choices=range(1, 101), metavar="K", help=f"passages per search (default: the tool's {TOPK})")
    p.add_argument("--first", type=int, default=None, metavar="N",
                   help="only the split's first N questions, in the file's order: mgrpo.py evaluates the test split's "
                        "first --eval-questions (default: all)")
    a = p.parse_args(argv)
    try:
        train, test = read_questions(a.questions)
    except (OSError, ValueError) as e:
        raise SystemExit(str(e)) from None
    questions = [q for q in (test if a.split == "test" else train)[:a.first] if q[3]]
    if not questions:
        raise SystemExit(f"{a.questions}: no {a.split} question carries question_decomposition")
    search = Bm25Search(a.corpus)
    found, asked, whole, missed = collections.Counter(), collections.Counter(), 0, collections.Counter()
    for _, _, _, hops in questions:
        every = True
        for k, (sub_q, answer) in enumerate(hops):
            text = filled(sub_q, [ans for _, ans in hops[:k]])
            results = [passage_result(search.ids[n], search.contents[n]) for n, _ in search.retrieve(text, a.k)]
            ok = holds(answer, results)
            asked[k + 1] += 1
            found[k + 1] += ok
            every &= ok
            if not ok:
                missed[text] += 1
        whole += every
    print(f"{len(questions)} {a.split} questions with hops; top {a.k} passages a search")
    for h in sorted(asked):
        print(f"  hop {h}: the results hold the answer for {found[h]} of {asked[h]} ({found[h] / asked[h]:.3f})")
    print(f"  every hop's: {whole} of {len(questions)} ({whole / len(questions):.3f})")
    if missed:
        print("missed most often: " + "; ".join(f"{t!r} x{n}" for t, n in missed.most_common(8)))


if __name__ == "__main__":
    main()
