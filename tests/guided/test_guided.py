"""Guided decoding with speculation: the output follows the grammar and equals non-speculative constrained
decoding token for token; masks of the target rows are exact, draft passes are masked where forced; a bad
grammar rejects its request only."""
import json

import pytest
import torch

from tllm_spec import MTPConfig, SamplingParams, SpecModel
from tllm_spec.config import GuidedDecodingParams
from tllm_spec.drafts.mtp.model import save_random_mtp_weights

from ..models import char_tokenizer, eagle3, hf_greedy, tiny_guided_pair

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
          "age": {"type": "integer", "minimum": 0, "maximum": 150}, "ok": {"type": "boolean"},
          "tag": {"enum": ["red", "green"]}}, "required": ["name", "age", "ok", "tag"], "additionalProperties": False}
PROMPTS = [[5, 17, 3, 44, 9, 2, 71], [12, 8], [60, 61, 62, 63, 1, 2, 3]]


def guided(max_new_tokens: int = 80, **grammar) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, guided_decoding=GuidedDecodingParams(**grammar))


def generate(target, spec, prompts, params, **kwargs):
    return SpecModel.from_pretrained(target, spec, max_batch_size=3).generate(prompts, params, **kwargs)


@pytest.mark.parametrize("draft_vocab_size", [None, 32])
def test_speculative_json_equals_plain_constrained_greedy(draft_vocab_size):
    target, head = tiny_guided_pair(draft_vocab_size)
    params = guided(json_schema=SCHEMA)
    plain, spec = generate(target, None, PROMPTS, params), generate(target, eagle3(head, 3), PROMPTS, params)
    for p, s in zip(plain, spec):
        assert s.token_ids == p.token_ids
        jsonschema.validate(json.loads(s.text), SCHEMA)
        assert s.finish_reason == "stop" and s.text.endswith("}")  # ends when the grammar completes, no EOS
        assert list(json.loads(s.text)) == list(SCHEMA["properties"])  # the schema's property order
    if draft_vocab_size is None:  # forced runs were drafted (a 32-token draft vocabulary lacks most characters)
        assert max(n for s in spec for n in s.stats.accepted_per_step) == 4


@pytest.mark.parametrize("shape", [{"eagle_choices": [[0], [1], [2], [0, 0], [1, 0], [0, 0, 0]]},
                                   {"use_dynamic_tree": True, "dynamic_tree_max_topK": 2, "max_total_draft_tokens": 6}])
def test_a_tree_decodes_as_plain_constrained_greedy(shape):
    """Each tree row masked by the grammar state after its path (a dynamic tree's shape read between steps):
    the output equals non-speculative constrained decoding, and steps accept paths of the tree, the forced
    tokens drafted through the draft-pass masks (greedy and with rejection sampling)."""
    target, head = tiny_guided_pair()
    tree = eagle3(head, 3).model_copy(update={**shape, "use_rejection_sampling": True})
    params = guided(json_schema=SCHEMA)
    plain, spec = generate(target, None, PROMPTS, params), generate(target, tree, PROMPTS, params)
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    assert max(n for s in spec for n in s.stats.accepted_per_step) >= 3
    sampled = SamplingParams(max_new_tokens=80, temperature=1.0, seed=3,
                             guided_decoding=GuidedDecodingParams(json_schema=SCHEMA))
    for out in generate(target, tree, PROMPTS, sampled):
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_bad_grammar_rejects_only_its_request():
    target, head = tiny_guided_pair()
    params = [guided(json_schema=SCHEMA), guided(json_schema={"type": "frobnicate"}), SamplingParams(max_new_tokens=9),
              guided(regex="[a-")]
    with pytest.warns(UserWarning, match="rejected"):
        outs = SpecModel.from_pretrained(target, eagle3(head, 3), max_batch_size=2).generate(PROMPTS + [[4]], params)
    assert [o.finish_reason for o in outs] == ["stop", "rejected", "length", "rejected"]
    assert "frobnicate" in outs[1].error and "regex" in outs[3].error
    jsonschema.validate(json.loads(outs[0].text), SCHEMA)
    assert outs[2].token_ids == hf_greedy(target, PROMPTS[2], 9)  # unguided neighbour: all-ones masks


