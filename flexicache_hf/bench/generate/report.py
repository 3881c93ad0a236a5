"""What a run reports: the ratio columns, the table printed last and the figure beside the JSON."""

from __future__ import annotations

from pathlib import Path

import torch

from .rows import is_compiled


def add_ratios(results: list[dict]) -> None:
    """Per case: each row's median step against ``dynamic``'s and against the best (lowest) ``static*`` row's."""
    for case in dict.fromkeys(r["case"] for r in results):
        rows = [r for r in results if r["case"] == case and r.get("median_step_ms")]
        dyn = next((r["median_step_ms"] for r in rows if r["row"] == "dynamic"), None)
        statics = [r for r in rows if is_compiled(r["row"]) and r["row"].startswith("static")]
        best = min(statics, key=lambda r: r["median_step_ms"]) if statics else None
        for r in rows:
            r["median_vs_dynamic"] = r["median_step_ms"] / dyn if dyn else None
            r["median_vs_best_static"] = r["median_step_ms"] / best["median_step_ms"] if best else None
            r["best_static_row"] = best["row"] if best else None


def batch_throughput(res: dict) -> dict:
    """A measured row's tokens a second over its whole batch (the throughput table's measure): ``batch_decode_
    tokens_per_s``, its decode steps' tokens (rows x steps a second), and ``batch_tokens_per_s``, every new token of
    every row over the whole call, the prefill counted.  Empty for a record without the fields."""
    b, tokens, total = res.get("batch"), res.get("tokens"), res.get("total_s")
    out = {}
    if b and res.get("decode_tokens_per_s"):
        out["batch_decode_tokens_per_s"] = b * res["decode_tokens_per_s"]
    if b and tokens and total:
        out["batch_tokens_per_s"] = b * tokens / total
    return out


def format_table(results: list[dict]) -> str:
    """The table printed last (``add_ratios`` first for the two ratio columns)."""
    def num(v, fmt, scale=1.0):
        if not isinstance(v, (int, float)):
            return "-".rjust(int("".join(ch for ch in fmt.split(".")[0] if ch.isdigit()) or 0))
        return format(v / scale if scale != 1.0 else v, fmt)

    head = (f"{'case':<12} {'row':<24} {'TTFT s':>7} {'med ms':>8} {'p99 ms':>8} {'dec tok/s':>9} {'peak GB':>8} "
            f"{'pin GB':>7} {'med/dyn':>8} {'med/static':>10} {'busy':>5} {'graphs+':>7}")
    lines = [head]
    best: dict[str, str] = {}
    searches = []
    for r in results:
        if "largest_batch" in r:
            searches.append(r)
            continue
        if "error" in r:
            lines.append(f"{r['case']:<12} {r['row']:<24} error: {r['error'][:100]}")
            continue
        if r.get("best_static_row"):
            best[r["case"]] = r["best_static_row"]
        busy = r.get("gpu_busy_fraction")  # absent unless profiled
        lines.append(
            f"{r['case']:<12} {r['row']:<24} {num(r.get('ttft_s'), '7.2f')} {num(r.get('median_step_ms'), '8.2f')} "
            f"{num(r.get('p99_step_ms'), '8.2f')} {num(r.get('decode_tokens_per_s', r.get('tokens_per_s')), '9.1f')} "
            f"{num(r.get('peak_gpu_bytes'), '8.1f', 1e9)} {num(r.get('pinned_bytes'), '7.1f', 1e9)} "
            f"{num(r.get('median_vs_dynamic'), '8.2f')} {num(r.get('median_vs_best_static'), '10.2f')} "
            f"{num(busy, '5.0%')} {num(r.get('dynamo_graphs_added'), '7d')}")
    if best:
        lines.append("med/dyn: median step / dynamic's; med/static: median step / the best static row's ("
                     + ", ".join(f"{c}: {b}" for c, b in best.items()) + "); busy: GPU busy fraction of the "
                     "profiled decode steps; graphs+: dynamo graphs compiled during the measured call; prompt-lookup rows: "
                     "tok/s over the whole call, no step times")
    for r in results:
        if r.get("largest_batch_row"):
            t = batch_throughput(r)
            lines.append(f"{r['case']:<12} {r['row']:<24} at its largest batch: "
                         f"{t.get('batch_decode_tokens_per_s', 0):.0f} decode tokens/s, "
                         f"{t.get('batch_tokens_per_s', 0):.1f} with the prefill")
    for r in searches:
        tried = ", ".join(f"{b}: {'ok' if v == 'ok' else 'fail'}"
                          for b, v in sorted(r["tried"].items(), key=lambda kv: int(kv[0])))
        lines.append(f"{r['case']:<12} {r['row']:<24} largest batch {r['largest_batch']} (tried {tried})")
    return "\n".join(lines)


def figure(results: list[dict], path: Path, device: str | None = None) -> None:
    """The figure beside the JSON: decode steps and time to first token by case and row, and with rows measured at
    their largest batch a third panel, their whole batch's tokens a second (``device``: the title's GPU, default
    this process's)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in results if r.get("median_step_ms")]
    cases = list(dict.fromkeys(r["case"] for r in timed))
    rows = list(dict.fromkeys(r["row"] for r in timed))
    if not cases:
        return
    tput = [r for r in timed if r.get("largest_batch_row")]
    fig, axes = plt.subplots(1, 3 if tput else 2, figsize=(19 if tput else 13, 4.5))
    width = 0.8 / max(len(rows), 1)
    for ax, key, label in ((axes[0], "median_step_ms", "decode step (ms): bar median, marker p99"),
                           (axes[1], "ttft_s", "time to first token (s)")):
        for j, row in enumerate(rows):
            xs, vals, p99 = [], [], []
            for i, c in enumerate(cases):
                r = next((r for r in timed if r["case"] == c and r["row"] == row), None)
                if r is not None and r.get(key):
                    xs.append(i + j * width)
                    vals.append(r[key])
                    p99.append(r.get("p99_step_ms"))
            bars = ax.bar(xs, vals, width, label=row)
            if key == "median_step_ms":
                pts = [(x, p) for x, p in zip(xs, p99) if p]
                if pts:
                    ax.plot([x for x, _ in pts], [p for _, p in pts], linestyle="none", marker="_", markersize=9,
                            markeredgewidth=2, color=bars.patches[0].get_facecolor() if bars.patches else "k")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))], cases)
        ax.set_yscale("log")
        ax.set_ylabel(label)
    if tput:  # the throughput table: each row at its own largest batch
        ax = axes[2]
        names = [f"{r['row']}\n{r['batch']} rows" for r in tput]
        got = [batch_throughput(r) for r in tput]
        ax.bar(range(len(tput)), [g.get("batch_decode_tokens_per_s", 0) for g in got], 0.6, label="decoding")
        ax.plot(range(len(tput)), [g.get("batch_tokens_per_s", 0) for g in got], linestyle="none", marker="o",
                color="k", label="with the prefill")
        ax.set_xticks(range(len(tput)), names, fontsize=7)
        ax.set_ylabel("tokens/s, whole batch, at each row's largest batch")
        ax.legend(fontsize=7)
    axes[0].legend(fontsize=7, ncol=2)
    device = device or (torch.cuda.get_device_name() if torch.cuda.is_available() else "CUDA")
    fig.suptitle(f"model.generate end to end ({device}); missing bars: error / out of memory")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
