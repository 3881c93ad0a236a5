"""The head-stability profiler (paper §2.2-2.3): run prompts, record per-step top-K pages, classify heads.

For every sample the model decodes greedily and **densely**: the FlexiCache used for profiling re-ranks
every head at every step (``HeadProfile.all_unstable``) and its token budget covers every page, so
attention is exact and the observer sees each (layer, KV head)'s page scores at every decode step.  The
profiler then takes its own top-K (K = ``k_pages``, the profiling budget, usually far smaller than the
context) from those scores with the cache's own rule (``select_pages``: the newest page always counts).
That is the paper's recording: top-K of a dense model, not of a model already made sparse.

Optionally (``oracle=True``) the top-K of the *true* attention mass per page is recorded too, so the
Quest-estimated unstable sets can be compared with the ones exact attention would give.

Memory stays bounded: a sample's selections live in a :class:`SelectionRecord` (O(D·L·H·K) ints) only
until its TS windows are computed; the result keeps only TS arrays and RCO sums.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..cache import FlexiCache
from ..config import FlexiCacheConfig
from ..head_profile import HeadProfile, ModelIdentity
from ..hf_compat import generate_cache_kwarg
from ..kernels.reference import select_pages
from ..pages import num_pages
from ..rerank import RerankEvent, SelectionObserver
from .metrics import classify_unstable, cross_task_overlap, num_unstable, rco_by_offset, temporal_stability, window_starts
from .record import SelectionRecord
from .tasks import ProfilingTask, Sample, get_tasks


# ------------------------------------------------------------------------------------------ recording
class _Recorder(SelectionObserver):
    """Turns the cache's re-rank events into top-``k`` SelectionRecords (estimated and, optionally, oracle)."""

    def __init__(self, num_layers: int, num_kv_heads: int, k: int, oracle_scaling: Mapping[int, float] | None,
                 on_step=None):
        self.num_layers, self.num_kv_heads, self.k = num_layers, num_kv_heads, k
        self.estimated = SelectionRecord(num_layers, num_kv_heads, k)
        self.oracle = SelectionRecord(num_layers, num_kv_heads, k) if oracle_scaling is not None else None
        self.scaling = oracle_scaling
        self.on_step = on_step
        # Set right after the cache is built: the event does not carry the layer, and the oracle needs its
        # dense keys (FlexiCacheLayer.gather_tokens).
        self.cache: FlexiCache | None = None

    def on_rerank(self, event: RerankEvent) -> None:
        if event.scores.shape[0] != 1:
            raise ValueError("the profiler records one sequence at a time (batch size 1)")
        if event.heads.numel() != self.num_kv_heads:
            raise RuntimeError("profiling needs every head re-ranked every step (HeadProfile.all_unstable)")
        heads = event.heads.cpu()
        est = torch.empty((self.num_kv_heads, self.k), dtype=torch.long)
        est[heads] = select_pages(event.scores, self.k)[0].cpu()
        self.estimated.append(event.step, event.layer_idx, est, event.num_pages)
        if self.oracle is not None:
            mass = self._attention_mass(event)  # [H, num_pages]
            orc = torch.empty_like(est)
            orc[heads] = select_pages(mass[event.heads][None], self.k)[0].cpu()
            self.oracle.append(event.step, event.layer_idx, orc, event.num_pages)
        if self.on_step is not None and event.layer_idx == self.num_layers - 1:
            self.on_step()

    def _attention_mass(self, event: RerankEvent) -> torch.Tensor:
        """True softmax attention mass per page ``[H, num_pages]``; the max over the group's query heads.

        Max over the group mirrors how ``page_scores`` bounds a KV head (a page any query head of the group
        needs is needed).  Costs one dense gather of the layer's keys, hence only with ``oracle=True``.
        """
        layer = self.cache.layers[event.layer_idx]
        keys, _ = layer.gather_tokens(layer.seq_len)  # [1, H, L, D], this step's token included
        q = event.query.float()
        B, Hq, D = q.shape
        H, L = keys.shape[1], keys.shape[2]
        logits = torch.einsum("bhgd,bhld->bhgl", q.view(B, H, Hq // H, D), keys.float())
        logits = logits * self.scaling.get(event.layer_idx, D ** -0.5)
        o = layer.origin  # the cache's pages start o positions before the first token (layer/schedule.py)
        lo = int(layer.storage.valid_lo[0]) - o  # left padding (none for a single prompt, but be exact)
        if lo:
            logits[..., :lo] = float("-inf")
        p = torch.softmax(logits, dim=-1)
        ps = layer.config.page_size
        n = num_pages(o + L, ps)
        p = torch.nn.functional.pad(p, (o, n * ps - L - o))
        return p.view(B, H, -1, n, ps).sum(-1).amax(2)[0]


def _attention_scaling(model) -> dict[int, float]:
    """Softmax scale of each decoder layer's attention module (falls back to head_dim**-0.5 when absent)."""
    out = {}
    for module in model.modules():
        idx, scale = getattr(module, "layer_idx", None), getattr(module, "scaling", None)
        if isinstance(idx, int) and isinstance(scale, (int, float)):
            out.setdefault(idx, float(scale))
    return out


# ------------------------------------------------------------------------------------------- results
def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


@dataclass
class SampleInfo:
    task: str
    doc_id: str
    title: str
    prompt_tokens: int
    decode_steps: int
    seconds: float
    generated: str | None = None  # start of the greedy continuation (a sanity check of the run)


@dataclass
class _Accumulator:
    """TS windows and RCO-by-offset sums of one estimator (Quest scores or oracle) over samples."""

    ts: dict[str, list[np.ndarray]] = field(default_factory=dict)  # task -> per-sample [S, L, H]
    rco_sum: np.ndarray | None = None  # [W-1, L, H] summed over windows
    windows: int = 0

    def add(self, task: str, record: SelectionRecord, window: int) -> None:
        self.ts.setdefault(task, []).append(temporal_stability(record, window))
        n = len(window_starts(record.num_steps, window))
        if n:
            part = rco_by_offset(record, window) * n
            self.rco_sum = part if self.rco_sum is None else self.rco_sum + part
            self.windows += n


@dataclass
class EstimatorResult:
    """Per-task and pooled classification for one page-ranking method."""

    task_unstable: dict[str, frozenset]  # task -> unstable set
    task_mean_ts: dict[str, np.ndarray]  # task -> [L, H]
    overlap_names: list[str]
    overlap: np.ndarray  # [T, T] |A_i ∩ A_j| / |A|
    unstable: frozenset  # pooled over every sample of every task
    counts: np.ndarray  # [L, H] windows in the bottom fraction (pooled)
    mean_ts: np.ndarray  # [L, H] (pooled)
    rco_by_offset: np.ndarray  # [W-1, L, H] mean over all windows

    @property
    def mean_offdiagonal_overlap(self) -> float | None:
        """The paper's "average overlap across tasks" (mean of the off-diagonal entries); None for one task."""
        n = self.overlap.shape[0]
        if n < 2:
            return None
        return float(self.overlap[~np.eye(n, dtype=bool)].mean())

    @classmethod
    def build(cls, acc: _Accumulator, fraction: float) -> "EstimatorResult":
        per_task = {t: classify_unstable(ts, fraction) for t, ts in acc.ts.items()}
        pooled = classify_unstable([a for ts in acc.ts.values() for a in ts], fraction)
        names, mat = cross_task_overlap({t: c.unstable for t, c in per_task.items()})
        return cls({t: c.unstable for t, c in per_task.items()}, {t: c.mean_ts for t, c in per_task.items()},
                   names, mat, pooled.unstable, pooled.counts, pooled.mean_ts, acc.rco_sum / acc.windows)

    def to_dict(self) -> dict:
        def heads(s):
            return [list(h) for h in sorted(s)]
        return {
            "unstable_heads": heads(self.unstable),
            "task_unstable_heads": {t: heads(s) for t, s in self.task_unstable.items()},
            "cross_task_overlap": {"tasks": self.overlap_names, "matrix": np.round(self.overlap, 4).tolist(),
                                   "mean_offdiagonal": _round(self.mean_offdiagonal_overlap)},
            "mean_ts": np.round(self.mean_ts, 4).tolist(),
            "bottom_counts": self.counts.tolist(),
            "task_mean_ts": {t: np.round(v, 4).tolist() for t, v in self.task_mean_ts.items()},
            "rco_by_offset_layer_mean": np.round(np.nanmean(self.rco_by_offset, axis=2), 4).tolist(),
        }


@dataclass
class ProfileResult:
    profile: HeadProfile  # the product: Quest-estimated, pooled over all samples
    estimated: EstimatorResult
    oracle: EstimatorResult | None
    samples: list[SampleInfo]
    settings: dict[str, Any]
    seconds: float

    def agreement(self) -> dict[str, float] | None:
        """|A_est ∩ A_oracle| / |A| per task and pooled ("all"): does Quest scoring find the same heads?"""
        if self.oracle is None:
            return None
        m = len(self.estimated.unstable)
        out = {t: len(self.estimated.task_unstable[t] & self.oracle.task_unstable[t]) / m
               for t in self.estimated.task_unstable}
        out["all"] = len(self.estimated.unstable & self.oracle.unstable) / m
        return {k: round(v, 4) for k, v in out.items()}

    def metrics(self) -> dict:
        """JSON-ready summary written beside the figures."""
        return {
            "model": self.profile.model.to_dict(),
            "settings": self.settings,
            "seconds": round(self.seconds, 1),
            "samples": [s.__dict__ for s in self.samples],
            "estimated": self.estimated.to_dict(),
            "oracle": None if self.oracle is None else self.oracle.to_dict(),
            "estimated_vs_oracle": self.agreement(),
        }


# --------------------------------------------------------------------------------------------- driver
def _samples_for(tasks, tokenizer, samples_per_task: int | None, prompt_tokens: int | None,
                 corpus) -> tuple[list[Sample], list[dict]]:
    """Flatten tasks into samples; ``tasks`` is task objects/names or ``{name: [token prompts]}``."""
    if isinstance(tasks, Mapping):  # tokenizer-free: prompts given as token ids
        samples, described = [], []
        for name, prompts in tasks.items():
            prompts = list(prompts)[:samples_per_task] if samples_per_task else list(prompts)
            if not prompts:
                raise ValueError(f"task {name!r} has no prompts")
            ids = [torch.as_tensor(p, dtype=torch.long).reshape(1, -1) for p in prompts]
            samples += [Sample(name, f"{name}/{i}", f"{name} prompt {i}", x) for i, x in enumerate(ids)]
            described.append({"name": name, "source": "token prompts", "documents": [f"{name}/{i}" for i in range(len(ids))]})
        return samples, described
    if tokenizer is None:
        raise ValueError("a tokenizer is needed to build prompts from corpus tasks (or pass {name: token prompts})")
    tasks = [t if isinstance(t, ProfilingTask) else get_tasks([t])[0] for t in tasks]
    samples, described = [], []
    for t in tasks:
        got = t.samples(tokenizer, samples_per_task, prompt_tokens, corpus=corpus)
        samples += got
        described.append({"name": t.name, "source": t.source, "instruction": t.instruction,
                          "documents": [s.doc_id for s in got]})
    return samples, described


def _run_sample(model, sample: Sample, *, new_tokens: int, k_pages: int, page_size: int,
                scaling: Mapping[int, float] | None, device, on_step) -> tuple[_Recorder, torch.Tensor]:
    """Greedy dense decode of one prompt under a recording FlexiCache; returns the recorder and new tokens."""
    ident = ModelIdentity.from_config(model.config)
    ids = sample.input_ids.to(device)
    total = ids.shape[1] + new_tokens + 1
    # The budget covers every page the sequence will ever have: attention stays exact (dense) while the
    # observer still sees every head's page scores at every step.
    budget = max(2, num_pages(total, page_size)) * page_size
    rec = _Recorder(ident.num_layers, ident.num_kv_heads, k_pages, scaling, on_step)
    cache = FlexiCache(HeadProfile.all_unstable(model.config),
                       FlexiCacheConfig(page_size=page_size, token_budget=budget, offload=False),
                       model_config=model.config, observer=rec)
    rec.cache = cache
    gen = model.generation_config
    pad = gen.pad_token_id if gen.pad_token_id is not None else gen.eos_token_id
    if isinstance(pad, list):
        pad = pad[0]
    with torch.inference_mode():
        # new_tokens + 1 tokens = exactly new_tokens decode steps (the first token comes from the prefill);
        # min_new_tokens stops an early EOS from shortening the record.
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **{generate_cache_kwarg(): cache},
                             do_sample=False, max_new_tokens=new_tokens + 1, min_new_tokens=new_tokens + 1,
                             pad_token_id=pad, temperature=None, top_p=None, top_k=None)
    if rec.estimated.num_steps != new_tokens:
        raise RuntimeError(f"recorded {rec.estimated.num_steps} decode steps, expected {new_tokens}")
    rec.cache = None  # drop the KV pages now, keep only the selections
    return rec, out[0, ids.shape[1]:].cpu()


def profile_model(
    model,
    tokenizer=None,
    *,
    tasks: Sequence[ProfilingTask | str] | Mapping[str, Sequence] | None = None,
    samples_per_task: int = 2,
    prompt_tokens: int = 3072,
    new_tokens: int = 256,
    k_pages: int = 32,
    page_size: int = 16,
    window: int = 32,
    fraction: float = 0.25,
    oracle: bool = False,
    device: str | torch.device | None = None,
    progress: bool = True,
    model_name: str | None = None,
    records_dir: str | Path | None = None,
    corpus=None,
    provenance: Mapping[str, Any] | None = None,
) -> ProfileResult:
    """Profile the temporal stability of ``model``'s KV heads and classify the unstable ones.

    Args:
        model: a causal LM loaded with ``attn_implementation="flexicache"``.
        tokenizer: builds the corpus prompts (not needed when ``tasks`` maps names to token prompts).
        tasks: :class:`ProfilingTask` objects or their names (default: all of ``default_tasks()``), or
            ``{task name: [token id sequences]}`` to profile given prompts.
        samples_per_task: documents per task (with token prompts: at most this many prompts; 0 = all).
        prompt_tokens: maximum prompt length (the document is cut to fit).
        new_tokens: decode steps recorded per sample (D in the paper's [D, L, H, K]).
        k_pages: K, the profiling top-K in pages.  Choose it relative to N = context / page_size: the
            paper uses 64 pages at 10k-30k tokens (K/N ≈ 0.03-0.1); at ~3k tokens 32 pages gives K/N ≈ 0.15.
        page_size: tokens per page.
        window: W, steps per TS window.
        fraction: share of KV heads classified unstable (paper: 0.25).
        oracle: also rank pages by true attention mass and classify from that (slower).
        device: where to run (the model is moved there); default: the model's device.
        progress: show a tqdm bar over decode steps.
        model_name: name recorded in the profile (default: the config's ``name_or_path``).
        records_dir: if set, save every sample's SelectionRecords there (``.npz``) for later analysis.
        corpus: path of a text corpus of your own (default: the built-in one, :mod:`flexicache_hf.corpus`).
        provenance: extra provenance entries (e.g. where the weights came from).
    """
    if k_pages < 1 or page_size < 1 or window < 2 or new_tokens < window:
        raise ValueError(f"need k_pages >= 1, page_size >= 1, window >= 2 and new_tokens >= window "
                         f"(got k_pages={k_pages}, page_size={page_size}, window={window}, new_tokens={new_tokens})")
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"fraction must be in (0, 1), found {fraction}")
    if device is not None and torch.device(device) != next(model.parameters()).device:
        model.to(device)
    device = next(model.parameters()).device
    ident = ModelIdentity.from_config(model.config)
    if model_name is not None:
        ident = replace(ident, name=model_name)
    tasks = get_tasks() if tasks is None else tasks
    samples, described = _samples_for(tasks, tokenizer, samples_per_task, prompt_tokens, corpus)
    if not samples:
        raise ValueError("no tasks")
    scaling = _attention_scaling(model) if oracle else None
    if records_dir is not None:
        records_dir = Path(records_dir)
        records_dir.mkdir(parents=True, exist_ok=True)

    from tqdm.auto import tqdm

    est, orc = _Accumulator(), (_Accumulator() if oracle else None)
    infos: list[SampleInfo] = []
    start = time.perf_counter()
    was_training = model.training
    model.eval()
    with tqdm(total=len(samples) * new_tokens, unit="step", disable=not progress, desc="profiling") as bar:
        for i, s in enumerate(samples):
            bar.set_postfix_str(f"{s.task}: {s.doc_id}")
            t0 = time.perf_counter()
            rec, new = _run_sample(model, s, new_tokens=new_tokens, k_pages=k_pages, page_size=page_size,
                                   scaling=scaling, device=device, on_step=lambda: bar.update(1))
            seconds = time.perf_counter() - t0
            est.add(s.task, rec.estimated, window)
            if orc is not None:
                orc.add(s.task, rec.oracle, window)
            if records_dir is not None:
                rec.estimated.save(records_dir / f"{i:03d}-{s.task}.estimated.npz")
                if rec.oracle is not None:
                    rec.oracle.save(records_dir / f"{i:03d}-{s.task}.oracle.npz")
            text = None
            if tokenizer is not None:
                text = tokenizer.decode(new[:64], skip_special_tokens=True)
            infos.append(SampleInfo(s.task, s.doc_id, s.title, int(s.input_ids.shape[1]), new_tokens,
                                    round(seconds, 2), text))
            del rec
    model.train(was_training)
    if est.windows == 0:
        raise ValueError("no full TS window: new_tokens must be >= window")

    estimated = EstimatorResult.build(est, fraction)
    oracle_res = EstimatorResult.build(orc, fraction) if orc is not None else None
    m = num_unstable(ident.num_layers * ident.num_kv_heads, fraction)
    assert len(estimated.unstable) == m  # classify_unstable's contract; the profile relies on it

    import flexicache_hf
    import transformers

    settings = {
        "k_pages": k_pages, "window": window, "page_size": page_size, "fraction": fraction,
        "decode_steps": new_tokens, "samples_per_task": samples_per_task, "max_prompt_tokens": prompt_tokens,
        "prompt_tokens": [i.prompt_tokens for i in infos], "windows_per_estimator": est.windows,
        "oracle": oracle, "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "device": str(device),
    }
    prov = {
        "kind": "profiled",
        "tool": "flexicache_hf.profile",
        "tool_version": flexicache_hf.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "created": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "method": ("paper §2.2-2.3: greedy dense decoding; per step, each KV head's top-K pages by Quest "
                   "min/max page scores (newest page always kept); TS = mean RCO over windows of W steps; "
                   "unstable = the heads most often in the bottom fraction of TS over all windows of all samples"),
        "scores_are": "mean TS per head over all windows (higher = more stable)",
        **settings,
        "tasks": described,
        "cross_task_overlap_mean": _round(estimated.mean_offdiagonal_overlap),
        **(dict(provenance) if provenance else {}),
    }
    if oracle_res is not None:
        prov["oracle_agreement"] = round(len(estimated.unstable & oracle_res.unstable) / m, 4)
    scores = {(l, h): float(estimated.mean_ts[l, h])
              for l in range(ident.num_layers) for h in range(ident.num_kv_heads)}
    profile = HeadProfile(ident, estimated.unstable, scores, prov)
    return ProfileResult(profile, estimated, oracle_res, infos, settings, time.perf_counter() - start)


