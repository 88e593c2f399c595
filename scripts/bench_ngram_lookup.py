"""The host's n-gram lookup (`ngram.ngram_propose`) against its numpy one-pass search, per call, on three sequences.

    python scripts/bench_ngram_lookup.py

"copy": 230 tokens whose last 80 repeat earlier ones (a copy task: the newest token occurs once before);
"no match": the same and then a token never seen (the lookup finds nothing); "frequent": 2002 tokens of two
alternating values (the newest token occurs ~1000 times: the lookup hands over to the one-pass search). Prints
the least time per call over 7 repeats of 300 calls, and whether both give the same proposals.
"""

from __future__ import annotations

import random
import timeit

from jaxserve.spec_decode import ngram


def main() -> None:
    random.seed(0)
    copy = [random.randrange(4096) for _ in range(150)]
    copy += copy[20:100]
    cases = {"copy": copy, "no match": copy + [5000], "frequent": [1, 2] * 1000 + [3, 1]}
    for name, tokens in cases.items():
        def lookup(t=tokens) -> list[int]:
            return ngram.ngram_propose(t, 4, 1, 4)

        def one_pass(t=tokens) -> list[int]:
            return ngram._propose_in_one_pass(t[-ngram.SEARCH_WINDOW:], 4, 1, min(4, len(t) - 1))

        a, b = (min(timeit.repeat(f, number=300, repeat=7)) / 300 for f in (lookup, one_pass))
        print(f"{name:9s} lookup {a * 1e6:6.1f} us  one pass {b * 1e6:6.1f} us  ({a / b:.2f}x)  "
              f"same proposals: {lookup() == one_pass()}")


if __name__ == "__main__":
    main()
