"""Beam groups in the scheduler without a model: a fake runner keeps a fake KV cache (the token
each slot holds), applies the step's block copies, writes every scheduled token into its slot
and checks that each row reads back exactly its own sequence through its block table -- so
forking, copy-on-write and freeing are checked on content, not only on counts. Its "model" is a
deterministic pseudo-random next-token distribution of the sequence."""
import hashlib
import math

from hypothesis import given, settings, strategies as st

from pagedllm.core.beam_group import BeamGroup
from pagedllm.core.contracts import BeamCandidates, ModelRunnerOutput
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler, SchedulerLimits
from pagedllm.sampling_params import SamplingParams

VOCAB = 13
EOS = 2


def logprobs_of(tokens) -> list[float]:
    h = hashlib.sha256(bytes(str(list(tokens)), "ascii")).digest()
    logits = [h[i] / 32.0 for i in range(VOCAB)]
    m = max(logits)
    z = math.log(sum(math.exp(x - m) for x in logits)) + m
    return [x - z for x in logits]


class FakeRunner:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.cache = [[None] * block_size for _ in range(num_blocks)]
        self.states: dict[str, tuple[list[int], list[int], object]] = {}
        self.num_copies = 0

    def step(self, so) -> ModelRunnerOutput:
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.states.pop(rid, None)
        for src, dst in so.block_copies:
            self.cache[dst] = list(self.cache[src])
            self.num_copies += 1
        for nr in so.scheduled_new_reqs:
            self.states[nr.req_id] = (list(nr.token_ids), list(nr.block_ids), nr.beam, nr.num_computed_tokens)
        for cr in so.scheduled_cached_reqs:
            toks, blocks, beam, _ = self.states[cr.req_id]
            self.states[cr.req_id] = (toks, blocks + list(cr.new_block_ids), beam, cr.num_computed_tokens)
        ids = list(so.num_scheduled_tokens)
        sampled, groups = [], {}
        for rid in ids:
            toks, blocks, beam, start = self.states[rid]
            end = start + so.num_scheduled_tokens[rid]
            for p in range(start, end):
                self.cache[blocks[p // self.bs]][p % self.bs] = toks[p]
            read = [self.cache[blocks[p // self.bs]][p % self.bs] for p in range(end)]
            assert read == toks[:end], f"{rid} reads {read} instead of {toks[:end]}"
            if end < len(toks):
                sampled.append([])
            elif beam is None:
                sampled.append([7])
                toks.append(7)
            else:
                sampled.append([])
                lps = logprobs_of(toks)
                groups.setdefault(beam.group_id, []).extend(
                    (beam.cum_logprob + lp, rid, tok, beam.num_candidates) for tok, lp in enumerate(lps))
            self.states[rid] = (toks, blocks, beam, end)
        cands = {}
        for gid, rows in groups.items():
            rows.sort(key=lambda r: -r[0])  # stable: beam order, then token order on ties
            k = rows[0][3]
            cands[gid] = BeamCandidates([r[1] for r in rows[:k]], [r[2] for r in rows[:k]], [r[0] for r in rows[:k]])
        return ModelRunnerOutput(ids, sampled, beam_candidates=cands)


def run(groups, *, num_blocks=256, block_size=4, budget=64, max_num_seqs=32, caching=True, plain=0, max_tokens=9,
        check_bound=False, chunked=True):
    kv = KVCacheManager(num_blocks, block_size, caching)
    s = Scheduler(SchedulerLimits(max_num_seqs, budget, 512, enable_chunked_prefill=chunked), kv)
    runner = FakeRunner(num_blocks, block_size)
    for g, (prompt, width, lp, es) in enumerate(groups):
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0).with_eos([EOS])
        req = Request(f"g{g}", prompt, sp, max_tokens=max_tokens)
        req.beam = BeamGroup(f"g{g}", width, lp, es)
        s.add_request(req)
    for p in range(plain):
        s.add_request(Request(f"p{p}", [9] * (5 + p), SamplingParams(max_tokens=6, ignore_eos=True), max_tokens=6))
    results, peak = {}, 0
    for _ in range(2000):
        if not s.has_unfinished_requests():
            break
        so = s.schedule()
        out = runner.step(so)
        for o in s.update_from_output(so, out):
            if o.beam_hypotheses is not None:
                results[o.req_id] = [(h.token_ids, round(h.score, 9), h.finish_reason) for h in o.beam_hypotheses]
        kv.pool.check_consistency()
        used = kv.num_total_blocks - kv.num_free_blocks
        peak = max(peak, used)
        if check_bound:  # prompt blocks + width x (generated blocks + 1), for one group alone
            (prompt, width, _, _), = groups
            gen = max((r.num_output_tokens for r in s.running), default=0)
            assert used <= -(-len(prompt) // block_size) + width * (-(-gen // block_size) + 1), (used, gen)
    assert not s.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_total_blocks, "leaked blocks"
    assert not s.requests and not s.beam_groups
    return results, peak, runner.num_copies, s.num_preemptions


PROMPTS = [[1, 5, 9, 3, 11, 4, 6], [1, 8], [1, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3]]


def test_beams_fork_share_and_copy_on_write():
    ref, peak, copies, _ = run([(PROMPTS[0], 4, 1.0, False)], block_size=4, check_bound=True)
    hyps = ref["g0"]
    assert len(hyps) == 4 and [h[1] for h in hyps] == sorted((h[1] for h in hyps), reverse=True)
    assert copies > 0  # beams diverged inside partly filled blocks
    # W independent sequences would hold W x (7 + 9) / 4 = 16 blocks; sharing holds far fewer
    assert peak <= 2 + 4 * 3
    one, _, _, _ = run([(PROMPTS[0], 1, 1.0, False)], block_size=4)
    greedy = [PROMPTS[0]]
    while len(greedy[0]) - len(PROMPTS[0]) < 9:
        lps = logprobs_of(greedy[0])
        tok = max(range(VOCAB), key=lambda t: lps[t])
        greedy[0] = greedy[0] + [tok]
        if tok == EOS:
            break
    assert one["g0"][0][0] == greedy[0][len(PROMPTS[0]):]  # width 1 is greedy


def test_block_size_one_never_copies():
    ref, _, _, _ = run([(PROMPTS[0], 4, 1.0, False)], block_size=4)
    got, _, copies, _ = run([(PROMPTS[0], 4, 1.0, False)], block_size=1, num_blocks=512)
    assert copies == 0 and got == ref


@settings(max_examples=25, deadline=None)
@given(
    widths=st.lists(st.sampled_from([1, 2, 3, 4]), min_size=1, max_size=3),
    block_size=st.sampled_from([1, 2, 4, 16]),
    num_blocks=st.integers(24, 80),
    budget=st.integers(8, 40),
    caching=st.booleans(),
    plain=st.integers(0, 2),
    lp=st.sampled_from([1.0, 0.0, 2.0, -0.5]),
    es=st.sampled_from([False, True, "never"]),
)
def test_any_pressure_same_results_no_leaks(widths, block_size, num_blocks, budget, caching, plain, lp, es):
    groups = [(PROMPTS[i % 3], w, lp, es) for i, w in enumerate(widths)]
    ref, _, _, _ = run(groups, num_blocks=4096, block_size=16, budget=4096, caching=False)
    got, _, _, _ = run(groups, num_blocks=max(num_blocks // block_size * 4, 8 * max(widths)), block_size=block_size,
                       budget=max(budget, 2 * max(widths) * 3), caching=caching, plain=plain, max_num_seqs=16)
    assert got == ref


def test_preemption_of_a_whole_group_then_same_results():
    groups = [(PROMPTS[0], 4, 1.0, False), (PROMPTS[2], 4, 1.0, False), (PROMPTS[1], 3, 1.0, False)]
    ref, _, _, pre = run(groups, num_blocks=512, max_tokens=20)
    assert pre == 0
    got, _, _, pre = run(groups, num_blocks=36, block_size=4, budget=64, max_tokens=20)
    assert pre > 0 and got == ref
    # without chunked prefill a preempted group's beams catch up whole, one step each if need be
    got, _, _, pre = run(groups, num_blocks=36, block_size=4, budget=40, max_tokens=20, chunked=False)
    assert pre > 0 and got == ref
    got, _, _, pre = run(groups, num_blocks=36, block_size=4, budget=40, max_tokens=20, chunked=False, caching=False)
    assert pre > 0 and got == ref  # no prefix-cache hits: 4 beams of ~35 tokens share a 40-token budget


def test_abort_frees_every_beam():
    kv = KVCacheManager(64, 4, True)
    s = Scheduler(SchedulerLimits(16, 64, 512), kv)
    runner = FakeRunner(64, 4)
    req = Request("g", PROMPTS[0], SamplingParams(max_tokens=20).with_eos([EOS]), max_tokens=20)
    req.beam = BeamGroup("g", 3, 1.0, False)
    s.add_request(req)
    for _ in range(4):
        so = s.schedule()
        s.update_from_output(so, runner.step(so))
    assert len(s.running) == 3 and kv.num_free_blocks < 64
    assert s.finish_requests(["g"], s.requests[s.running[0].request_id].status.FINISHED_ABORTED) == ["g"]
    assert kv.num_free_blocks == 64 and not s.running and not s.requests and not s.beam_groups
