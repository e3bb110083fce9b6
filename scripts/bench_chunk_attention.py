"""A prompt chunk's attention after a cached prefix, on the fast SDPA kernels: which call shapes run at the square
causal call's speed. One layer, Llama-3.1-8B heads (32 query, 8 KV, head_dim 128), bf16, K/V already gathered.

    python scripts/bench_chunk_attention.py --chunk 8192 --prefix 8192 24576

Candidates (each checked against an fp32 reference on the chunk's last rows, then timed with CUDA events):
- ``lower_right``: one SDPA call with a lower-right causal bias over prefix + chunk (K/V repeated to the query
  heads), in blocks of 2048 query rows: the current path;
- ``square``: the square causal call of a whole prompt of chunk length (the speed to match; not a chunk's result);
- ``split_<backend>``: the chunk's own keys by a square causal call and the prefix by a non-causal call, each
  returning its log-sum-exp, merged (backend: cudnn, flash): ``tllm_spec.model.prompt_attention``'s own split path;
- ``varlen``: torch's variable-length flash attention with different query and key lengths (bottom-right causal).
"""
from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from tllm_spec.model import prompt_attention as attention

HQ, HKV, D = 32, 8, 128


def _repeat(x: torch.Tensor) -> torch.Tensor:  # [1, Hkv, S, D] -> [1, Hq, S, D]
    return x.repeat_interleave(HQ // HKV, dim=1)


def lower_right(q, k, v, prefix):
    out = torch.empty_like(q)
    kr, vr = _repeat(k), _repeat(v)
    n = q.shape[2]
    for first in range(0, n, 2048):
        last = min(n, first + 2048)
        keys = prefix + last
        out[:, :, first:last] = F.scaled_dot_product_attention(
            q[:, :, first:last], kr[:, :, :keys], vr[:, :, :keys], attn_mask=causal_lower_right(last - first, keys))
    return out


def square(q, k, v, prefix):
    return F.scaled_dot_product_attention(q, k[:, :, prefix:], v[:, :, prefix:], is_causal=True, enable_gqa=True)


def split(backend: str):
    """The package's split path (:func:`attention_with_lse` on ``backend``, :func:`merge_by_lse`)."""
    def run(q, k, v, prefix):
        attention._LSE_BACKENDS["cuda"] = backend
        kr, vr = _repeat(k), _repeat(v)
        own = attention.attention_with_lse(q, kr[:, :, prefix:], vr[:, :, prefix:], True, D ** -0.5)
        before = attention.attention_with_lse(q, kr[:, :, :prefix], vr[:, :, :prefix], False, D ** -0.5)
        return attention.merge_by_lse(*own, *before)
    return run


def varlen(q, k, v, prefix):
    from torch.nn.attention.varlen import varlen_attn
    n, s = q.shape[2], k.shape[2]
    cu_q = torch.tensor([0, n], dtype=torch.int32, device=q.device)
    cu_k = torch.tensor([0, s], dtype=torch.int32, device=q.device)
    kw = {"window_size": (-1, 0)} if "window_size" in varlen_attn.__code__.co_varnames else {"is_causal": True}
    qq, kk, vv = q[0].transpose(0, 1), _repeat(k)[0].transpose(0, 1), _repeat(v)[0].transpose(0, 1)
    return varlen_attn(qq.contiguous(), kk.contiguous(), vv.contiguous(), cu_q, cu_k, n, s, **kw
                       ).transpose(0, 1)[None]


def reference(q, k, v, prefix, rows: int):
    """fp32 attention of the chunk's last ``rows`` queries (query i of the chunk sees keys 0 .. prefix + i)."""
    n = q.shape[2]
    qs = q[:, :, n - rows:].float()
    kr, vr = _repeat(k).float(), _repeat(v).float()
    scores = qs @ kr.transpose(-1, -2) / math.sqrt(D)
    qpos = prefix + torch.arange(n - rows, n, device=q.device)
    visible = torch.arange(k.shape[2], device=q.device)[None, :] <= qpos[:, None]
    return (scores.masked_fill(~visible, float("-inf")).softmax(-1) @ vr)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--prefix", type=int, nargs="+", default=[8192, 24576])
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    candidates = {"lower_right": lower_right, "square": square, "split_cudnn": split("cudnn"),
                  "split_flash": split("flash"), "varlen": varlen}
    for prefix in args.prefix:
        n = args.chunk
        q = torch.randn(1, HQ, n, D, device=dev, dtype=dt)
        k = torch.randn(1, HKV, prefix + n, D, device=dev, dtype=dt)
        v = torch.randn(1, HKV, prefix + n, D, device=dev, dtype=dt)
        ref = reference(q, k, v, prefix, 256)
        flops = 4 * HQ * D * (n * prefix + n * (n + 1) / 2)
        for name, fn in candidates.items():
            try:
                out = fn(q, k, v, prefix)
                err = "-" if name == "square" else f"{(out[:, :, -256:].float() - ref).abs().max().item():.3g}"
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(args.iters):
                    fn(q, k, v, prefix)
                end.record()
                end.synchronize()
                ms = start.elapsed_time(end) / args.iters
                work = 4 * HQ * D * n * (n + 1) / 2 if name == "square" else flops
                ran = f" (ran on {attention._LSE_BACKENDS['cuda']})" if name.startswith("split") else ""
                print(f"chunk {n} after {prefix}: {name:16s} {ms:8.2f} ms {work / ms / 1e9:7.1f} TFLOP/s "
                      f"max err {err}{ran}", flush=True)
            except Exception as exc:  # a backend this torch or GPU lacks
                print(f"chunk {n} after {prefix}: {name:16s} failed: {type(exc).__name__}: {str(exc)[:200]}",
                      flush=True)


if __name__ == "__main__":
    main()
