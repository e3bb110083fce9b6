"""Prefix caching with every drafter: a request that reuses cached prompt pages sees exactly what it sees without
the cache: its tokens, each step's accepted tokens and every draft the step proposes (so the draft's K/V over
the reused prefix is the one a prefill would have written: a stale one would change the drafts, not the greedy
output). Shared prefixes of page_size - 1, page_size and page_size + 1 tokens and longer, whole-prompt hits, two
identical prompts admitted in the same step, a reused prefix followed by chunked prefill, eviction then a re-hit,
salts; greedy and seeded sampling."""
from __future__ import annotations


import pytest

from tllm_spec import DraftTargetConfig, Eagle3Config, MTPConfig, SAConfig, SamplingParams
from tllm_spec.engine.request import Request
from tllm_spec.spec_model import SpecModel

from ..models import tiny_draft_lm, tiny_pair
from .test_chunked_prefill import mtp_target

PAGE = 4
BASE = [5, 17, 29, 41, 53, 65, 77, 89, 8, 20, 32, 44, 56, 68, 80, 92, 11, 23]  # 18 tokens
# each shares a prefix with BASE of: 3 (page - 1), 4 (page), 5 (page + 1), 9, 12 tokens (its end repeats
# tokens of the reused pages: suffix drafting must see them); then BASE itself
PROMPTS = [BASE[:3] + [7, 7, 7, 9], BASE[:4] + [3, 1], BASE[:5] + [2, 4, 6], BASE[:9] + [1],
           BASE[:12] + BASE[6:10], list(BASE)]
UNRELATED = [96, 95, 94, 93, 92, 91, 90]
GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.9, top_p=0.95, seed=11)


def spec_for(kind: str):
    """(target dir, spec config) of a drafter kind."""
    target, head = tiny_pair("llama")
    specs = {
        "plain": None,
        "eagle3": Eagle3Config(speculative_model=str(head), max_draft_len=3),
        "tree": Eagle3Config(speculative_model=str(head), max_draft_len=2,
                             eagle_choices=[[0], [1], [0, 0], [0, 1], [1, 0]]),
        "dynamic_tree": Eagle3Config(speculative_model=str(head), max_draft_len=3, use_dynamic_tree=True,
                                     dynamic_tree_max_topK=2, max_total_draft_tokens=6),
        "eagle3_sa": Eagle3Config(speculative_model=str(head), max_draft_len=3, use_sa_spec=True,
                                  sa_spec_threshold=2),
        "draft_target": DraftTargetConfig(speculative_model=str(tiny_draft_lm("llama")), max_draft_len=3),
        "sa": SAConfig(max_draft_len=4),
        "mtp_eagle": MTPConfig(num_nextn_predict_layers=1, max_draft_len=3),
        "vanilla3": MTPConfig(num_nextn_predict_layers=3, use_mtp_vanilla=True),
    }
    return (mtp_target() if kind.startswith(("mtp", "vanilla")) else target), specs[kind]


def load(kind: str, cache: bool, **engine) -> SpecModel:
    target, spec = spec_for(kind)
    engine = dict(max_batch_size=4, page_size=PAGE, admission_window_ms=0.0, scheduler_delay_factor=0.0) | engine
    return SpecModel.from_pretrained(target, spec, enable_prefix_caching=cache, **engine)


@pytest.fixture
def steps(monkeypatch) -> list:
    """Every step's (accepted tokens, next input = [last token, next drafts]), in order, for every request."""
    seen: list = []
    accept = Request.accept

    def recording_accept(self, tokens, logprobs=None):
        seen.append((list(tokens), list(self.next_input)))
        return accept(self, tokens, logprobs)
    monkeypatch.setattr(Request, "accept", recording_accept)
    return seen


def generate_one(model: SpecModel, prompt: list[int], params: SamplingParams, steps: list | None = None):
    """One request alone; with ``steps``: (its output, the steps it recorded)."""
    start = len(steps) if steps is not None else 0
    (out,) = model.generate([prompt], params)
    return out if steps is None else (out, steps[start:])


