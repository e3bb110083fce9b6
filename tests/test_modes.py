import pytest

from tllm_spec import SpeculativeDecodingMode as Mode


def test_from_string_round_trip_and_case():
    for mode in Mode:
        assert Mode.from_string(mode.name.lower()) is mode
    assert Mode.from_string(None) is Mode.NONE


def test_unknown_name_lists_known():
    with pytest.raises(ValueError, match="EAGLE3_ONE_MODEL"):
        Mode.from_string("medusa")


@pytest.mark.parametrize("name", ["eagle3", "mtp_eagle", "ngram", "draft_target", "pard"])
def test_two_model_modes_refused_naming_supported(name):
    with pytest.raises(NotImplementedError, match="supported modes: EAGLE3_ONE_MODEL, MTP, MTP_EAGLE_ONE_MODEL, "
                                                  "DRAFT_TARGET_ONE_MODEL, SA, NONE"):
        Mode.from_string(name).check_supported()


# Transcribed by hand, member by member, from TensorRT-LLM tensorrt_llm/_torch/speculative/interface.py in its
# 2026 revision whose members are exactly ours, in this order (SA, DRAFT_TARGET_ONE_MODEL, PARD, DFLASH added to
# the eleven of commit b35ac1b64368).
MEMBERS = ("MTP", "MTP_EAGLE", "MTP_EAGLE_ONE_MODEL", "EAGLE3", "EAGLE3_ONE_MODEL", "NGRAM", "SA", "DRAFT_TARGET",
           "DRAFT_TARGET_ONE_MODEL", "USER_PROVIDED", "SAVE_HIDDEN_STATES", "PARD", "DFLASH", "NONE", "AUTO")
TRUTH = {
    #                                     MTP MTP_E MTP_E1 E3 E3_1 NGRAM SA DT DT_1 USER SAVE PARD DFL NONE AUTO
    "is_mtp_one_model":                  "1   0     1      0  0    0     0  0  0    0    0    0    0   0    0",
    "is_mtp_eagle_one_model":            "0   0     1      0  0    0     0  0  0    0    0    0    0   0    0",
    "is_mtp_vanilla":                    "1   0     0      0  0    0     0  0  0    0    0    0    0   0    0",
    "is_mtp_eagle":                      "0   1     0      0  0    0     0  0  0    0    0    0    0   0    0",
    "is_eagle3":                         "0   0     0      1  0    0     0  0  0    0    0    0    0   0    0",
    "is_eagle3_one_model":               "0   0     0      0  1    0     0  0  0    0    0    0    0   0    0",
    "is_ngram":                          "0   0     0      0  0    1     0  0  0    0    0    0    0   0    0",
    "is_sa":                             "0   0     0      0  0    0     1  0  0    0    0    0    0   0    0",
    "is_draft_target":                   "0   0     0      0  0    0     0  1  0    0    0    0    0   0    0",
    "is_draft_target_one_model":         "0   0     0      0  0    0     0  0  1    0    0    0    0   0    0",
    "is_user_provided":                  "0   0     0      0  0    0     0  0  0    1    0    0    0   0    0",
    "is_save_hidden_states":             "0   0     0      0  0    0     0  0  0    0    1    0    0   0    0",
    "is_pard":                           "0   0     0      0  0    0     0  0  0    0    0    1    0   0    0",
    "is_dflash":                         "0   0     0      0  0    0     0  0  0    0    0    0    1   0    0",
    "is_parallel_draft":                 "0   0     0      0  0    0     0  0  0    0    0    1    1   0    0",
    "is_external_drafter":               "0   0     0      0  0    0     0  0  1    0    0    1    1   0    0",
    "is_none":                           "0   0     0      0  0    0     0  0  0    0    0    0    0   1    0",
    "use_one_engine":                    "1   0     1      0  1    0     1  0  1    0    0    1    1   0    0",
    "without_logits":                    "1   0     1      0  1    0     1  0  1    0    0    1    1   0    0",
    "needs_kv_cache_rewind":             "1   0     1      0  1    1     1  0  1    0    0    1    1   0    0",
    "support_overlap_scheduler":         "1   1     1      1  1    0     1  1  1    0    0    1    1   0    0",
    "support_guided_decoder":            "0   1     0      1  0    1     0  1  0    1    0    0    0   1    0",
    "support_capturable_guided_decoder": "1   0     1      0  1    0     1  0  1    0    0    1    1   0    0",
    "support_dynamic_draft_len":         "0   0     0      0  1    0     0  0  0    0    0    0    0   0    0",
    "has_draft_model":                   "0   1     0      1  0    0     0  1  0    0    0    0    0   0    0",
    "needs_kv_cache_recompute":          "0   1     0      1  0    0     0  0  0    0    0    0    0   0    0",
    "need_load_draft_weights":           "0   0     0      0  1    0     0  0  1    0    0    1    1   0    0",
    "has_spec_decoder":                  "1   1     1      1  1    0     1  0  1    0    0    1    1   0    0",
    "has_spec_drafter":                  "0   1     0      1  0    1     0  1  0    1    0    0    0   0    0",
}
ONE_ENGINE = {"MTP", "MTP_EAGLE_ONE_MODEL", "EAGLE3_ONE_MODEL", "SA", "DRAFT_TARGET_ONE_MODEL", "PARD", "DFLASH"}
# extend_ctx(multi-token-query attention, SM) for (True, 90), (True, 120), (False, 90), (False, 120)
EXTEND_CTX = {m: "0000" if m in ONE_ENGINE else "0111" for m in MEMBERS}


def test_member_order_matches_tensorrt_llm():
    assert tuple(m.name for m in Mode) == MEMBERS
    assert [m.value for m in Mode] == list(range(1, 16))


@pytest.mark.parametrize("predicate", sorted(TRUTH))
def test_predicate_truth_table_matches_tensorrt_llm(predicate):
    expected = {name: bit == "1" for name, bit in zip(MEMBERS, TRUTH[predicate].split())}
    assert {m.name: getattr(m, predicate)() for m in Mode} == expected


def test_has_draft_model_means_a_separate_draft_engine():
    # the one-model modes carry their draft inside the target's forward: no separate draft model
    assert not any(m.has_draft_model() for m in Mode.supported())


def test_extend_ctx_truth_table():
    for mode in Mode:
        got = "".join(str(int(mode.extend_ctx(mtq, sm))) for mtq in (True, False) for sm in (90, 120))
        assert got == EXTEND_CTX[mode.name], mode.name


def test_attention_need_spec_dec_mode_truth_table():
    flags = [(a, b, c, d) for a in (False, True) for b in (False, True) for c in (False, True) for d in (False, True)]
    for mode in Mode:
        for first, draft, mtq, chain in flags:
            got = mode.attention_need_spec_dec_mode(first, draft, mtq, chain)
            # one-model modes always; two-model ones for the target, or a chain drafter's first draft, on
            # TensorRT-LLM's own attention
            expected = mode.name in ONE_ENGINE or ((not draft or (first and chain)) and mtq)
            assert got == expected, (mode.name, first, draft, mtq, chain)
