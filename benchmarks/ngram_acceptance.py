"""How many tokens prompt lookup would get accepted per step, on real greedy answers.

    .venv/bin/python benchmarks/ngram_acceptance.py --model qwen2.5-coder-1.5b --tokens 160

Generates greedy answers with rill's runner (``--weights auto``) to two loads of chat prompts:
**code edits**, which quote the code they are given back with changes, and **chat**, which
quote nothing. Then it replays each answer through ``rill.engine.ngram.NgramProposer`` as a
speculative decoder with greedy verification would: at each step the proposer drafts up to
``k`` tokens from the context so far, the longest prefix equal to the real continuation is
accepted, plus the target model's own next token. It prints, per load and per ``k``, the draft
tokens accepted over those proposed and the tokens made per target forward (1.0 without
speculation). Greedy verification keeps the answer identical, so the answer generated once
stands for every ``k``. Nothing here is timed: the cost of a verification forward against a
one-token step is what a speculative engine's own benchmark must show.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_quality import generate  # benchmarks/ is not a package

from rill.engine.ngram import NgramProposer
from rill.models.loader import load_model

_CODE = """def average(values):
    total = 0
    for v in values:
        total = total + v
    return total / len(values)


def largest(values):
    best = values[0]
    for v in values:
        if v > best:
            best = v
    return best
"""

LOADS = {
    "code edits": [
        f"Rename the variable `v` to `value` everywhere in this code and show the whole code:\n\n{_CODE}",
        f"Add a docstring to each function in this code and show the whole code:\n\n{_CODE}",
        f"Add type hints (list[float] -> float) to both functions and show the whole code:\n\n{_CODE}",
        f"Make `average` return 0.0 for an empty list and show the whole code:\n\n{_CODE}",
    ],
    "chat": [
        "Explain what a hash map is in three sentences.",
        "Write a short poem about the sea.",
        "What are the main differences between TCP and UDP?",
        "Give me three tips for writing clear emails.",
    ],
}


def replay(prompt: list[int], answer: list[int], k: int, min_n: int, max_n: int) -> tuple[int, int, int]:
    """(draft tokens proposed, draft tokens accepted, target forwards) for one answer."""
    proposer = NgramProposer(k=k, min_n=min_n, max_n=max_n)
    proposer.extend(prompt)
    proposed = accepted = forwards = 0
    done = 0
    while done < len(answer):
        draft = proposer.propose()
        good = 0
        while good < len(draft) and done + good < len(answer) and draft[good] == answer[done + good]:
            good += 1
        step = min(good + 1, len(answer) - done)  # the accepted drafts and the target's own token
        proposed, accepted, forwards = proposed + len(draft), accepted + good, forwards + 1
        proposer.extend(answer[done : done + step])
        done += step
    return proposed, accepted, forwards


def main(argv: list[str] | None = None) -> int:
    """Generate the answers once, replay them for each k, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a .gguf file, a folder or a catalog name (rill models)")
    parser.add_argument("--tokens", type=int, default=160, help="greedy tokens per answer (default: 160)")
    parser.add_argument("--k", default="2,4,6,8", help="draft lengths to replay (default: 2,4,6,8)")
    parser.add_argument("--min-n", type=int, default=1)
    parser.add_argument("--max-n", type=int, default=4)
    args = parser.parse_args(argv)
    from rill.models.catalog import resolve

    loaded = load_model(resolve(args.model) or Path(args.model), weights="auto")
    tokenizer = loaded.tokenizer
    print(f"{args.model}: {args.tokens} greedy tokens per answer, n-grams {args.min_n}..{args.max_n}")
    print("| load | k | drafts accepted / proposed | tokens per target forward |\n|---|---|---|---|")
    for load, questions in LOADS.items():
        prompts = [tokenizer.encode_chat([{"role": "user", "content": q}]) for q in questions]
        answers = generate(loaded, prompts, args.tokens)
        for k in (int(x) for x in args.k.split(",")):
            totals = [replay(p, a, k, args.min_n, args.max_n) for p, a in zip(prompts, answers)]
            proposed, accepted, forwards = (sum(t[i] for t in totals) for i in range(3))
            made = sum(len(a) for a in answers)
            print(
                f"| {load} | {k} | {accepted}/{proposed} ({100 * accepted / max(proposed, 1):.0f} %) "
                f"| {made / forwards:.2f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
