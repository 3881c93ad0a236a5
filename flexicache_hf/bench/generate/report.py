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
    for r in searches:
        tried = ", ".join(f"{b}: {'ok' if v == 'ok' else 'fail'}"
                          for b, v in sorted(r["tried"].items(), key=lambda kv: int(kv[0])))
        lines.append(f"{r['case']:<12} {r['row']:<24} largest batch {r['largest_batch']} (tried {tried})")
    return "\n".join(lines)


def figure(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in results if r.get("median_step_ms")]
    cases = list(dict.fromkeys(r["case"] for r in timed))
    rows = list(dict.fromkeys(r["row"] for r in timed))
    if not cases:
        return
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
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
    axes[0].legend(fontsize=7, ncol=2)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CUDA"
    fig.suptitle(f"model.generate end to end ({device}); missing bars: error / out of memory")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
