import pytest

from tllm_spec import SpeculativeDecodingMode as Mode


def test_from_string_round_trip_and_case():
    for mode in Mode:
        assert Mode.from_string(mode.name.lower()) is mode
    assert Mode.from_string(None) is Mode.NONE


def test_unknown_name_lists_known():
    with pytest.raises(ValueError, match="EAGLE3_ONE_MODEL"):
        Mode.from_string("medusa")


@pytest.mark.parametrize("name", ["eagle3", "mtp_eagle", "ngram", "draft_target"])
def test_two_model_modes_refused_naming_supported(name):
    with pytest.raises(NotImplementedError, match="supported modes: EAGLE3_ONE_MODEL, MTP, MTP_EAGLE_ONE_MODEL"):
        Mode.from_string(name).check_supported()


def test_predicates():
    assert Mode.MTP.is_mtp_one_model() and Mode.MTP.is_mtp_vanilla() and not Mode.MTP.is_mtp_eagle_one_model()
    assert Mode.MTP_EAGLE_ONE_MODEL.is_mtp_one_model() and Mode.MTP_EAGLE_ONE_MODEL.is_mtp_eagle_one_model()
    assert Mode.EAGLE3_ONE_MODEL.is_eagle3_one_model() and not Mode.EAGLE3_ONE_MODEL.is_mtp_one_model()
    assert all(m.use_one_engine() and m.needs_kv_cache_rewind() for m in
               (Mode.MTP, Mode.MTP_EAGLE_ONE_MODEL, Mode.EAGLE3_ONE_MODEL))
    assert Mode.NONE.is_none() and not Mode.NONE.use_one_engine() and not Mode.NONE.needs_kv_cache_rewind()
    assert not Mode.EAGLE3.use_one_engine()
