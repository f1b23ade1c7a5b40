"""The governor keeps speculating while it pays and decodes plainly when the measured costs say
speculation loses, per batch-size bucket (synthetic clocks: deterministic); the scheduler follows
it: a plain step reserves no draft slots (seeded requests excepted) and its outputs are the
same."""
from pagedllm.core.contracts import ModelRunnerOutput
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler, SchedulerLimits
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.governor import SpecGovernor, bucket_of


def drive(gov, steps, t_spec, t_plain, tokens, batch=1, now=0.0, drafts=3):
    """Steps of ``batch`` decoding requests; a speculative one takes t_spec and emits ``tokens``
    per request. Returns (modes, the clock)."""
    modes = []
    for _ in range(steps):
        spec = gov.plan(batch, now)
        gov.scheduled(spec)
        modes.append(spec)
        now += t_spec if spec else t_plain
        gov.verified(tokens if spec else 1.0, drafts if spec else 0, now)
    return modes, now


def test_keeps_speculating_when_it_pays():
    gov = SpecGovernor(window=10, probe=2)
    modes, _ = drive(gov, 200, t_spec=1.5, t_plain=1.0, tokens=3.0)  # 2 tokens/unit vs 1
    assert gov.speculation_pays(1)
    assert sum(modes[4:]) >= 0.9 * 196  # confirmed windows grow: fewer and fewer plain probes
    assert gov.buckets[0].window > 10


def test_stops_when_it_loses():
    gov = SpecGovernor(window=10, probe=2)
    modes, _ = drive(gov, 200, t_spec=3.0, t_plain=1.0, tokens=1.5)  # 0.5 tokens/unit vs 1
    assert not gov.speculation_pays(1)
    assert sum(modes[4:]) <= 0.1 * 196  # only the probes speculate
    assert gov.num_plain_steps >= 180 and gov.disabled_buckets() == [(1, 1)]


def test_switches_off_above_the_batch_size_where_it_loses():
    """Batch 1 gains, batch 32 loses: each bucket decides on its own."""
    gov = SpecGovernor(window=10, probe=2)
    now = 0.0
    for _ in range(10):
        m1, now = drive(gov, 20, t_spec=1.2, t_plain=1.0, tokens=3.0, batch=1, now=now)
        m32, now = drive(gov, 20, t_spec=40.0, t_plain=20.0, tokens=1.5, batch=32, now=now)
    assert gov.speculation_pays(1) and not gov.speculation_pays(32) and not gov.speculation_pays(40)
    assert gov.disabled_buckets() == [(32, 63)]
    assert sum(m1) >= 18 and sum(m32) <= 2
    assert bucket_of(1) == 0 and bucket_of(3) == 1 and bucket_of(32) == bucket_of(63) == 5


def test_unmeasurable_steps_and_idle_gaps_are_not_measured():
    gov = SpecGovernor(window=100, probe=2)
    gov.plan(1, 0.0)
    gov.scheduled(None)  # a prefill step: not a speculative step's cost
    gov.verified(1.0, 0, 50.0)
    gov.plan(1, 50.0)
    gov.scheduled(True)
    gov.verified(3.0, 3, 51.0)  # busy 1 ...
    gov.plan(1, 500.0)  # ... then idle: the engine had nothing to do
    assert gov.buckets[0].t_spec is None and gov.buckets[0].n_spec == 0


def test_catch_up_steps_after_plain_stretches_are_not_charged_to_speculation():
    """A draft model / EAGLE head runs over every position it missed in the first speculative
    step after plain ones (a probe): that step's cost is left out, or each probe would look
    worse than steady speculation and keep a winning proposer off."""
    gov = SpecGovernor(window=8, probe=2)
    now, modes, last = 0.0, [], False
    for _ in range(300):
        spec = gov.plan(1, now)
        gov.scheduled(spec)
        modes.append(spec)
        # steady speculation: 1.5 per step for 3 tokens (2 per unit vs plain's 1); a catch-up costs 10
        now += (1.5 if last else 10.0) if spec else 1.0
        gov.verified(3.0 if spec else 1.0, 3 if spec else 0, now)
        last = spec
    assert gov.speculation_pays(1) and sum(modes[-100:]) >= 90
    b = gov.buckets[0]
    assert b.t_spec == 1.5 and b.unmeasured == 0


def test_draftless_speculative_steps_stand_in_for_plain_probes():
    """An n-gram step without any draft cost what a plain step costs: no plain probe is needed."""
    gov = SpecGovernor(window=8, probe=2)
    now = 0.0
    for i in range(100):
        spec = gov.plan(1, now)
        gov.scheduled(spec)
        now += 1.2 if spec else 1.0
        gov.verified(3.0, 0 if i % 3 == 0 else 3, now)  # every third step finds no n-gram
    assert gov.buckets[0].n_plain >= 30 and gov.num_plain_steps <= 2  # plain only while learning


# ---- the scheduler follows the governor ----------------------------------------------------
class Scripted:
    """A governor stand-in whose plan is a fixed script (True: speculate)."""

    def __init__(self, script):
        self.script, self.calls, self.marked = list(script), 0, []

    def plan(self, batch_size):
        self.calls += 1
        return self.script[(self.calls - 1) % len(self.script)]

    def scheduled(self, speculated):
        self.marked.append(speculated)

    def verified(self, tokens, num_drafts):
        pass


def make(governor, k=3):
    kv = KVCacheManager(64, 4, True)
    s = Scheduler(SchedulerLimits(8, 64, 256, num_spec_tokens=k), kv)
    s.spec_governor = governor
    return s, kv


