"""Suffix-match (SA) drafting (drafts/sa/suffix_match.py): the incremental match array against brute-force
longest common suffixes, ``propose`` against a brute-force oracle after random chunked starts and extends (the
capped start included), the fixed n-gram size, hand-written texts, and one torch.compile(fullgraph=True) step."""
from __future__ import annotations

import copy
import random

import pytest
import torch

from tllm_spec.drafts.sa.suffix_match import SuffixMatch, match_update


def lcs(text: list[int], j: int) -> int:
    """The longest common suffix of text[..j] and the whole text."""
    n = 0
    while n <= j and text[j - n] == text[-1 - n]:
        n += 1
    return n


def oracle(text: list[int], bound: int, ngram: int, k: int) -> tuple[list[int] | None, int]:
    """Brute force: every earlier end j < len-1 with its match (counted up to ``bound``); the longest, latest on
    ties (ngram -1), or the latest of at least ngram tokens; drafts continue it periodically."""
    minimum = 1 if ngram == -1 else ngram
    found = [(m, j) for j in range(len(text) - 1) if (m := min(lcs(text, j), bound)) >= minimum]
    if not found:
        return None, 0
    m, j = max(found) if ngram == -1 else max(found, key=lambda c: c[1])
    period = len(text) - 1 - j
    return [text[j + 1 + i % period] for i in range(k)], m


class Reference:
    """The texts as host lists, truncated to max_len, with each slot's match bound (cap + tokens since start)."""

    def __init__(self, num_slots: int, max_len: int, cap: int):
        self.texts: list[list[int]] = [[] for _ in range(num_slots)]
        self.bounds = [cap] * num_slots
        self.max_len, self.cap = max_len, cap

    def start(self, slot: int, chunk: list[int], start: int) -> None:
        self.texts[slot] = (self.texts[slot][:start] + chunk)[:self.max_len]
        self.bounds[slot] = self.cap

    def extend(self, slot: int, new: list[int]) -> None:
        kept = new[:self.max_len - len(self.texts[slot])]
        self.texts[slot] += kept
        self.bounds[slot] += len(kept)


def build(texts: list[list[int]], ngram: int = -1, cap: int = 64, max_len: int = 32) -> SuffixMatch:
    sm = SuffixMatch(len(texts), max_len, ngram, cap)
    sm.start(torch.arange(len(texts)), torch.tensor([t for text in texts for t in text]),
             [len(t) for t in texts], [0] * len(texts))
    return sm


def propose(sm: SuffixMatch, k: int) -> tuple[list[list[int]], list[int]]:
    drafts, match_len = sm.propose(torch.arange(sm.tokens.shape[0]), k)
    assert drafts.dtype == match_len.dtype == torch.int64 and drafts.shape == (sm.tokens.shape[0], k)
    return drafts.tolist(), match_len.tolist()


@pytest.mark.parametrize("seed", range(4))
def test_match_update_equals_brute_force_longest_common_suffixes(seed):
    gen = random.Random(seed)
    width, max_len = 4, 17
    texts = [[gen.randrange(2 + seed % 3) for _ in range(gen.randint(0, max_len))] for _ in range(12)]
    num_new = [gen.randint(0, min(width, len(t))) for t in texts]
    tokens = torch.tensor([t + [7] * (max_len - len(t)) for t in texts])  # 7: stale tokens past the length

    def brute(text: list[int]) -> list[int]:
        return [lcs(text, j) for j in range(len(text) - 1)] + [0] * (max_len - max(len(text) - 1, 0))

    old = torch.tensor([brute(t[:len(t) - n]) for t, n in zip(texts, num_new)], dtype=torch.int32)
    length_before = torch.tensor([len(t) - n for t, n in zip(texts, num_new)])
    new = match_update(tokens, old, length_before, torch.tensor(num_new), width)
    assert new.dtype == torch.int32
    assert new.tolist() == [brute(t) for t in texts]


@pytest.mark.parametrize("seed, vocab, ngram, cap, width", [
    (0, 2, -1, 64, 1), (1, 3, -1, 64, 4), (2, 5, -1, 64, 3), (3, 2, -1, 4, 3), (4, 3, -1, 1, 4),
    (5, 2, 2, 64, 4), (6, 3, 3, 64, 3), (7, 4, 1, 5, 4), (8, 2, 3, 2, 2)])
def test_propose_equals_the_oracle_after_random_starts_and_extends(seed, vocab, ngram, cap, width):
    gen = random.Random(seed)
    num_slots, max_len = 5, 41
    sm, ref = SuffixMatch(num_slots, max_len, ngram, cap), Reference(num_slots, max_len, cap)
    for _ in range(40):
        slots = gen.sample(range(num_slots), gen.randint(1, num_slots))
        if gen.random() < 0.3:  # context chunks: a new prompt, or the next chunk of the slot's prompt
            starts = [gen.choice([0, len(ref.texts[s])]) for s in slots]
            chunks = [[gen.randrange(vocab) for _ in range(gen.choice([1, 3, 17, gen.randint(0, 5)]))] for _ in slots]
            sm.start(torch.tensor(slots), torch.tensor([t for c in chunks for t in c], dtype=torch.int64),
                     [len(c) for c in chunks], starts)
            for s, c, st in zip(slots, chunks, starts):
                ref.start(s, c, st)
        else:  # a generation step: W tokens a row, the first num_new of them accepted
            new = [[gen.randrange(vocab) for _ in range(width)] for _ in slots]
            num_new = [gen.randint(0, width) for _ in slots]
            sm.extend(torch.tensor(slots), torch.tensor(new), torch.tensor(num_new))
            for s, row, n in zip(slots, new, num_new):
                ref.extend(s, row[:n])
        k = gen.choice([1, 3, 7])
        drafts, match_len = propose(sm, k)
        for s in range(num_slots):
            want, want_len = oracle(ref.texts[s], ref.bounds[s], ngram, k)
            assert match_len[s] == want_len, (s, ref.texts[s])
            assert drafts[s] == (want or ref.texts[s][-1:] * k or drafts[s]), (s, ref.texts[s])
        assert sm.length.tolist() == [len(t) for t in ref.texts]


