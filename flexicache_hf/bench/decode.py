"""Per-layer decode-attention time at Llama-3.1-8B shape (paper Fig. 7 analog): FlexiCache vs dense.

``python -m flexicache_hf.bench.decode [--out DIR]`` (CUDA only) times, for batch x context x budget:

* **SDPA**: torch ``scaled_dot_product_attention`` on contiguous ``[B, H, L, D]`` KV, the strongest of three
  GQA formulations (``enable_gqa``; the group's queries as a length-G query of their KV head; ``repeat_kv``
  materialised outside the timed region); all are timed and recorded, the fastest is the baseline.
* **dense paged**: our ``sparse_decode`` over every page (the paged dense path).
* **FlexiCache**: one decode step of one layer in steady state: ``page_scores`` + ``select_pages`` for the
  heads due, the selection update + attend-list build, and ``sparse_decode`` over the attend lists.  With
  re-rank interval R, (R-1) steps re-rank the unstable 25% of heads and 1 step re-ranks all heads: the
  amortised step is ``((R-1) * t_unstable + t_all) / R``.

Times are medians of repeats, measured with CUDA events, after warm-up; each timed region runs many calls
and rotates among several input sets so that small problems are not served from L2.  Two numbers per case:
``graph`` (the calls captured in a CUDA graph and replayed: GPU time, what the paper's Fig. 7 reports) and
``eager`` (plain launches from Python: adds launch overhead, which dominates at batch 1).  Bytes: dense =
K + V read; sparse = attended pages (K + V) + MinMax read by scoring (amortised).  GB/s is compared with a
device-to-device copy measured in the same run (bytes read + written).

Writes ``decode.json`` and ``decode.png`` to ``--out`` (default ``docs/benchmarks/``) and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

DEFAULT_OUT = Path(__file__).resolve().parents[2] / "docs" / "benchmarks"


# ---- timing -------------------------------------------------------------------------------------------------
def time_eager(fn, n_sets: int, *, calls: int = 20, reps: int = 10, warmup: int = 3) -> float:
    """Median ms per call of ``fn(i)`` launched eagerly, ``calls`` calls per timed region (sets rotate)."""
    for i in range(warmup * n_sets):
        fn(i % n_sets)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for i in range(calls):
            fn(i % n_sets)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / calls)
    return statistics.median(times)


def time_graph(fn, n_sets: int, *, calls: int = 20, reps: int = 10) -> float | None:
    """Median ms per call with ``calls`` calls captured in one CUDA graph (GPU time without launch gaps).

    ``None`` if capture fails (recorded in the JSON; the eager number still stands)."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture stream (compiles, allocator pools)
            for i in range(2 * n_sets):
                fn(i % n_sets)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                fn(i % n_sets)
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / calls)
        del graph
        return statistics.median(times)
    except Exception as e:  # noqa: BLE001 - a capture failure must not lose the rest of the run
        print(f"  graph capture failed: {type(e).__name__}: {e}")
        torch.cuda.synchronize()
        return None


def timed(fn, n_sets: int, **kw) -> dict:
    g = time_graph(fn, n_sets, **kw)
    e = time_eager(fn, n_sets, **kw)
    return {"graph_ms": g, "eager_ms": e, "ms": g if g is not None else e}


