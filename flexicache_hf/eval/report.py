"""Turns raw rows into the retention table, budget-sweep figures, JSON and a markdown section."""

from __future__ import annotations

import json
import random
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
    per_task = [len({r["index"] for r in results["tasks"] if r["task"] == t}) for t in tasks]
    return {"tasks": tasks, "counted": counted, "dense": dense, "policies": table,
            "samples": min(per_task) if per_task else 0}


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


def markdown(results: dict, cfg: EvalConfig, ret: dict, fidelity: dict, command: str, header: str) -> str:
    lines = [header, "", f"Command: `{command}`", "",
             f"Run time {results['seconds'] / 60:.1f} min. FlexiCache head profiles used: "
             + "; ".join(f"u={k}: {v}" for k, v in results["profiles_used"].items())
             + (" **Truncated by --max-minutes: " + "; ".join(results["truncated"]) + " left out.**"
                if results.get("truncated") else ""), ""]
    curve = reach_curve(results)
    if curve:
        lines += ["Dense reach (niah_single accuracy by prompt length):", "",
                  "| tokens | " + " | ".join(str(k) for k in curve) + " |",
                  "|---|" + "---|" * len(curve), "| accuracy | " + " | ".join(_fmt(v) for v in curve.values()) + " |", ""]
    tasks = ret["tasks"]
    ctx = {t: (min(v), round(mean(v)), max(v)) for t, v in _by_task_prompt_tokens(results["tasks"]).items()}
    if results["tasks"]:
        lines += _task_table(cfg, ret, tasks, ctx)
    if results["fidelity"]:
        lines += _fidelity_tables(cfg, results["fidelity"], fidelity)
    return "\n".join(lines) + "\n"


EVICTION_FAMILIES = ("streaming", "snapkv", "lserve")


def ratio_interval(nll: list[float], dense: list[float], level: float = 0.9, draws: int = 2000,
                   seed: int = 0) -> tuple[float, float] | None:
    """Bootstrap interval over documents of ``sum(nll) / sum(dense)`` (the per-document NLLs of a policy and of
    dense, paired by position): how far the NLL ratio could move with another draw of as many documents.
    ``None`` below two documents.  Seeded: the same rows give the same interval."""
    n = len(nll)
    if n < 2 or len(dense) != n:
        return None
    g = random.Random(seed)
    stats = []
    for _ in range(draws):
        idx = [g.randrange(n) for _ in range(n)]
        stats.append(sum(nll[i] for i in idx) / sum(dense[i] for i in idx))
    stats.sort()
    tail = (1 - level) / 2
    return stats[int(tail * draws)], stats[min(draws - 1, int((1 - tail) * draws))]


def fidelity_summary(rows: list[dict]) -> dict:
    """Per policy: mean NLL, its ratio to dense (with a 90 % bootstrap interval over documents), top-1 agreement,
    agreement length, ROUGE-L (when free-run)."""
    acc = defaultdict(list)
    for r in rows:
        acc[r["policy"]].append(r)
    dense = mean(r["nll"] for r in acc["dense"]) if "dense" in acc else None
    dense_of = {r["doc_index"]: r["nll"] for r in acc.get("dense", ())}
    out = {}
    for p, rs in acc.items():
        rl = [r["rouge_l"] for r in rs if "rouge_l" in r]
        nll = mean(r["nll"] for r in rs)
        paired = [r for r in rs if r["doc_index"] in dense_of]
        ci = ratio_interval([r["nll"] for r in paired], [dense_of[r["doc_index"]] for r in paired]) \
            if dense and len(paired) == len(rs) else None
        out[p] = {"family": rs[0]["family"], "budget_tokens": rs[0]["budget_tokens"], "docs": len(rs), "nll": nll,
                  "nll_ratio": nll / dense if dense else None, "nll_ratio_ci90": ci,
                  "top1_agreement": mean(r["top1_agreement"] for r in rs),
                  "agreement_length": mean(r["agreement_length"] for r in rs), "rouge_l": mean(rl) if rl else None}
        am = [r["attended_mass"] for r in rs if "attended_mass" in r]
        if am:  # the oracle's reference path: exact attention mass on the attended pages
            out[p]["attended_mass"] = mean(am)
    return out


def fidelity_margins(summary: dict) -> dict:
    """Per FlexiCache policy: its lead over each permanent-eviction baseline run at the same budget, in points
    of top-1 agreement (and of ROUGE-L when free runs were made)."""
    out = {}
    for p, row in summary.items():
        if row["family"] != "flexicache":
            continue
        base = {q: r for q, r in summary.items()
                if r["family"] in EVICTION_FAMILIES and r["budget_tokens"] == row["budget_tokens"]}
        if base:
            out[p] = {q: {"top1_points": 100 * (row["top1_agreement"] - r["top1_agreement"]),
                          "rouge_points": None if row["rouge_l"] is None or r["rouge_l"] is None
                          else 100 * (row["rouge_l"] - r["rouge_l"])} for q, r in base.items()}
    return out


