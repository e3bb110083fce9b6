"""Human-readable summaries of generate() results and of speculative-vs-plain comparisons."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..config import DraftTargetConfig, Eagle3Config, SAConfig
from ..engine.request import GenerationOutputs

if TYPE_CHECKING:
    from ..config import RunConfig, SpecConfig
    from .comparison import Comparison


def format_outputs(outputs: GenerationOutputs, prompts: list[str] | None = None, aggregate: bool = True) -> str:
    """Each request's text (or ids), finish reason and acceptance, then (``aggregate``) the whole call's stats."""
    lines = []
    for i, out in enumerate(outputs):
        head = f"--- request {i} [{out.finish_reason}]"
        if out.error:
            lines += [head, f"error: {out.error}"]
            continue
        s = out.stats
        lines.append(f"{head} {len(out.token_ids)} tokens, {s.num_steps} steps, "
                     f"mean accepted length {s.mean_accepted_length:.2f}")
        prompt = prompts[i] if prompts else ""
        lines.append(prompt + (out.text if out.text is not None else " ".join(map(str, out.token_ids))))
    if aggregate:
        lines.append(format_stats(outputs.stats))
    return "\n".join(lines)


def format_stats(stats: dict[str, object]) -> str:
    rates = " ".join(f"{r:.2f}" for r in stats["acceptance_rate_per_position"])
    return (f"=== {stats['num_requests']} requests, {stats['num_tokens']} tokens in {stats['seconds']:.2f} s "
            f"({stats['tokens_per_second']:.1f} tok/s); mean accepted length {stats['mean_accepted_length']:.2f} "
            f"tokens/step; acceptance per draft position [{rates}]; histogram of accepted drafts "
            f"{stats['histogram']}")


def describe(spec_config: SpecConfig | None) -> str:
    """``"EAGLE-3, K=3"``, ``"MTP-Eagle, K=3"``, ``"MTP (3 modules)"``, ``"draft LM, K=3"``, ``"SA, K=8"`` (``+SA``
    for a head with use_sa_spec) or ``"plain"``."""
    if spec_config is None:
        return "plain"
    if isinstance(spec_config, DraftTargetConfig):
        return f"draft LM, K={spec_config.max_draft_len}"
    if isinstance(spec_config, SAConfig):
        return f"SA, K={spec_config.max_draft_len}"
    sa = "+SA" if spec_config.use_sa_spec else ""
    if isinstance(spec_config, Eagle3Config):
        return f"EAGLE-3{sa}, K={spec_config.max_draft_len}"
    if spec_config.use_mtp_vanilla:
        return f"MTP{sa} ({spec_config.num_nextn_predict_layers} modules)"
    return f"MTP-Eagle{sa}, K={spec_config.num_draft_tokens}"


def format_comparison(comparison: Comparison, cfg: RunConfig) -> str:
    """Both runs' speed side by side, the speedup and the acceptance that produced it."""
    spec, plain = comparison.spec.stats, comparison.plain.stats
    rows = [_speed_row("speculative", describe(cfg.spec_config), spec), _speed_row("plain", "no drafts", plain)]
    rates = " ".join(f"{r:.2f}" for r in spec["acceptance_rate_per_position"])
    if cfg.sampling.is_greedy:
        same = "yes (greedy speculative decoding is lossless)" if comparison.same_tokens else "NO"
    else:
        same = f"{'yes' if comparison.same_tokens else 'no'} (sampled at T={cfg.sampling.temperature:g}: the same " \
               "distribution, other draws)"
    return "\n".join([
        "=== speculative vs plain decoding: same prompts, engine and sampling",
        *rows,
        f"speedup {comparison.speedup:.2f}x; mean accepted length {spec['mean_accepted_length']:.2f} tokens/step; "
        f"acceptance per draft position {rates}; steps accepting 0..K drafts {spec['histogram']}",
        f"identical outputs: {same}"])


def _speed_row(name: str, what: str, stats: dict[str, object]) -> str:
    return (f"{name:<12} {what:<16} {stats['num_tokens']:>5} tokens in {stats['seconds']:6.2f} s "
            f"{stats['tokens_per_second']:8.1f} tok/s   decode step {stats['step_ms']:7.2f} ms   "
            f"{stats['mean_accepted_length']:.2f} tokens/step")