def test_forced_grammar_accepts_every_draft():
    """Every token of a one-value enum is forced: the draft-pass masks force the drafts too, so each step
    emits K + 1 tokens although the random head alone would almost never guess them."""
    target, head = tiny_guided_pair()
    text = '"speculative decoding keeps the grammar"'
    outs = generate(target, eagle3(head, 3), PROMPTS[:1], guided(json_schema={"enum": [json.loads(text)]}))
    assert outs[0].text == text and outs[0].finish_reason == "stop"
    steps = outs[0].stats.accepted_per_step
    assert steps[:-1] == [4] * (len(steps) - 1) and len(steps) == -(-(len(text) - 1) // 4)


def test_sampling_with_rejection_keeps_the_grammar():
    target, head = tiny_guided_pair()
    spec = eagle3(head, 3).model_copy(update=dict(use_rejection_sampling=True))
    params = SamplingParams(max_new_tokens=80, temperature=1.0, guided_decoding=GuidedDecodingParams(json_schema=SCHEMA))
    for out in generate(target, spec, PROMPTS, params, seed=4):
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_mtp_per_step_regex_equals_plain(tmp_path):
    target, _ = tiny_guided_pair()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "generation_config.json"):
        if (target / name).is_file():
            (tmp_path / name).write_bytes((target / name).read_bytes())
    save_random_mtp_weights(tmp_path, 2, "deepseek", seed=3)
    spec = MTPConfig(num_nextn_predict_layers=2, max_draft_len=3, mtp_layer_selection="per_step")
    params = guided(regex=r"[a-z]{2,6}@[a-z]{2,4}\.(com|org)")
    plain, drafted = generate(tmp_path, None, PROMPTS, params), generate(tmp_path, spec, PROMPTS, params)
    assert [o.token_ids for o in drafted] == [o.token_ids for o in plain]
    assert all(o.finish_reason == "stop" and "@" in o.text for o in drafted)


def test_without_tokenizer_guided_requests_are_rejected():
    from ..models import tiny_pair

    target, head = tiny_pair("llama")
    with pytest.warns(UserWarning, match="tokenizer"):
        outs = generate(target, eagle3(head, 2), PROMPTS[:2], [guided(regex="a+"), SamplingParams(max_new_tokens=5)])
    assert outs[0].finish_reason == "rejected" and outs[1].token_ids == hf_greedy(target, PROMPTS[1], 5)


# ---- the mask builder and the in-step masking, on a fully forced grammar -------------------------------------

@pytest.fixture(scope="module")
def decoder():
    from tllm_spec.guided.decoder import GuidedDecoder
    from tllm_spec.guided.grammar import GrammarCompiler

    return GuidedDecoder(GrammarCompiler(char_tokenizer(), 97, 96), max_batch_size=2, max_draft_len=3, device="cpu")


def ids(text: str) -> list[int]:
    return char_tokenizer().encode(text)