def _fidelity_tables(cfg: EvalConfig, rows: list[dict], summary: dict) -> list[str]:
    docs = sorted({r["doc_index"] for r in rows})
    lines = [f"Long-generation fidelity (dense greedy continuation of {cfg.fidelity_length} tokens after "
             f"{cfg.fidelity_prompt} prompt tokens; mean over {len(docs)} documents: corpus indices "
             + ", ".join(map(str, docs)) + "):", "",
             "| policy | NLL | NLL / dense (90 % bootstrap interval over documents) | top-1 agreement | "
             "agreement length | ROUGE-L vs dense |",
             "|---|---|---|---|---|---|"]
    for p, r in summary.items():
        ratio = "–" if r["nll_ratio"] is None else f"{r['nll_ratio']:.3f}"
        ci = r.get("nll_ratio_ci90")
        if ci is not None and p != "dense":
            ratio += f" ({ci[0]:.3f}–{ci[1]:.3f})"
        lines.append(f"| {p} | {r['nll']:.3f} | {ratio} | {r['top1_agreement']:.3f} | {r['agreement_length']:.0f} | "
                     f"{_fmt(r['rouge_l'])} |")
    mass = {p: r["attended_mass"] for p, r in summary.items() if "attended_mass" in r}
    if mass:
        lines += ["", "Exact attention mass on the attended pages (softmax over every cached key; mean over decode "
                  "steps, layers, query heads and documents; dense = 1):", "",
                  "| policy | attended mass |", "|---|---|"] + [f"| {p} | {m:.3f} |" for p, m in mass.items()]
    margins = fidelity_margins(summary)
    if margins:
        lines += ["", "FlexiCache minus each permanent-eviction baseline at the same budget (points of top-1 "
                  "agreement; of ROUGE-L in brackets when free runs were made):", "",
                  "| FlexiCache policy | " + " | ".join(EVICTION_FAMILIES) + " |",
                  "|---|" + "---|" * len(EVICTION_FAMILIES)]
        for p, vs in margins.items():
            cells = []
            for fam in EVICTION_FAMILIES:
                hit = next((v for q, v in vs.items() if summary[q]["family"] == fam), None)
                if hit is None:
                    cells.append("–")
                else:
                    rp = "" if hit["rouge_points"] is None else f" ({hit['rouge_points']:+.1f})"
                    cells.append(f"{hit['top1_points']:+.1f}{rp}")
            lines.append(f"| {p} | " + " | ".join(cells) + " |")
    lines.append("")
    return lines


def _by_task_prompt_tokens(rows: list[dict]) -> dict:
    seen = {(r["task"], r["index"]): r["context_tokens"] for r in rows}
    out = defaultdict(list)
    for (task, _), n in seen.items():
        out[task].append(n)
    return out


def _task_table(cfg: EvalConfig, ret: dict, tasks, ctx) -> list[str]:
    done = ret["samples"]
    lines = [f"Task prompts ≈ {cfg.task_length} tokens, {done} samples per task"
             + (f" (indices {list(cfg.task_indices)} of the {cfg.samples} drawn)" if cfg.task_indices is not None
                else "" if done == cfg.samples else f" (of {cfg.samples} configured)")
             + (", fed as two chunks: the context, then the question (the cache holds the context before the "
                "question is known)" if cfg.question_after_context else "") + ". Cells: retention = policy "
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
    lines.append("Prompt tokens per task (min / mean / max over samples): "
                 + ", ".join(f"{t} {lo} / {m} / {hi}" for t, (lo, m, hi) in ctx.items()))
    lines.append("")
    return lines


def figures(results: dict, ret: dict, fidelity: dict, out: Path) -> list[Path]:
    """Budget sweep of mean retention per family, and fidelity NLL / ROUGE-L by token budget."""
    import matplotlib
    matplotlib.use("Agg")  # headless machines
    import matplotlib.pyplot as plt

    paths = []
    by_policy = {r["policy"]: r for r in results["tasks"]}
    if not results["tasks"]:
        return paths + _fidelity_figure(fidelity, out)
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
    return paths + _fidelity_figure(fidelity, out)


def _fidelity_figure(summary: dict, out: Path) -> list[Path]:
    """NLL and ROUGE-L (or top-1 agreement) against budget, one line per policy (its label without the budget)."""
    import matplotlib.pyplot as plt

    if not summary:
        return []
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    lines = defaultdict(list)
    for p, r in summary.items():
        if r["family"] != "dense":
            lines[p.split("@")[0]].append(r)
    for name, rows in sorted(lines.items()):
        rows.sort(key=lambda r: r["budget_tokens"])
        xs = [r["budget_tokens"] for r in rows]
        axes[0].plot(xs, [r["nll"] for r in rows], marker="o", label=name)
        right = "rouge_l" if all(r["rouge_l"] is not None for r in rows) else "top1_agreement"
        axes[1].plot(xs, [r[right] for r in rows], marker="o", label=name)
    if "dense" in summary:
        axes[0].axhline(summary["dense"]["nll"], color="grey", lw=0.8, ls="--", label="dense")
    axes[0].set_ylabel("teacher-forced NLL of the dense continuation")
    axes[1].set_ylabel("ROUGE-L vs dense (or top-1 agreement without free runs)")
    for a in axes:
        a.set_xscale("log", base=2)
        a.set_xlabel("token budget")
        a.legend(fontsize=8)
    fig.tight_layout()
    path = out / "fidelity_vs_budget.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]


def write(results: dict, cfg: EvalConfig, out: Path, command: str, header: str) -> dict:
    """JSON (raw rows + retention), figures and ``report.md`` into ``out``; returns the retention table."""
    out.mkdir(parents=True, exist_ok=True)
    ret = retention(results, cfg)
    fid = fidelity_summary(results["fidelity"])
    (out / "results.json").write_text(json.dumps({"config": {k: v for k, v in vars(cfg).items() if k != "extra"},
                                                  "command": command, "retention": ret, "fidelity_summary": fid,
                                                  "fidelity_margins": fidelity_margins(fid),
                                                  "reach": reach_curve(results), **results}, indent=1, default=str))
    figures(results, ret, fid, out)
    (out / "report.md").write_text(markdown(results, cfg, ret, fid, command, header))
    return ret
