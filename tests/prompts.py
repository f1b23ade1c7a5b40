"""Fixed-seed random token-id prompts for tests. A module of its own (not conftest): a test
directory with its own conftest.py shadows the name ``conftest`` for every directory collected
after it, so shared helpers are imported from here."""
from __future__ import annotations

import random


def random_prompts(lengths, vocab=512, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