def test_the_cat_sat():
    text = [ord(c) for c in "the cat sat. the cat"]
    drafts, match_len = propose(build([text]), 8)
    assert "".join(map(chr, drafts[0])) == " sat. th" and match_len == [len("the cat")]


def test_a_match_next_to_the_end_repeats_with_its_period():
    a, b = 1, 2
    drafts, match_len = propose(build([[a, b, a, b], [a, a]]), 5)
    assert drafts == [[a, b, a, b, a], [a, a, a, a, a]] and match_len == [2, 1]


def test_longest_against_fixed_ngram_and_no_match():
    text = [1, 2, 3, 9, 2, 3, 7, 1, 2, 3]  # "1 2 3" ended at j=2, "2 3" at j=5 too
    assert propose(build([text]), 4) == ([[9, 2, 3, 7]], [3])  # longest: j=2
    assert propose(build([text], ngram=2), 4) == ([[7, 1, 2, 3]], [2])  # the latest of >= 2 tokens: j=5
    assert propose(build([text], ngram=4), 4)[1] == [0]  # "9 1 2 3"... no 4-gram repeats
    no_match = [[1, 2, 3], [1], []]  # 3 never occurred before; one token; nothing
    drafts, match_len = propose(build(no_match), 2)
    assert match_len == [0, 0, 0] and drafts[:2] == [[3, 3], [1, 1]]  # the last token, masked out by the caller


def test_start_counts_matches_up_to_the_cap_and_appends_grow_them_exactly():
    text = [5, 1, 2, 3, 7, 2, 3, 9, 1, 2, 3]  # "1 2 3" ended at j=3 (3 tokens), "2 3" at j=6 (2 tokens)
    assert propose(build([text], cap=64), 4) == ([[7, 2, 3, 9]], [3])
    capped = build([text], cap=2)  # both count 2: the latest, j=6, wins
    assert propose(capped, 4) == ([[9, 1, 2, 3]], [2])
    capped.extend(torch.tensor([0]), torch.tensor([[7, 0]]), torch.tensor([1]))  # "1 2 3 7" ended at j=4
    assert propose(capped, 3) == ([[2, 3, 9]], [3])  # the cap plus one appended token, not 4


def test_chunked_start_equals_one_start():
    text = [0, 1, 2, 0, 1, 0, 1, 1, 0, 2, 0, 1]
    chunked = SuffixMatch(1, 32)
    for begin, end in [(0, 5), (5, 6), (6, 12)]:
        chunked.start(torch.tensor([0]), torch.tensor(text[begin:end]), [end - begin], [begin])
    whole = build([text])
    assert torch.equal(chunked.match, whole.match) and torch.equal(chunked.length, whole.length)


def test_writes_past_max_len_are_dropped():
    sm = build([[1, 2, 1, 2, 1]], max_len=6)
    sm.extend(torch.tensor([0]), torch.tensor([[2, 1, 2]]), torch.tensor([3]))  # one token fits
    assert sm.length.tolist() == [6] and sm.tokens.tolist() == [[1, 2, 1, 2, 1, 2]]
    assert propose(sm, 2) == ([[1, 2]], [4])


@pytest.mark.parametrize("ngram", [0, -2])
def test_a_bad_ngram_size_is_refused(ngram):
    with pytest.raises(ValueError, match="max_matching_ngram_size"):
        SuffixMatch(1, 8, ngram)


@pytest.mark.slow  # about 15 s of CPU inductor compile on 2 cores
def test_extend_and_propose_compile_into_one_graph():
    gen = random.Random(0)
    eager = build([[gen.randrange(3) for _ in range(n)] for n in (1, 3, 17, 0)], max_len=40)
    compiled = copy.deepcopy(eager)

    def step(sm: SuffixMatch, slots: torch.Tensor, new: torch.Tensor, num_new: torch.Tensor):
        sm.extend(slots, new, num_new)
        return sm.propose(slots, 5)

    step_compiled = torch.compile(step, fullgraph=True)
    slots = torch.tensor([0, 1, 2, 3])
    for _ in range(3):
        new, num_new = torch.randint(0, 3, (4, 4)), torch.randint(0, 5, (4,))
        want, got = step(eager, slots, new, num_new), step_compiled(compiled, slots, new, num_new)
        assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    assert torch.equal(eager.match, compiled.match) and torch.equal(eager.tokens, compiled.tokens)