def allowed(rows: torch.Tensor) -> list[str]:
    """Decoded allowed tokens of each mask row ("*" for all-ones)."""
    tok = char_tokenizer()
    return ["*" if bool((r == -1).all()) else "".join(tok.decode([t]) for t in range(97) if (r[t // 32] >> t % 32) & 1)
            for r in rows]


def test_target_rows_exact_and_draft_rows_follow_forced_tokens(decoder):
    ctx, gen = (decoder.matcher(GuidedDecodingParams(regex="abcdefgh")) for _ in range(2))
    gen.advance(ids("ab"))
    decoder.build([ctx, gen], [[], ids("cdX")])
    assert allowed(decoder.bitmask[:5]) == ["a", "c", "d", "e", "*"]  # ctx row; gen rows after "", c, cd; X refused
    assert allowed(decoder.draft_bitmask[0, 0]) == ["b", "c", "d"]  # bonus a forced, then b, c, d
    # branch j: j drafts accepted, bonus forced after them; branch 3 needs X, which the grammar refuses
    assert [allowed(decoder.draft_bitmask[1, j]) for j in range(4)] == [
        ["d", "e", "f"], ["e", "f", "g"], ["f", "g", "h"], ["*", "*", "*"]]
    decoder.build([gen], [[]])  # the matchers were rolled back: still after "ab"
    assert allowed(decoder.bitmask[:1]) == ["c"]


def test_tree_rows_follow_each_nodes_path():
    """Tree [[0], [1], [0, 0], [1, 0]]: a node's row is the state after its path; under a refused draft, all-ones.
    Each node's draft branch follows the tokens forced after it, one pass per depth; the matcher is rolled
    back."""
    from tllm_spec.drafts.tree import DraftTree
    from tllm_spec.guided.decoder import GuidedDecoder
    from tllm_spec.guided.grammar import GrammarCompiler

    tree = DraftTree.from_choices([[0], [1], [0, 0], [1, 0]])
    decoder = GuidedDecoder(GrammarCompiler(char_tokenizer(), 97, 96), max_batch_size=2, max_draft_len=4,
                            device="cpu", tree=tree)
    gen = decoder.matcher(GuidedDecodingParams(regex="ab(cd|ce)fg"))
    gen.advance(ids("ab"))
    decoder.build([gen], [ids("cXde")])  # nodes 1 'c', 2 'X' (refused), 3 'd' (after c), 4 'e' (after X)
    assert allowed(decoder.bitmask[:5]) == ["c", "de", "*", "f", "*"]
    # branch = the last accepted node: at the root the bonus is forced to c (then d or e: not forced further);
    # after node 3 ("abcd") f is forced, then g, which completes the grammar; node 1's state forces nothing
    assert [allowed(decoder.draft_bitmask[0, node]) for node in (0, 1, 3)] == [["de", "*"], ["*", "*"], ["g", "*"]]
    decoder.build([gen], [ids("ccXd")])  # siblings with the same draft; node 3's X refused, node 4 after "abcd"
    assert allowed(decoder.bitmask[:5]) == ["c", "de", "de", "*", "f"]


def test_unforced_and_completed_branches(decoder):
    m = decoder.matcher(GuidedDecodingParams(regex="a(b|c)d"))
    decoder.build([m, None], [[], ids("bdd")])
    assert allowed(decoder.bitmask[:1]) == ["a"]
    assert allowed(decoder.draft_bitmask[0, 0]) == ["bc", "*", "*"]  # after a: b or c, unknown beyond
    assert allowed(decoder.bitmask[1:5]) == ["*"] * 4  # the unguided request: no mask
    m.advance(ids("ab"))
    decoder.build([m], [ids("d")])  # d completes the grammar: no branch needs drafts
    assert allowed(decoder.bitmask[:2]) == ["d", "<eos>"]
    assert allowed(decoder.draft_bitmask[0, :2].flatten(0, 1)) == ["*"] * 6


def test_in_step_masking_picks_the_branch(decoder):
    """Inside the step the accepted counts pick each request's branch; draft ids map through d2t."""
    ctx, gen = (decoder.matcher(GuidedDecodingParams(regex="abcdefgh")) for _ in range(2))
    gen.advance(ids("ab"))
    decoder.build([ctx, gen], [[], ids("cde")])
    logits = torch.zeros(5, 97)
    decoder.execute(logits)
    assert [row.isfinite().nonzero().flatten().tolist() for row in logits] == [ids(c) for c in "acdef"]
    decoder.add_draft_batch(torch.tensor([1, 3]))  # the generation request accepted c, d and a bonus
    draft_logits = torch.zeros(2, 97)
    decoder.execute_draft_batch(draft_logits, draft_step=0)
    assert [row.isfinite().nonzero().flatten().tolist() for row in draft_logits] == [ids("b"), ids("f")]
    d2t = torch.tensor([ids("x")[0], ids("c")[0] - 1, 0])  # draft ids 0, 1, 2 -> target x, c, 2
    decoder.execute_draft_batch(draft_logits := torch.zeros(2, 3), d2t, draft_step=1)  # ctx pass 1 allows c
    assert draft_logits[0].isfinite().tolist() == [False, True, False]
    assert draft_logits[1].isfinite().all()  # g is not in the draft vocabulary: left unmasked, never all -inf


def test_matcher_advance_stops_at_completion_and_refuses_outside_tokens(decoder):
    m = decoder.matcher(GuidedDecodingParams(regex="ab"))
    assert m.advance(ids("a")) == (ids("a"), None)
    assert m.advance(ids("b") + [96, 5]) == (ids("b"), "stop")  # tokens after the completion are dropped
    m = decoder.matcher(GuidedDecodingParams(regex="ab"))
    assert m.advance(ids("ax")) == (ids("a"), "error")  # only forced/relaxed acceptance can get here
