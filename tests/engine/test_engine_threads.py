"""The engine thread's intra-op threads on the CPU (``loop.engine_threads``): a narrow target decodes on one, so
that waking a second OpenMP team at each of its small ops does not dominate its step; a wider one keeps the count
of the thread that made the model."""
import torch

from tllm_spec import SamplingParams, SpecModel
from tllm_spec.engine.loop import ONE_THREAD_MAX_HIDDEN
from tllm_spec.tools.random_models import save_random_target, target_config

from ..models import tiny_pair


def test_a_narrow_target_decodes_on_one_thread_and_a_wide_one_on_the_callers_count(tmp_path):
    narrow, _ = tiny_pair("llama")
    wide_cfg = target_config("llama", vocab_size=97, num_hidden_layers=1, hidden_size=ONE_THREAD_MAX_HIDDEN + 64,
                             num_attention_heads=9, num_key_value_heads=3, intermediate_size=128)
    wide = save_random_target(tmp_path / "wide", wide_cfg, seed=0)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for target, expected in ((narrow, 1), (wide, 2)):
            with SpecModel.from_pretrained(target, None, max_batch_size=1) as model:
                out = model.generate([[5, 17, 3]], SamplingParams(max_new_tokens=3, ignore_eos=True))[0]
                assert len(out.token_ids) == 3
                assert model.loop.call(torch.get_num_threads) == expected
    finally:
        torch.set_num_threads(before)
