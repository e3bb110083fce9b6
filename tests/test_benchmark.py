"""The roofline byte count of a generation step (the benchmark itself runs on a GPU)."""
from tllm_spec.benchmark import step_bytes
from tllm_spec.spec_model import SpecModel

from .models import eagle3, tiny_pair


def test_step_bytes_counts_weights_once_draft_per_pass_and_kv():
    target, head = tiny_pair("llama")
    spec = SpecModel.from_pretrained(target, eagle3(head, 3), max_batch_size=2)
    plain = SpecModel.from_pretrained(target, None, max_batch_size=2)
    cfg = plain.target.config  # 8 layers, hidden 64, 2 KV heads x 16, vocab 97, untied, fp32
    target_weights = sum(p.numel() for p in plain.target.hf.parameters()) - 97 * 64
    kv_per_token = cfg.num_hidden_layers * 2 * 2 * 16
    assert step_bytes(plain, batch=2, context_len=10) == 4 * (target_weights + 2 * 10 * kv_per_token)
    draft = spec.worker.draft_model
    fc = draft.fc.weight.numel()
    per_pass = sum(p.numel() for n, p in draft.named_parameters() if not n.startswith(("fc.", "embed_tokens.")))
    expected = target_weights + 2 * 10 * kv_per_token + fc + 3 * per_pass + 3 * 2 * 10 * (2 * 2 * 16)
    assert step_bytes(spec, batch=2, context_len=10) == 4 * expected
