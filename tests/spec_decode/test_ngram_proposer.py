"""The n-gram proposer: the continuation of the most recent earlier occurrence of the longest
suffix n-gram; a loop shorter than k repeats to fill the slots; nothing when no n-gram recurs."""
from pagedllm.spec_decode.ngram import NgramProposer


def test_longest_suffix_then_most_recent_occurrence():
    p = NgramProposer(3, 1, 3)
    seq = [1, 2, 3, 9, 9, 2, 3, 8, 8, 8, 1, 2, 3]
    # the trigram (1, 2, 3) occurred at the start, followed by 9 9 2; the bigram (2, 3) more recently by 8 8 8
    assert p.propose_one("a", seq, 3) == [9, 9, 2]
    assert NgramProposer(3, 1, 2).propose_one("b", seq, 3) == [8, 8, 8]


def test_short_loop_fills_all_slots():
    p = NgramProposer(7, 2, 3)
    assert p.propose_one("a", [5, 1, 2, 1, 2], 7) == [1, 2, 1, 2, 1, 2, 1]  # period 2
    assert p.propose_one("b", [4, 4, 4], 5) == [4, 4, 4, 4, 4]  # period 1


def test_incremental_index_and_no_match():
    p = NgramProposer(4, 2, 4)
    seq = [1, 2, 3, 4, 5]
    assert p.propose_one("a", seq, 4) == []
    seq += [1, 2]  # appended since the last step: indexed incrementally
    assert p.propose_one("a", seq, 4) == [3, 4, 5, 1]
    assert p.propose({"a": seq}, {"a": 2}) == {"a": [3, 4]}