def expected_hit(kind: str, prompt: list[int], earlier: list[list[int]], page: int = PAGE) -> int:
    """The cached prompt tokens the documented rule gives: the longest run of pages whose tokens and the drafter's
    lookahead match an earlier prompt's (which published them), leaving max(1, lookahead) tokens to compute."""
    lookahead = {"plain": 0, "sa": 0, "draft_target": 0, "vanilla3": 3}.get(kind, 1)
    best = 0
    for other in earlier:
        common = next((i for i, (a, b) in enumerate(zip(prompt, other)) if a != b), min(len(prompt), len(other)))
        pages = min((common - lookahead) // page, (len(other) - lookahead) // page,
                    (len(prompt) - max(1, lookahead)) // page)
        best = max(best, pages * page)
    return best


# lookahead 1, 0 with suffix drafting's text, N: in the README's command; the other drafters in the slow run
KINDS = ["eagle3", "sa", "vanilla3"] + [pytest.param(kind, marks=pytest.mark.slow) for kind in
                                        ("plain", "tree", "dynamic_tree", "eagle3_sa", "draft_target",
                                         "mtp_eagle")]


@pytest.mark.parametrize("kind", KINDS)
def test_reused_prefix_changes_nothing_a_request_sees(kind, steps):
    params = SEEDED if kind in ("eagle3", "mtp_eagle") else GREEDY
    cold, warm = load(kind, cache=False), load(kind, cache=True)
    for i, prompt in enumerate(PROMPTS):
        generate_one(warm, UNRELATED, SamplingParams(max_new_tokens=2, ignore_eos=True))  # its slot's state
        off, off_steps = generate_one(cold, prompt, params, steps)
        on, on_steps = generate_one(warm, prompt, params, steps)
        assert on.token_ids == off.token_ids, f"prompt {i}"
        assert on_steps == off_steps, f"prompt {i}: steps (accepted tokens, next drafts) differ"
        assert on.stats.cached_prompt_tokens == expected_hit(kind, prompt, PROMPTS[:i] + [UNRELATED]), f"prompt {i}"
        assert off.stats.cached_prompt_tokens == 0
    assert warm.engine.prefix_cache.hits > 0
    pages = warm.engine.kv.pages
    assert pages.num_in_use == 0 and pages.num_available == pages.total


@pytest.mark.parametrize("kind", ["eagle3"] + [pytest.param(kind, marks=pytest.mark.slow) for kind in
                                  ("sa", "vanilla3", "plain", "tree", "dynamic_tree", "eagle3_sa", "draft_target",
                                   "mtp_eagle")])
def test_next_turn_reuses_the_answer(kind, steps):
    """A conversation's next turn resends the first turn's prompt and answer: the answer's final pages (written
    by decode steps) are reused too, and the turn decodes, accepts and drafts exactly as without the cache."""
    cold, warm = load(kind, cache=False), load(kind, cache=True)
    first = generate_one(warm, BASE, GREEDY)
    turn = BASE + first.token_ids + [3, 1, 4, 1, 5]
    generate_one(warm, UNRELATED, SamplingParams(max_new_tokens=2, ignore_eos=True))  # its slot's state
    on, on_steps = generate_one(warm, turn, GREEDY, steps)
    off, off_steps = generate_one(cold, turn, GREEDY, steps)
    assert on.token_ids == off.token_ids and on_steps == off_steps
    lookahead = {"plain": 0, "sa": 0, "draft_target": 0, "vanilla3": 3}.get(kind, 1)
    written = len(BASE) + len(first.token_ids) - 1  # the last token's K/V is the next step's
    final = min(written, len(BASE) + len(first.token_ids) - lookahead) // PAGE * PAGE
    assert on.stats.cached_prompt_tokens == final > len(BASE) // PAGE * PAGE


def test_whole_prompt_hit_recomputes_its_last_page():
    """The same prompt again: every page but the last is reused (at least the last token is computed), and a
    prompt of exactly whole pages leaves its last page to compute."""
    model = load("eagle3", cache=True)
    prompt = BASE[:16]  # 4 whole pages
    first, again = generate_one(model, prompt, GREEDY), generate_one(model, prompt, GREEDY)
    assert again.token_ids == first.token_ids
    assert (first.stats.cached_prompt_tokens, again.stats.cached_prompt_tokens) == (0, 12)


def test_identical_prompts_in_one_step_share_nothing_unwritten(monkeypatch):
    """Two identical prompts admitted in the same step (the wait for a writer turned off) both prefill: neither
    reads pages the other has not written yet; the first to finish its prefill publishes, the duplicate's pages
    go back free; a third later reuses."""
    model, cold = load("eagle3", cache=True), load("eagle3", cache=False)
    monkeypatch.setattr(model.engine.prefix_cache, "waits_for_writer", lambda request, writers: False)
    outs = model.generate([BASE, BASE], GREEDY)
    assert [o.stats.cached_prompt_tokens for o in outs] == [0, 0]
    later = generate_one(model, BASE, GREEDY)
    assert later.stats.cached_prompt_tokens == 16
    reference = generate_one(cold, BASE, GREEDY).token_ids
    assert [o.token_ids for o in outs] + [later.token_ids] == [reference] * 3
    # one copy of the 26-token text's 6 final pages (25 positions written, lookahead 1): the duplicate's went free
    assert model.engine.kv.pages.num_cached == 6


def test_a_burst_behind_one_new_prefix_prefills_it_once(steps):
    """Requests arriving together behind a shared prefix nobody has cached: the first prefills it, the others
    wait for its pages (not admitted beside it) and reuse them; a request with nothing to share is not held."""
    model, cold = load("eagle3", cache=True, max_batch_size=4), load("eagle3", cache=False)
    prompts = [BASE + [1], BASE + [2, 3], UNRELATED, BASE[:13] + [4]]
    outs = model.generate(prompts, GREEDY)
    assert [o.stats.cached_prompt_tokens for o in outs] == [0, 16, 0, 12]
    assert [o.token_ids for o in outs] == [o.token_ids for o in cold.generate(prompts, GREEDY)]


def test_chunked_prefill_after_a_reused_prefix(steps):
    """A prompt longer than the step's prompt budget reuses its first pages, then prefills the rest in chunks."""
    long = BASE + list(range(30, 60))  # 48 tokens
    cold = load("eagle3", cache=False, max_num_batched_tokens=7)
    warm = load("eagle3", cache=True, max_num_batched_tokens=7)
    generate_one(warm, BASE, GREEDY)
    on, on_steps = generate_one(warm, long, GREEDY, steps)
    off, off_steps = generate_one(cold, long, GREEDY, steps)
    assert on.stats.cached_prompt_tokens == 16
    assert on.token_ids == off.token_ids and on_steps == off_steps


def test_eviction_under_pressure_then_a_re_hit():
    """A pool too small for every prefix: the least recently used cached pages are evicted for new requests, the
    accounting adds up after every call, and a prefix cached again is reused again."""
    model, cold = load("eagle3", cache=True, num_pages=20), load("eagle3", cache=False)
    pages = model.engine.kv.pages
    others = [[90 - i] * 13 + [i, i + 1, i + 2] for i in range(6)]
    assert generate_one(model, BASE, GREEDY).stats.cached_prompt_tokens == 0
    for prompt in others:  # each caches 3 pages and holds 8 while it runs: BASE's pages go
        generate_one(model, prompt, GREEDY)
        assert pages.num_in_use == 0 and pages.num_available == pages.total
        assert pages.num_cached <= pages.total
    evicted = generate_one(model, BASE, GREEDY)
    assert evicted.stats.cached_prompt_tokens == 0  # evicted, prefilled again and cached again
    rehit = generate_one(model, BASE, GREEDY)
    assert rehit.stats.cached_prompt_tokens == 16
    assert evicted.token_ids == rehit.token_ids == generate_one(cold, BASE, GREEDY).token_ids


def test_salt_separates_tenants():
    model = load("eagle3", cache=True)
    salted = GREEDY.model_copy(update={"cache_salt": "tenant-a"})
    generate_one(model, BASE, salted)
    assert generate_one(model, BASE, GREEDY).stats.cached_prompt_tokens == 0
    assert generate_one(model, BASE, GREEDY.model_copy(update={"cache_salt": "tenant-b"})
                        ).stats.cached_prompt_tokens == 0
    assert generate_one(model, BASE, salted).stats.cached_prompt_tokens == 16


def test_reset_and_counters():
    model = load("eagle3", cache=True)
    generate_one(model, BASE, GREEDY)
    assert generate_one(model, BASE, GREEDY).stats.cached_prompt_tokens == 16
    cache = model.engine.prefix_cache
    assert (cache.queries, cache.hits) == (2 * len(BASE), 16)
    model.reset_prefix_cache()
    assert model.engine.kv.pages.num_cached == 0
    assert generate_one(model, BASE, GREEDY).stats.cached_prompt_tokens == 0


def test_cpu_default_is_off_and_relaxed_thinking_state_is_restored():
    """Off by default on the CPU; with relaxed acceptance (lossy inside thinking) a reused prefix that opened
    thinking still decodes as the cold run does."""
    assert not load("plain", cache=None).engine.prefix_cache.enabled
    spec = MTPConfig(num_nextn_predict_layers=1, max_draft_len=3, use_relaxed_acceptance_for_thinking=True,
                     relaxed_topk=64, relaxed_delta=1.0, begin_thinking_phase_token=BASE[2],
                     end_thinking_phase_token=96)
    engine = dict(max_batch_size=2, page_size=PAGE, admission_window_ms=0.0, scheduler_delay_factor=0.0)
    cold = SpecModel.from_pretrained(mtp_target(), spec, enable_prefix_caching=False, **engine)
    warm = SpecModel.from_pretrained(mtp_target(), spec, enable_prefix_caching=True, **engine)
    generate_one(warm, BASE, GREEDY)
    generate_one(warm, [96, 1, 2], GREEDY)  # leaves its slot (the next request's) out of thinking
    prompt = BASE[:13] + [70, 71, 72]  # thinking opened at BASE[2], inside the reused pages
    on, off = generate_one(warm, prompt, GREEDY), generate_one(cold, prompt, GREEDY)
    assert on.stats.cached_prompt_tokens == 12
    assert on.token_ids == off.token_ids and on.stats.accepted_per_step == off.stats.accepted_per_step
