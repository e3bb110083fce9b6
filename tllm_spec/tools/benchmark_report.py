"""The benchmark's report: its markdown table and its plots (scripts/benchmark.py writes them beside its JSON)."""
from __future__ import annotations

from pathlib import Path


def table(results: dict) -> str:
    tp = results.get("tensor_parallel_size", 1)
    gpus = f"{tp} x {results['gpu']} (tensor parallel)" if tp > 1 else results["gpu"]
    moe = results.get("moe")
    weights = "FP8 target (variant default; the bf16 target: variant bf16)" if results.get("quantization") else "bf16"
    if results.get("kv_cache_dtype") == "fp8":
        weights += ", FP8 KV cache (variant default; a bf16 one: variant bf16)"
    lines = [(f"{gpus}, {results['shape']} random weights, {weights}, K={results['k']}, prompt "
              f"{results['prompt_len']}, {results['new_tokens']} new tokens, {results['date']}; GEMV bandwidth "
              f"{results['bandwidth_bytes_per_s']['gemv'] / 1e12:.2f} TB/s"),
             ("| variant | mode | batch | forced drafts | tokens/step | step ms | tok/s | roofline tok/s | of roofline "
              "| host ms |") + (" experts/layer |" if moe else ""),
             "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if moe else "")]
    if moe:
        lines.insert(1, f"{moe['num_moe_layers']} MoE layers of {moe['num_experts']} experts, top-{moe['top_k']}: "
                        "the roofline reads each layer's distinct experts per step (experts/layer)")
    for p in results["points"]:
        experts = f" {p['distinct_experts_per_layer']:.1f} |" if moe else ""
        lines.append(f"| {p.get('variant', 'default')} | {p['mode']} | {p['batch']} | "
                     f"{p['forced_drafts'] if p['forced_drafts'] is not None else '-'} "
                     f"| {p['tokens_per_step']:.2f} | {p['step_ms']:.2f} | {p['tokens_per_second']:.1f} | "
                     f"{p['roofline_tokens_per_second']:.1f} | {p['roofline_fraction']:.1%} | "
                     f"{p['host_ms_per_step']:.3f} |{experts}")
    for h in results["hf"]:
        name = "HF generate" + (" (static cache)" if h["static_cache"] else "") + (
            f" experts={h['experts_implementation']}" if h.get("experts_implementation") else "")
        tps = f"{h['tokens_per_second']:.1f}" if "tokens_per_second" in h else "failed"
        lines.append(f"| {name} | - | {h['batch']} | - | 1 | - | {tps} | - | - | - |" + (" - |" if moe else ""))
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: plot skipped (pip install matplotlib; then --plot-only)")
        return
    batches = sorted({p["batch"] for p in results["points"]})
    variants = list(dict.fromkeys(p.get("variant", "default") for p in results["points"]))
    panels = len(batches) + (len(variants) > 1)
    fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 3.8), squeeze=False)
    if len(variants) > 1:
        plot_variants(axes[0][-1], results["points"], variants, results["k"])
    for ax, batch in zip(axes[0], batches):
        default = [p for p in results["points"] if p.get("variant", "default") == "default"]
        spec = sorted((p for p in default if p["batch"] == batch and p["mode"] != "none"),
                      key=lambda p: p["forced_drafts"])
        x = [p["forced_drafts"] for p in spec]
        ax.plot(x, [p["tokens_per_second"] for p in spec], "o-", label=f"{results.get('spec', 'eagle3')} (measured)")
        ax.plot(x, [p["roofline_tokens_per_second"] for p in spec], "--", color="grey", label="memory roofline")
        for p in default:
            if p["batch"] == batch and p["mode"] == "none":
                ax.axhline(p["tokens_per_second"], color="C1", label="no speculation (same engine)")
        hf_rows = [h for h in results["hf"] if "tokens_per_second" in h]  # failed runs have none
        for i, h in enumerate(hf_rows):
            if h["batch"] == batch:
                ax.axhline(h["tokens_per_second"], color=f"C{2 + i % 8}", linestyle=":",
                           label="HF generate" + (" static cache" if h["static_cache"] else "") + (
                               f" ({h['experts_implementation']} experts)" if h.get("experts_implementation") else ""))
        ax.set_title(f"batch {batch}")
        ax.set_xlabel("accepted drafts per step (forced)")
        ax.set_ylabel("tokens / s")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    weights = ("FP8" + (" and bf16" if "bf16" in variants else "")) if results.get("quantization") else "bf16"
    weights += ", FP8 KV" if results.get("kv_cache_dtype") == "fp8" else ""
    fig.suptitle(f"{results['gpu']} — {results['shape']} {weights}, K={results['k']} ({results['date']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def plot_variants(ax, points: list[dict], variants: list[str], k: int) -> None:
    """Variants side by side (--compare-eager: each fast-path step against the stock HF layers; --quantization:
    the FP8 target against the bf16 one): tok/s, no speculation and EAGLE-3 with K forced, per batch size,
    relative to the last variant."""
    def speeds(variant: str) -> dict[tuple[str, int], float]:
        return {(p["mode"], p["batch"]): p["tokens_per_second"] for p in points if p.get("variant") == variant
                and (p["mode"] == "none" or p["forced_drafts"] == k)}

    base = variants[-1]
    by_variant = {variant: speeds(variant) for variant in variants}
    groups = [(mode, batch) for mode in dict.fromkeys(p["mode"] for p in points) for batch in sorted({p["batch"] for p in points})
              if all((mode, batch) in v for v in by_variant.values())]  # a cut-short run lacks some points
    width = 0.8 / len(variants)
    for i, variant in enumerate(variants):
        ax.bar([g + i * width for g in range(len(groups))],
               [by_variant[variant][g] / by_variant[base][g] for g in groups], width, label=variant)
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))],
                  [f"{'plain' if m == 'none' else f'EAGLE-3 {k}/{k}'}\nbatch {b}" for m, b in groups], fontsize=7)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_ylabel(f"speed relative to {base}")
    ax.set_title("each step of the fast path")
    ax.legend(fontsize=7)
