"""The n-gram proposer: the continuation of the most recent earlier occurrence of the longest
suffix n-gram; a match of n tokens drafts at most 2n, a loop shorter than that repeats to fill them; nothing when no n-gram recurs."""
from pagedllm.spec_decode.ngram import NgramProposer


def test_longest_suffix_then_most_recent_occurrence():
    p = NgramProposer(3, 1, 3)
    seq = [1, 2, 3, 9, 9, 2, 3, 8, 8, 8, 1, 2, 3]
    # the trigram (1, 2, 3) occurred at the start, followed by 9 9 2; the bigram (2, 3) more recently by 8 8 8
    assert p.propose_one("a", seq, 3) == [9, 9, 2]
    assert NgramProposer(3, 1, 2).propose_one("b", seq, 3) == [8, 8, 8]


def test_short_loop_fills_the_slots_a_match_earns():
    p = NgramProposer(7, 2, 3)
    assert p.propose_one("a", [7, 1, 2, 3, 1, 2, 3], 7) == [1, 2, 3, 1, 2, 3]  # period 3, a 3-token match: 6
    assert p.propose_one("b", [5, 1, 2, 1, 2], 7) == [1, 2, 1, 2]  # period 2, a 2-token match: 4
    assert p.propose_one("c", [4, 4, 4], 3) == [4, 4, 4]  # period 1


def test_a_match_of_n_tokens_drafts_at_most_2n():
    seq = [1, 2, 3, 4, 5, 6, 7, 8, 9, 3]  # only the unigram (3) recurs
    assert NgramProposer(8, 1, 3).propose_one("a", seq, 8) == [4, 5]
    seq = [1, 2, 3, 4, 5, 6, 7, 8, 9, 2, 3]  # the bigram (2, 3) recurs
    assert NgramProposer(8, 1, 3).propose_one("b", seq, 8) == [4, 5, 6, 7]


def test_incremental_index_and_no_match():
    p = NgramProposer(4, 2, 4)
    seq = [1, 2, 3, 4, 5]
    assert p.propose_one("a", seq, 4) == []
    seq += [1, 2]  # appended since the last step: indexed incrementally
    assert p.propose_one("a", seq, 4) == [3, 4, 5, 1]
    assert p.propose({"a": seq}, {"a": 2}) == {"a": [3, 4]}