def hbm_ceiling_gbps(gib: float = 4.0) -> float:
    """Device-to-device copy bandwidth, bytes read + written (the ceiling every GB/s is compared to)."""
    n = int(gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    ms = time_eager(lambda i: dst.copy_(src), 1, calls=5, reps=10)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n / (ms * 1e-3) / 1e9


# ---- problem setup ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelShape:
    """Attention geometry of one layer (default: Llama-3.1-8B)."""

    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    dtype: torch.dtype = torch.float16

    @property
    def group(self) -> int:
        return self.q_heads // self.kv_heads

    @property
    def elt(self) -> int:
        return torch.finfo(self.dtype).bits // 8


@dataclass
class InputSet:
    """One independent copy of a layer's decode inputs (sets rotate so timings are not L2 hits)."""

    q: torch.Tensor  # [B, Hq, D]
    keys: torch.Tensor  # [B, H, L, D] contiguous (SDPA)
    values: torch.Tensor
    k_pool: torch.Tensor  # [N, page_size, D] (our paged kernels)
    v_pool: torch.Tensor
    table: torch.Tensor  # [B, H, P_cap] int32, shuffled physical placement
    kmin: torch.Tensor  # [B, H, P_cap, D] view of page-major [P_cap, B, H, D] storage, as the cache holds it
    kmax: torch.Tensor
    extra: dict = field(default_factory=dict)


def kv_bytes(B: int, L: int, m: ModelShape) -> int:
    return 2 * B * m.kv_heads * L * m.head_dim * m.elt


def make_set(B: int, L: int, m: ModelShape, gen: torch.Generator, minmax_fn) -> InputSet:
    H, D, ps = m.kv_heads, m.head_dim, m.page_size
    P = L // ps
    q = torch.randn(B, m.q_heads, D, device="cuda", dtype=m.dtype, generator=gen)
    keys = torch.randn(B, H, L, D, device="cuda", dtype=m.dtype, generator=gen)
    values = torch.randn(B, H, L, D, device="cuda", dtype=m.dtype, generator=gen)
    N = 1 + B * H * P
    table = (1 + torch.randperm(N - 1, device="cuda", generator=gen)).view(B, H, P).int()
    k_pool = torch.empty(N, ps, D, device="cuda", dtype=m.dtype)
    v_pool = torch.empty_like(k_pool)
    flat = table.view(-1).long()
    k_pool[flat] = keys.view(B * H * P, ps, D)
    v_pool[flat] = values.view(B * H * P, ps, D)
    k_pool[0] = 0
    v_pool[0] = 0
    kmin = torch.full((P, B, H, D), float("inf"), device="cuda", dtype=m.dtype).permute(1, 2, 0, 3)  # the cache's
    kmax = torch.full_like(kmin, float("-inf"))
    minmax_fn(kmin, kmax, keys, 0, torch.zeros(B, dtype=torch.long, device="cuda"), ps)
    return InputSet(q, keys, values, k_pool, v_pool, table, kmin, kmax)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


# ---- the measured operations ---------------------------------------------------------------------------------
def sdpa_variants(sets: list[InputSet], m: ModelShape, B: int, L: int, free_bytes: int) -> dict:
    """Time the dense SDPA formulations; returns {name: timing} (repeat_kv only where it fits)."""
    G, H, D = m.group, m.kv_heads, m.head_dim
    scale = D ** -0.5
    res = {}

    def gqa(i):
        s = sets[i]
        return F.scaled_dot_product_attention(s.q[:, :, None], s.keys, s.values, scale=scale, enable_gqa=True)

    def grouped(i):  # the group's G queries as a length-G (non-causal) query of their KV head
        s = sets[i]
        return F.scaled_dot_product_attention(s.q.view(B, H, G, D), s.keys, s.values, scale=scale)

    for name, fn in (("sdpa_enable_gqa", gqa), ("sdpa_grouped_query", grouped)):
        try:
            res[name] = timed(fn, len(sets))
        except Exception as e:  # noqa: BLE001 - a backend may refuse a shape; record and go on
            res[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
    need = len(sets) * kv_bytes(B, L, m) * G
    if need < 0.5 * free_bytes:
        rep = [(s.keys.repeat_interleave(G, 1), s.values.repeat_interleave(G, 1)) for s in sets]

        def repeat(i):
            s = sets[i]
            return F.scaled_dot_product_attention(s.q[:, :, None], rep[i][0], rep[i][1], scale=scale)

        try:
            res["sdpa_repeat_kv"] = timed(repeat, len(sets))
        except Exception as e:  # noqa: BLE001
            res["sdpa_repeat_kv"] = {"error": f"{type(e).__name__}: {e}"[:300]}
        del rep
        torch.cuda.empty_cache()
    else:
        res["sdpa_repeat_kv"] = {"skipped": f"needs {need / 2**30:.1f} GiB for the repeated KV"}
    return res


def flexicache_case(sets, m: ModelShape, B: int, L: int, budget: int, R: int, unstable, ops) -> dict:
    """Steady-state FlexiCache step of one layer (see the module docstring) and its parts."""
    H, D, ps = m.kv_heads, m.head_dim, m.page_size
    P = L // ps
    K = budget // ps
    max_recent = -(-R // ps)
    scale = D ** -0.5
    valid_lo = torch.zeros(B, dtype=torch.long, device="cuda")
    all_heads = torch.arange(H, device="cuda")
    uh = torch.tensor(unstable, device="cuda")
    for s in sets:  # the state after the last all-heads re-rank
        s.extra["selected"] = ops.select_pages(ops.page_scores(s.q, s.kmin, s.kmax, all_heads, P), K)
        s.extra["recent"] = torch.full((B, H, max_recent), -1, dtype=torch.long, device="cuda")
        s.extra["attend"] = torch.cat([s.extra["selected"], s.extra["recent"]], -1)
        s.extra["scores_u"] = ops.page_scores(s.q, s.kmin, s.kmax, uh, P)
        s.extra["scores_a"] = ops.page_scores(s.q, s.kmin, s.kmax, all_heads, P)
    torch.cuda.synchronize()

    def step(i, heads):
        s = sets[i]
        pages = ops.select_pages(ops.page_scores(s.q, s.kmin, s.kmax, heads, P), K)
        s.extra["selected"][:, heads] = pages
        attend = torch.cat([s.extra["selected"], s.extra["recent"]], -1)
        return ops.sparse_decode(s.q, s.k_pool, s.v_pool, s.table, attend, valid_lo, L, scale)

    from flexicache_hf.kernels import reference

    n = len(sets)
    parts = {
        "step_unstable": timed(lambda i: step(i, uh), n),
        "step_all": timed(lambda i: step(i, all_heads), n),
        "scores_unstable": timed(lambda i: ops.page_scores(sets[i].q, sets[i].kmin, sets[i].kmax, uh, P), n),
        "scores_all": timed(lambda i: ops.page_scores(sets[i].q, sets[i].kmin, sets[i].kmax, all_heads, P), n),
        "select_unstable": timed(lambda i: ops.select_pages(sets[i].extra["scores_u"], K), n),
        "select_all": timed(lambda i: ops.select_pages(sets[i].extra["scores_a"], K), n),
        "select_all_torch": timed(lambda i: reference.select_pages(sets[i].extra["scores_a"], K), n),
        "sparse_decode": timed(lambda i: ops.sparse_decode(sets[i].q, sets[i].k_pool, sets[i].v_pool, sets[i].table,
                                                           sets[i].extra["attend"], valid_lo, L, scale), n),
        "minmax_decode_token": timed(lambda i: ops.minmax_update(sets[i].kmin, sets[i].kmax, sets[i].keys[:, :, -1:],
                                                                 L - 1, valid_lo, ps), n),
    }
    attended = int((sets[0].extra["attend"] >= 0).sum())
    page_bytes = ps * D * m.elt * 2  # K + V of one page
    minmax_row = P * D * m.elt * 2  # kmin + kmax of one (row, head)
    heads_scored = ((R - 1) * len(unstable) + H) / R
    amort = {k: ((R - 1) * parts["step_unstable"][k] + parts["step_all"][k]) / R
             if parts["step_unstable"][k] is not None and parts["step_all"][k] is not None else None
             for k in ("graph_ms", "eager_ms", "ms")}
    bytes_decode = attended * page_bytes
    bytes_step = bytes_decode + B * heads_scored * minmax_row
    # Correctness at benchmark scale: our output vs the reference on the same attend list (row 0 only).
    s = sets[0]
    out = ops.sparse_decode(s.q[:1], s.k_pool, s.v_pool, s.table[:1], s.extra["attend"][:1], valid_lo[:1], L, scale)
    ref = reference.sparse_decode(s.q[:1], s.k_pool, s.v_pool, s.table[:1], s.extra["attend"][:1], valid_lo[:1], L, scale)
    return {
        "budget_tokens": budget,
        "pages_per_head": K,
        "attended_pages": attended,
        "bytes_per_step": bytes_step,
        "bytes_sparse_decode": bytes_decode,
        "amortised": amort,
        "parts": parts,
        "check_rel_err_vs_reference": rel_err(out, ref),
    }


def tier_copy(ops, m: ModelShape, pages: int = 16384) -> dict:
    """copy_pages over ``pages`` scattered 4 KiB pages: pinned host -> device and back, and device -> device."""
    ps, D = m.page_size, m.head_dim
    host = torch.randn(pages * 2, ps, D).to(m.dtype).pin_memory()
    dev = torch.zeros(pages * 2, ps, D, device="cuda", dtype=m.dtype)
    src_i = torch.randperm(pages * 2, device="cuda")[:pages]
    dst_i = torch.randperm(pages * 2, device="cuda")[:pages]
    nbytes = pages * ps * D * m.elt
    ops.copy_pages(dev, dst_i, host, src_i)
    torch.cuda.synchronize()
    ok = torch.equal(dev[dst_i].cpu(), host[src_i.cpu()])
    h2d = time_eager(lambda i: ops.copy_pages(dev, dst_i, host, src_i), 1, calls=3, reps=5, warmup=1)
    d2h = time_eager(lambda i: ops.copy_pages(host, src_i, dev, dst_i), 1, calls=3, reps=5, warmup=1)
    dev2 = torch.zeros_like(dev)
    d2d = time_eager(lambda i: ops.copy_pages(dev2, src_i, dev, dst_i), 1, calls=5, reps=5, warmup=1)
    return {"pages": pages, "page_bytes": ps * D * m.elt, "exact": ok,
            "h2d_gbps": nbytes / (h2d * 1e-3) / 1e9, "d2h_gbps": nbytes / (d2h * 1e-3) / 1e9,
            "d2d_gbps_read_plus_write": 2 * nbytes / (d2d * 1e-3) / 1e9}


def decode_sweep(sets, m: ModelShape, B: int, L: int, budget: int, ceiling: float) -> list[dict]:
    """sparse_decode tile / pipelining / split variants at one shape (evidence for the defaults)."""
    from flexicache_hf.kernels.sparse_decode import plan_splits, sparse_decode

    D, ps = m.head_dim, m.page_size
    valid_lo = torch.zeros(B, dtype=torch.long, device="cuda")
    attend = [s.extra["attend"] for s in sets]
    W = attend[0].shape[-1]
    base_splits = plan_splits(W, B * m.kv_heads, torch.cuda.get_device_properties(0).multi_processor_count, 4)[0]
    nbytes = int((attend[0] >= 0).sum()) * ps * D * m.elt * 2
    out = []
    for bn, warps, stages, splits in ((64, 4, 2, None), (64, 4, 3, None), (128, 4, 2, None), (64, 8, 2, None),
                                      (32, 4, 2, None), (64, 4, 2, 1), (64, 4, 2, max(1, base_splits // 2)),
                                      (64, 4, 2, 2 * base_splits)):
        fn = lambda i: sparse_decode(sets[i].q, sets[i].k_pool, sets[i].v_pool, sets[i].table, attend[i],  # noqa: E731
                                     valid_lo, L, D ** -0.5, num_splits=splits, block_n=bn, num_warps=warps,
                                     num_stages=stages)
        try:
            t = timed(fn, len(sets))
            gbps = nbytes / (t["ms"] * 1e-3) / 1e9
            out.append({"block_n": bn, "num_warps": warps, "num_stages": stages,
                        "num_splits": splits if splits else base_splits, **t, "gbps": gbps,
                        "pct_ceiling": 100 * gbps / ceiling})
        except Exception as e:  # noqa: BLE001
            out.append({"block_n": bn, "num_warps": warps, "num_stages": stages, "error": str(e)[:300]})
    return out


# ---- the run ---------------------------------------------------------------------------------------------------
def run(batches, contexts, budgets, R: int, unstable_frac: float, out_dir: Path, dtype: torch.dtype,
        sweep_at: tuple[int, int] | None) -> dict:
    from flexicache_hf.kernels import TRITON_OPS as ops

    m = ModelShape(dtype=dtype)
    torch.manual_seed(0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    ceiling = hbm_ceiling_gbps()
    n_unstable = max(1, round(unstable_frac * m.kv_heads))
    unstable = sorted(torch.randperm(m.kv_heads, generator=torch.Generator().manual_seed(1))[:n_unstable].tolist())
    props = torch.cuda.get_device_properties(0)
    import triton

    result = {
        "device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
        "triton": triton.__version__, "dtype": str(dtype).replace("torch.", ""),
        "shape": {"q_heads": m.q_heads, "kv_heads": m.kv_heads, "head_dim": m.head_dim, "page_size": m.page_size},
        "rerank_interval": R, "unstable_heads": unstable, "hbm_ceiling_gbps": ceiling,
        "method": "median of repeats; CUDA events; warm-up first; 20 calls per timed region rotating over "
                  "input sets sized past L2; 'graph' = CUDA-graph replay (GPU time), 'eager' = Python launches",
        "configs": [], "skipped": [],
    }
    out_dir.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every config, so a run cut short still leaves its numbers
        (out_dir / "decode.json").write_text(json.dumps(result, indent=1))

    print(f"device {props.name}; HBM ceiling (d2d copy) {ceiling:.0f} GB/s; unstable heads {unstable}")
    try:
        result["tier_copy"] = tier_copy(ops, m)
    except Exception as e:  # noqa: BLE001 - record it; the attention numbers are the point of the run
        result["tier_copy"] = {"error": f"{type(e).__name__}: {e}"[:500]}
    print(f"tier copy: {result['tier_copy']}")
    for L in contexts:
        for B in batches:
            torch.cuda.empty_cache()
            free, _ = torch.cuda.mem_get_info()
            kvb = kv_bytes(B, L, m)
            n_sets = max(1, min(4, math.ceil(256 * 2**20 / kvb)))
            need = n_sets * (2 * kvb + kvb // m.page_size // 4) + (1 << 30)
            if need > 0.85 * free:
                result["skipped"].append({"batch": B, "context": L, "reason":
                                          f"needs ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"})
                print(f"skip B={B} L={L}: does not fit")
                continue
            t0 = time.time()
            try:
                sets = [make_set(B, L, m, gen, ops.minmax_update) for _ in range(n_sets)]
                s = sets[0]
                # MinMax of the whole prompt in one call (prefill cost; no fp32 copy of the keys).
                mm = timed(lambda i: ops.minmax_update(sets[i].kmin, sets[i].kmax, sets[i].keys, 0,
                                                       torch.zeros(B, dtype=torch.long, device="cuda"), m.page_size),
                           n_sets, calls=2, reps=3)
                sdpa = sdpa_variants(sets, m, B, L, free - need)
                best = min((v["ms"], k) for k, v in sdpa.items() if "ms" in v)
                P = L // m.page_size
                all_pages = torch.arange(P, device="cuda").expand(B, m.kv_heads, P)
                vl = torch.zeros(B, dtype=torch.long, device="cuda")
                dense_paged = timed(lambda i: ops.sparse_decode(sets[i].q, sets[i].k_pool, sets[i].v_pool,
                                                                sets[i].table, all_pages, vl, L,
                                                                m.head_dim ** -0.5), n_sets)
                ours = ops.sparse_decode(s.q, s.k_pool, s.v_pool, s.table, all_pages, vl, L, m.head_dim ** -0.5)
                sd = F.scaled_dot_product_attention(s.q[:, :, None], s.keys, s.values, scale=m.head_dim ** -0.5,
                                                    enable_gqa=True)[:, :, 0]
                cfg = {
                    "batch": B, "context": L, "input_sets": n_sets, "dense_bytes": kvb,
                    "sdpa": sdpa, "sdpa_best": best[1], "sdpa_ms": best[0],
                    "sdpa_gbps": kvb / (best[0] * 1e-3) / 1e9,
                    "dense_paged": dense_paged, "dense_paged_gbps": kvb / (dense_paged["ms"] * 1e-3) / 1e9,
                    "dense_paged_rel_err_vs_sdpa": rel_err(ours, sd),
                    "minmax_prefill": mm, "flexicache": {},
                }
                for budget in budgets:
                    fc = flexicache_case(sets, m, B, L, budget, R, unstable, ops)
                    ms = fc["amortised"]["ms"]
                    fc["speedup_vs_sdpa"] = best[0] / ms
                    fc["speedup_vs_dense_paged"] = dense_paged["ms"] / ms
                    fc["gbps"] = fc["bytes_per_step"] / (ms * 1e-3) / 1e9
                    fc["pct_ceiling"] = 100 * fc["gbps"] / ceiling
                    sdt = fc["parts"]["sparse_decode"]["ms"]
                    fc["sparse_decode_gbps"] = fc["bytes_sparse_decode"] / (sdt * 1e-3) / 1e9
                    fc["sparse_decode_pct_ceiling"] = 100 * fc["sparse_decode_gbps"] / ceiling
                    cfg["flexicache"][str(budget)] = fc
                if sweep_at is not None and (B, L) == tuple(sweep_at):
                    cfg["sparse_decode_sweep"] = decode_sweep(sets, m, B, L, budgets[0], ceiling)
                result["configs"].append(cfg)
                save()
                f1 = cfg["flexicache"][str(budgets[0])]
                print(f"B={B:3d} L={L:6d}: SDPA {best[0]:.4f} ms ({best[1]}), dense paged {dense_paged['ms']:.4f} ms, "
                      f"FlexiCache-{budgets[0]} {f1['amortised']['ms']:.4f} ms (x{f1['speedup_vs_sdpa']:.2f}) "
                      f"[{time.time() - t0:.1f} s]", flush=True)
            except torch.cuda.OutOfMemoryError as e:
                result["skipped"].append({"batch": B, "context": L, "reason": f"out of memory: {str(e)[:200]}"})
                print(f"skip B={B} L={L}: OOM")
            except Exception as e:  # noqa: BLE001 - one broken case must not lose the others
                import traceback

                traceback.print_exc()
                result["skipped"].append({"batch": B, "context": L, "reason": f"error: {type(e).__name__}: {e}"[:500]})
            finally:
                sets = None
                torch.cuda.empty_cache()
    save()
    plot(result, out_dir / "decode.png")
    print_table(result)
    return result


def plot(result: dict, path: Path) -> None:
    """Fig. 7 analog: per-layer decode latency vs batch, one panel per context."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    contexts = sorted({c["context"] for c in result["configs"]})
    fig = Figure(figsize=(5.5 * max(1, len(contexts)), 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, max(1, len(contexts)), squeeze=False)[0]
    for ax, L in zip(axes, contexts):
        rows = sorted((c for c in result["configs"] if c["context"] == L), key=lambda c: c["batch"])
        xs = list(range(len(rows)))
        series = [("SDPA (dense, contiguous)", [c["sdpa_ms"] for c in rows]),
                  ("dense paged (ours)", [c["dense_paged"]["ms"] for c in rows])]
        for budget in rows[0]["flexicache"] if rows else []:
            series.append((f"FlexiCache-{budget}", [c["flexicache"][budget]["amortised"]["ms"] for c in rows]))
        w = 0.8 / len(series)
        for j, (name, ys) in enumerate(series):
            ax.bar([x + (j - (len(series) - 1) / 2) * w for x in xs], ys, w, label=name)
        ax.set_xticks(xs, [str(c["batch"]) for c in rows])
        ax.set_xlabel("batch size")
        ax.set_ylabel("per-layer decode time (ms, log)")
        ax.set_yscale("log")
        ax.set_title(f"{L // 1000}k-token context, {result['device']}")
        ax.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def print_table(result: dict) -> None:
    ceiling = result["hbm_ceiling_gbps"]
    print(f"\nper-layer decode, {result['device']}, {result['dtype']}, HBM ceiling {ceiling:.0f} GB/s, "
          f"R={result['rerank_interval']} (graph-replay GPU time; eager in the JSON)")
    print(f"{'B':>3} {'ctx':>6} {'SDPA ms':>8} {'%ceil':>5} {'paged ms':>8} {'budget':>6} {'flexi ms':>8} "
          f"{'xSDPA':>6} {'GB/s':>6} {'%ceil':>5} {'decode %ceil':>12}")
    for c in result["configs"]:
        for budget, f in c["flexicache"].items():
            print(f"{c['batch']:>3} {c['context']:>6} {c['sdpa_ms']:>8.4f} {100 * c['sdpa_gbps'] / ceiling:>5.0f} "
                  f"{c['dense_paged']['ms']:>8.4f} {budget:>6} {f['amortised']['ms']:>8.4f} "
                  f"{f['speedup_vs_sdpa']:>6.2f} {f['gbps']:>6.0f} {f['pct_ceiling']:>5.0f} "
                  f"{f['sparse_decode_pct_ceiling']:>12.0f}")
    for s in result["skipped"]:
        print(f"skipped B={s['batch']} ctx={s['context']}: {s['reason']}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16, 40, 64])
    ap.add_argument("--contexts", type=int, nargs="+", default=[10_000, 30_000])
    ap.add_argument("--budgets", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--rerank-interval", type=int, default=16)
    ap.add_argument("--unstable-fraction", type=float, default=0.25)
    ap.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    ap.add_argument("--sweep-at", type=int, nargs=2, default=[40, 10_000], metavar=("BATCH", "CONTEXT"),
                    help="shape at which sparse_decode variants are swept")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA device")
    run(args.batches, args.contexts, args.budgets, args.rerank_interval, args.unstable_fraction, args.out,
        getattr(torch, args.dtype), tuple(args.sweep_at))


if __name__ == "__main__":
    main()
