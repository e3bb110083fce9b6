"""Human-readable summaries of generate() results."""
from __future__ import annotations

from .engine import GenerationOutputs


def format_outputs(outputs: GenerationOutputs, prompts: list[str] | None = None) -> str:
    """Each request's text (or ids), finish reason and acceptance, then the aggregate."""
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
    lines.append(format_stats(outputs.stats))
    return "\n".join(lines)


def format_stats(stats: dict[str, object]) -> str:
    rates = " ".join(f"{r:.2f}" for r in stats["acceptance_rate_per_position"])
    return (f"=== {stats['num_requests']} requests, {stats['num_tokens']} tokens in {stats['seconds']:.2f} s "
            f"({stats['tokens_per_second']:.1f} tok/s); mean accepted length {stats['mean_accepted_length']:.2f} "
            f"tokens/step; acceptance per draft position [{rates}]; histogram of accepted drafts "
            f"{stats['histogram']}")