def step(s, accept=0):
    """Schedule one step; every sampling request emits 1 + min(accept, its slots) tokens (7s)."""
    so = s.schedule()
    ids = list(so.num_scheduled_tokens)
    sampled, drafts = [], []
    for r in ids:
        req = s.requests[r]
        done = req.num_computed_tokens >= req.num_tokens + so.num_spec_slots.get(r, 0)
        n = so.num_spec_slots.get(r, 0)
        sampled.append([7] * (1 + min(accept, n)) if done else [])
        drafts.append(n)
    s.update_from_output(so, ModelRunnerOutput(ids, sampled, num_draft_tokens=drafts))
    return so


def test_plain_steps_reserve_no_draft_slots():
    s, kv = make(Scripted([False]))
    for r in ("a", "b"):
        s.add_request(Request(r, list(range(10)), SamplingParams(max_tokens=12, ignore_eos=True), max_tokens=12))
    step(s)  # prefill
    free = kv.num_free_blocks
    for _ in range(5):
        so = step(s)
        assert so.num_spec_slots == {} and set(so.num_scheduled_tokens.values()) == {1}
    assert kv.num_free_blocks >= free - 2  # 5 tokens each: at most a new block each, no draft blocks
    assert s.spec_governor.marked[0] is None and s.spec_governor.marked[1:] == [False] * 5
    assert s.spec_stats == [0, 0, 0]


def test_seeded_requests_keep_speculating_in_plain_steps():
    s, _ = make(Scripted([False]))
    s.add_request(Request("seeded", list(range(10)), SamplingParams(max_tokens=12, seed=3, temperature=1.0),
                          max_tokens=12))
    s.add_request(Request("free", list(range(10)), SamplingParams(max_tokens=12, temperature=1.0), max_tokens=12))
    step(s)
    so = step(s)
    assert so.num_spec_slots == {"seeded": 3} and so.num_scheduled_tokens == {"seeded": 4, "free": 1}
    assert s.spec_governor.marked[-1] is None  # a mix: neither mode's cost


def test_toggling_modes_mid_request_keeps_counts_exact():
    s, kv = make(Scripted([True, True, False, True, False, False]))
    s.add_request(Request("a", list(range(10)), SamplingParams(max_tokens=30, ignore_eos=True), max_tokens=30))
    req = s.requests["a"]
    step(s)
    while s.has_unfinished_requests():
        step(s, accept=2)
    assert req.num_output_tokens == 30 and kv.num_free_blocks == 64  # max_tokens exact, nothing leaked
    assert s.spec_stats[0] > 0 and s.spec_stats[2] == 2 * s.spec_stats[0]


def test_no_drafts_from_the_disable_batch_size_on_with_a_cpu_default():
    from types import SimpleNamespace

    from pagedllm.config import SpeculativeConfig
    from pagedllm.spec_decode.governor import CPU_DISABLE_BATCH_SIZE, scheduler_settings

    def _spec_limits(config):
        return scheduler_settings(config)[0]

    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    limits = _spec_limits(SimpleNamespace(speculative_config=spec, device="cpu"))
    assert limits["spec_disable_batch_size"] == CPU_DISABLE_BATCH_SIZE
    always = SpeculativeConfig(method="ngram", num_speculative_tokens=3, auto_disable=False)
    assert _spec_limits(SimpleNamespace(speculative_config=always, device="cpu"))["spec_disable_batch_size"] == 0
    spec5 = SpeculativeConfig(method="ngram", num_speculative_tokens=3, disable_by_batch_size=5)
    assert _spec_limits(SimpleNamespace(speculative_config=spec5, device="cpu"))["spec_disable_batch_size"] == 5

    kv = KVCacheManager(256, 4, True)
    s = Scheduler(SchedulerLimits(32, 512, 256, num_spec_tokens=3, spec_disable_batch_size=4), kv)
    for i in range(4):
        s.add_request(Request(f"r{i}", list(range(10)), SamplingParams(max_tokens=5, ignore_eos=True), max_tokens=5))
    step(s)
    assert step(s).num_spec_slots == {}  # 4 running: no drafts
    s.finish_requests(["r0"], RequestStatus.FINISHED_ABORTED)
    assert len(step(s).num_spec_slots) == 3  # 3 running: drafts again


def test_scheduler_with_a_real_governor_on_a_fake_clock_stops_reserving():
    """The governor itself (clock injected): speculative steps that take 3x a plain one for 1.5
    tokens lose, so after its learning steps the scheduler reserves no draft slots."""
    clock = [0.0]
    gov = SpecGovernor(window=4, probe=2, clock=lambda: clock[0])
    s, kv = make(gov)
    s.add_request(Request("a", list(range(10)), SamplingParams(max_tokens=200, ignore_eos=True), max_tokens=200))
    step(s)
    slots = []
    for i in range(60):
        so = s.schedule()
        (rid,) = so.num_scheduled_tokens
        n = so.num_spec_slots.get(rid, 0)
        slots.append(n)
        clock[0] += 3.0 if n else 1.0
        out = ModelRunnerOutput([rid], [[7] * (1 + (i % 2 if n else 0))], num_draft_tokens=[n])  # 1.5 tokens
        s.update_from_output(so, out)
    assert not gov.speculation_pays(1)
    assert sum(1 for n in slots[10:] if n) <= 2 * 50 // (4 + 2)  # only probes speculate ...
    assert slots.count(0) >= 40  # ... the plain steps reserve nothing