# -------------------------------------------------------------------------------------------- figures
def _figure_layer(mean_ts: np.ndarray) -> int:
    """The layer whose heads differ most in mean TS (the paper's Fig. 1 shows such a mixed layer)."""
    spread = mean_ts.max(1) - mean_ts.min(1)
    return int(np.argmax(spread))


def write_figures(result: ProfileResult, out_dir: str | Path, prefix: str, *, layer: int | None = None) -> dict[str, Path]:
    """Fig. 1 (RCO vs offset of one layer), the TS histogram, Table-1 heat maps and a metrics JSON."""
    import json

    from .figures import plot_overlap_heatmap, plot_rco_vs_offset, plot_ts_distribution

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    est = result.estimated
    layer = _figure_layer(est.mean_ts) if layer is None else layer
    paths = {
        "rco_vs_offset": plot_rco_vs_offset(est.rco_by_offset, layer, out_dir / f"{prefix}.rco_vs_offset.png"),
        "ts_distribution": plot_ts_distribution(est.mean_ts, est.unstable, out_dir / f"{prefix}.ts_distribution.png"),
        "overlap_estimated": plot_overlap_heatmap(est.overlap_names, est.overlap,
                                                  out_dir / f"{prefix}.overlap_estimated.png"),
    }
    if result.oracle is not None:
        paths["overlap_oracle"] = plot_overlap_heatmap(result.oracle.overlap_names, result.oracle.overlap,
                                                       out_dir / f"{prefix}.overlap_oracle.png")
        paths["rco_vs_offset_oracle"] = plot_rco_vs_offset(result.oracle.rco_by_offset, layer,
                                                           out_dir / f"{prefix}.rco_vs_offset_oracle.png")
    metrics = result.metrics()
    metrics["figures"] = {k: p.name for k, p in paths.items()}
    metrics["figure_layer"] = layer
    path = out_dir / f"{prefix}.metrics.json"
    path.write_text(json.dumps(metrics, indent=1, allow_nan=False) + "\n", encoding="utf-8")
    paths["metrics"] = path
    return paths
