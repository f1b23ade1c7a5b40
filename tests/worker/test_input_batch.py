"""The runner's persistent batch (worker/input_batch.py): the BlockTable kept across steps equals
the per-step rebuild it replaced (each request's ids, zero-padded to the longest) after any
sequence of joins, appends, dropped draft tails and leaves, growing past its first size; and the
plain-greedy rows decided once build the same sampling metadata as the full builder."""
import dataclasses

import numpy as np
import torch
from hypothesis import given, settings, strategies as st

from pagedllm.sample.metadata import build_sampling_metadata, greedy_metadata, is_plain_greedy
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.input_batch import BlockTable, InputBatch

ops = st.lists(st.tuples(st.sampled_from(["add", "append", "drop", "remove", "append_one"]), st.integers(0, 40),
                         st.lists(st.integers(1, 999), max_size=9)), max_size=80)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_block_table_matches_a_rebuilt_table(script):
    table = BlockTable(num_rows=2, width=2)  # small: rows and width grow
    held: dict[int, list[int]] = {}  # row -> ids (the model)
    for op, pick, ids in script:
        rows = sorted(held)
        if op == "add" or not rows:
            held[table.add(ids)] = list(ids)
            continue
        row = rows[pick % len(rows)]
        if op == "append":
            table.append(row, ids)
            held[row] += ids
        elif op == "append_one":  # one id each for a subset of the rows (a step's block boundaries)
            chosen = rows[pick % len(rows)::2]
            table.append_one(np.array(chosen, dtype=np.int64), np.array([500 + r for r in chosen], dtype=np.int32))
            for r in chosen:
                held[r].append(500 + r)
        elif op == "drop":
            n = pick % (len(held[row]) + 1)
            table.append(row, ids, num_dropped=n)
            held[row] = held[row][:len(held[row]) - n] + ids
        else:
            table.remove(row)
            del held[row]
        assert len(set(held)) == len(held)
    for row, ids in held.items():
        assert table.row_ids(row) == ids
    if held:
        rows = np.array(sorted(held), dtype=np.int64)
        width = max(len(held[r]) for r in rows)
        expect = np.zeros((len(rows), width), dtype=np.int32)
        for i, r in enumerate(rows):
            expect[i, :len(held[r])] = held[r]
        got = table.gather(rows)
        assert got.dtype == np.int32 and got.shape[0] == len(rows) and (got[:, :width] == expect).all()
        assert not got[:, width:].any()


def test_rows_are_reused_and_flags_follow_them():
    batch = InputBatch(num_rows=1)
    a = batch.add([1, 2], plain_greedy=True)
    b = batch.add([3], plain_greedy=False)  # grows
    assert batch.plain_greedy[a] and not batch.plain_greedy[b]
    batch.remove(a)
    c = batch.add([4], plain_greedy=False)
    assert c == a and not batch.plain_greedy[c] and batch.block_table.row_ids(c) == [4]


class _Row:
    def __init__(self, sp, tokens):
        self.sampling_params, self.token_ids, self.num_prompt_tokens = sp, tokens, 3
        self.generator, self.prompt_unique_ids = None, None

    @property
    def num_output_tokens(self):
        return len(self.token_ids) - self.num_prompt_tokens


PLAIN = [SamplingParams(temperature=0), SamplingParams(temperature=0, max_tokens=3, stop=["x"], seed=4),
         SamplingParams(temperature=0, top_k=5, top_p=0.5, ignore_eos=True)]
NOT_PLAIN = [SamplingParams(), SamplingParams(temperature=0, logprobs=2), SamplingParams(temperature=0, min_tokens=2),
             SamplingParams(temperature=0, logit_bias={1: 2.0}), SamplingParams(temperature=0, presence_penalty=0.5),
             SamplingParams(temperature=0, allowed_token_ids=[1, 2]), SamplingParams(temperature=0, bad_words=["a"])]


def test_plain_greedy_rows_build_the_greedy_metadata():
    assert all(is_plain_greedy(sp) for sp in PLAIN)
    assert not any(is_plain_greedy(sp) for sp in NOT_PLAIN)
    rows = [_Row(sp.with_eos([2]), [5, 6, 7, 8]) for sp in PLAIN]
    full = build_sampling_metadata(rows, 64, torch.device("cpu"))
    assert dataclasses.asdict(full) == dataclasses.asdict(greedy_metadata())


token_ops = st.lists(st.tuples(st.sampled_from(["add", "append", "sampled", "draft", "remove"]), st.integers(0, 40),
                               st.lists(st.integers(0, 2 ** 31 - 1), max_size=12)), max_size=30)


@settings(max_examples=40, deadline=None)
@given(token_ops)
def test_token_rows_mirror_the_request_lists(script):
    """The token rows a step's input ids are gathered from hold exactly each request's tokens
    (prompt, appended ids, one sampled id per row at a time), growing past their first size;
    drafts written beyond a row's tokens are read by the gather but never counted."""
    batch = InputBatch(num_rows=1, width=2)
    held: dict[int, list[int]] = {}
    for op, pick, ids in script:
        rows = sorted(held)
        if op == "add" or not rows:
            held[batch.add([1], plain_greedy=False, token_ids=ids)] = list(ids)
            continue
        row = rows[pick % len(rows)]
        if op == "append":
            batch.append_tokens(row, ids)
            held[row] += ids
        elif op == "sampled":  # one id for each of several distinct rows at once
            some = rows[: 1 + pick % len(rows)]
            toks = [(pick * 7 + r) % 1000 for r in some]
            batch.append_sampled(np.array(some, dtype=np.int64), np.array(toks, dtype=np.int32))
            for r, t in zip(some, toks):
                held[r].append(t)
        elif op == "draft":
            batch.write_tokens(row, len(held[row]), ids)
            n = len(held[row])
            assert batch.token_ids[row, n:n + len(ids)].tolist() == ids
        else:
            batch.remove(row)
            del held[row]
    for row, toks in held.items():
        assert batch.num_tokens[row] == len(toks)
        assert batch.token_ids[row, :len(toks)].tolist() == toks
