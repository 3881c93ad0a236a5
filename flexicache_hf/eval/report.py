"""Turns raw rows into the retention table, budget-sweep figures, JSON and a markdown section."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from statistics import mean

from .grids import EvalConfig


def _mean_by(rows, *keys) -> dict:
    acc = defaultdict(list)
    for r in rows:
        acc[tuple(r[k] for k in keys)].append(r["score"])
    return {k: mean(v) for k, v in acc.items()}


def retention(results: dict, cfg: EvalConfig) -> dict:
    """Per policy: score / dense score per task, and the mean over tasks where dense reaches ``dense_floor``."""
    scores = _mean_by(results["tasks"], "policy", "task")
    tasks = list(dict.fromkeys(r["task"] for r in results["tasks"]))
    policies = list(dict.fromkeys(r["policy"] for r in results["tasks"]))
    dense = {t: scores.get(("dense", t), 0.0) for t in tasks}
    counted = [t for t in tasks if dense[t] >= cfg.dense_floor]
    table = {}
    for p in policies:
        per = {t: (scores[(p, t)] / dense[t] if dense[t] > 0 else None) for t in tasks}
        table[p] = {"score": {t: scores[(p, t)] for t in tasks}, "retention": per,
                    "mean_retention": mean(per[t] for t in counted) if counted else None}
    return {"tasks": tasks, "counted": counted, "dense": dense, "policies": table}


def reach_curve(results: dict) -> dict:
    acc = defaultdict(list)
    for r in results["reach"]:
        # By requested length: the prompts built for it land within a paragraph of it.
        acc[r.get("target_tokens", r["context_tokens"])].append(r["score"])
    return {k: mean(v) for k, v in sorted(acc.items())}


def _fmt(x, pct=False) -> str:
    if x is None:
        return "–"
    return f"{100 * x:.0f}%" if pct else f"{x:.2f}"


def markdown(results: dict, cfg: EvalConfig, ret: dict, command: str, header: str) -> str:
    lines = [header, "", f"Command: `{command}`", "",
             f"Run time {results['seconds'] / 60:.1f} min. FlexiCache head profiles used: "
             + "; ".join(f"u={k}: {v}" for k, v in results["profiles_used"].items())
             + (" **Truncated by --max-minutes: fewer samples than configured.**" if results.get("truncated") else ""), ""]
    curve = reach_curve(results)
    if curve:
        lines += ["Dense reach (niah_single accuracy by prompt length):", "",
                  "| tokens | " + " | ".join(str(k) for k in curve) + " |",
                  "|---|" + "---|" * len(curve), "| accuracy | " + " | ".join(_fmt(v) for v in curve.values()) + " |", ""]
    tasks = ret["tasks"]
    ctx = {r["task"]: r["context_tokens"] for r in results["tasks"]}
    if results["tasks"]:
        lines += _task_table(cfg, ret, tasks, ctx)
    if results["fidelity"]:
        lines += [f"Long-generation fidelity (dense greedy continuation of {cfg.fidelity_length} tokens after "
                  f"{cfg.fidelity_prompt} prompt tokens, mean over documents):", "",
                  "| policy | NLL | top-1 agreement | agreement length | ROUGE-L vs dense |", "|---|---|---|---|---|"]
        acc = defaultdict(list)
        for r in results["fidelity"]:
            acc[r["policy"]].append(r)
        for p, rows in acc.items():
            rl = [r["rouge_l"] for r in rows if "rouge_l" in r]
            lines.append(f"| {p} | {mean(r['nll'] for r in rows):.3f} | {mean(r['top1_agreement'] for r in rows):.3f} | "
                         f"{mean(r['agreement_length'] for r in rows):.0f} | {_fmt(mean(rl)) if rl else '–'} |")
    return "\n".join(lines) + "\n"


def _task_table(cfg: EvalConfig, ret: dict, tasks, ctx) -> list[str]:
    lines = [f"Task prompts ≈ {cfg.task_length} tokens, {cfg.samples} samples per task. Cells: retention = policy "
              f"score / dense score. Tasks with dense < {cfg.dense_floor} are shown (marked *) but not in the mean.", "",
              "| policy | " + " | ".join(t + ("" if t in ret["counted"] else "*") for t in tasks) + " | mean |",
              "|---|" + "---|" * (len(tasks) + 1),
              "| dense (score) | " + " | ".join(_fmt(ret["dense"][t]) for t in tasks) + " | |"]
    for p, row in ret["policies"].items():
        if p == "dense":
            continue
        lines.append(f"| {p} | " + " | ".join(_fmt(row["retention"][t], True) for t in tasks)
                     + f" | **{_fmt(row['mean_retention'], True)}** |")
    lines.append("")
    lines.append("Prompt tokens per task: " + ", ".join(f"{t} {n}" for t, n in ctx.items()))
    lines.append("")
    return lines


def figures(results: dict, ret: dict, out: Path) -> list[Path]:
    """Budget sweep of mean retention per family, and fidelity NLL / ROUGE-L by token budget."""
    import matplotlib
    matplotlib.use("Agg")  # headless machines
    import matplotlib.pyplot as plt

    paths = []
    by_policy = {r["policy"]: r for r in results["tasks"]}
    fig, ax = plt.subplots(figsize=(6, 4))
    series = defaultdict(list)
    for p, row in ret["policies"].items():
        r = by_policy[p]
        if p == "dense" or row["mean_retention"] is None:
            continue
        if r["family"] == "flexicache" and (r["rerank_interval"], r["unstable_fraction"]) != (16, 0.25):
            continue  # the sweeps are tables, not lines
        series[p.split("@")[0]].append((r["budget"], row["mean_retention"]))
    for name, pts in sorted(series.items()):
        pts.sort()
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("token budget (fraction of the prompt)")
    ax.set_ylabel("mean retention (policy / dense)")
    ax.axhline(1.0, color="grey", lw=0.5)
    if series:  # empty when dense scored below the floor on every task
        ax.legend(fontsize=8)
    ax.set_title("Task accuracy retention vs budget")
    fig.tight_layout()
    paths.append(out / "retention_vs_budget.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    if results["fidelity"]:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        fam = defaultdict(lambda: defaultdict(list))
        dense_nll = mean(r["nll"] for r in results["fidelity"] if r["family"] == "dense")
        for r in results["fidelity"]:
            if r["family"] != "dense":
                fam[r["family"]][r["budget_tokens"]].append(r)
        for name, pts in sorted(fam.items()):
            xs = sorted(pts)
            axes[0].plot(xs, [mean(r["nll"] for r in pts[x]) for x in xs], marker="o", label=name)
            if all("rouge_l" in r for x in xs for r in pts[x]):
                axes[1].plot(xs, [mean(r["rouge_l"] for r in pts[x]) for x in xs], marker="o", label=name)
            else:
                axes[1].plot(xs, [mean(r["top1_agreement"] for r in pts[x]) for x in xs], marker="o", label=name)
        axes[0].axhline(dense_nll, color="grey", lw=0.8, ls="--", label="dense")
        axes[0].set_ylabel("teacher-forced NLL of the dense continuation")
        axes[1].set_ylabel("ROUGE-L vs dense (or top-1 agreement without free runs)")
        for a in axes:
            a.set_xscale("log", base=2)
            a.set_xlabel("token budget")
            a.legend(fontsize=8)
        fig.tight_layout()
        paths.append(out / "fidelity_vs_budget.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths


def write(results: dict, cfg: EvalConfig, out: Path, command: str, header: str) -> dict:
    """JSON (raw rows + retention), figures and ``report.md`` into ``out``; returns the retention table."""
    out.mkdir(parents=True, exist_ok=True)
    ret = retention(results, cfg)
    (out / "results.json").write_text(json.dumps({"config": {k: v for k, v in vars(cfg).items() if k != "extra"},
                                                  "command": command, "retention": ret,
                                                  "reach": reach_curve(results), **results}, indent=1, default=str))
    figures(results, ret, out)
    (out / "report.md").write_text(markdown(results, cfg, ret, command, header))
    return ret
