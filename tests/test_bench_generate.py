"""bench.generate's pure parts (CPU only, no model): step statistics, the largest-batch search, the GPU busy
fraction of a profile, the ratio table."""

import types

import pytest
import torch

from flexicache_hf.bench.generate.cli import build_parser, fit_prompt
from flexicache_hf.bench.generate.clock import MARK, StepClock, _pct, summarise
from flexicache_hf.bench.generate.device import error_record, kv_bytes
from flexicache_hf.bench.generate.report import add_ratios, format_table
from flexicache_hf.bench.generate.rows import attn_impl, check_rows, expand_rows, is_compiled, probe_key
from flexicache_hf import prefill_in_chunks
from flexicache_hf.bench.generate.search import search_largest
from flexicache_hf.bench.generate.trace import (concurrent_length, gpu_busy, launch_offsets, split_events,
                                               step_timeline, top_kernels, union_length)


def clock_with(stamps, t0=0.0):
    c = StepClock()
    c.t0, c.stamps = t0, list(stamps)
    return c


# ---- summarise / percentiles --------------------------------------------------------------------------------
def test_pct_nearest_rank():
    xs = list(range(1, 101))  # 1..100
    assert _pct(xs, 0.0) == 1 and _pct(xs, 1.0) == 100
    assert _pct(xs, 0.5) in (50, 51) and _pct(xs, 0.99) == 99
    assert _pct([7.0], 0.99) == 7.0
    assert _pct([3, 1, 2], 0.5) == 2  # sorts first


def test_summarise_ttft_and_steps():
    # prefill 0.5 s, then steps of 10 ms, two of 50 ms
    stamps = [0.5]
    for ms in [10] * 97 + [50] * 2:
        stamps.append(stamps[-1] + ms / 1e3)
    r = summarise(clock_with(stamps))
    assert r["ttft_s"] == pytest.approx(0.5) and r["tokens"] == 100
    assert r["first_step_ms"] == pytest.approx(10) and r["median_step_ms"] == pytest.approx(10)
    assert r["max_step_ms"] == pytest.approx(50) and r["p99_step_ms"] == pytest.approx(50)
    assert r["decode_tokens_per_s"] == pytest.approx(99 / (stamps[-1] - stamps[0]))
    assert r["tokens_per_s"] == pytest.approx(100 / stamps[-1])


def test_summarise_one_token_has_no_steps():
    r = summarise(clock_with([0.25]))
    assert r["ttft_s"] == pytest.approx(0.25) and "median_step_ms" not in r


def test_step_clock_stops_after():
    c = StepClock(stop_after=2)
    ids = torch.zeros(3, 4, dtype=torch.long)
    c.stamps = [1.0]
    assert not c.stop(ids, None).any()
    c.stamps.append(2.0)
    assert c.stop(ids, None).all() and c.stop(ids, None).shape == (3,)
    assert not StepClock().stop(ids, None).any()  # measured calls never stop early


def test_step_clock_profiles_the_prefill_only(monkeypatch):
    """``profile_prefill``: the calling thread's stacks from ``start`` to the first stamp, nothing after it and
    nothing another thread runs meanwhile (as the host tier's page-locking threads do beside a prefill);
    ``top_functions`` lists the functions by inclusive time."""
    import threading
    import time

    from flexicache_hf.bench.generate.sampler import top_functions, top_lines

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)

    def other_thread_work(stop):
        while not stop.is_set():
            time.sleep(0.001)

    def prefill_wait():
        time.sleep(0.03)

    def prefill_work():
        prefill_wait()

    def decode_work():
        time.sleep(0.01)

    stop = threading.Event()
    other = threading.Thread(target=other_thread_work, args=(stop,))
    other.start()
    c = StepClock(stop_after=2, profile_prefill=True)
    c.start()
    prefill_work()
    c(torch.zeros(1, 3, dtype=torch.long), None)  # the first token: the profile stops
    decode_work()
    c(torch.zeros(1, 4, dtype=torch.long), None)
    stop.set()
    other.join()
    rows = top_functions(c.profiler, 50)
    where = [r[3] for r in rows]
    assert any("prefill_work" in w for w in where)
    assert not any("decode_work" in w or "other_thread_work" in w for w in where)
    incl = {r[3].split("(")[-1].rstrip(")"): r for r in rows}
    assert incl["prefill_work"][0] >= 0.015 and incl["prefill_work"][1] < 0.005  # its time is its callee's
    assert incl["prefill_wait"][1] >= 0.015 and incl["prefill_wait"][2] >= 5
    assert [r[0] for r in rows] == sorted((r[0] for r in rows), reverse=True) and len(top_functions(c.profiler, 2)) == 2
    line = top_lines(c.profiler, 1)[0]
    assert "prefill_wait" in line[2] and line[0] >= 0.015  # the line calling time.sleep
    assert int(line[2].split(":")[-1].split("(")[0]) == prefill_wait.__code__.co_firstlineno + 1
    assert StepClock().profiler is None


# ---- rows ---------------------------------------------------------------------------------------------------
def test_rows_expand_and_classify():
    rows = expand_rows(["dynamic", "static", "flexicache", "flexicache-graph"], ["sdpa", "eager", "flex_attention"])
    assert rows == ["dynamic", "static", "static-eager", "static-flex_attention", "flexicache", "flexicache-graph"]
    assert expand_rows(["static", "static-eager"], ["eager"]) == ["static-eager"]  # no duplicates
    assert check_rows(rows) == [] and check_rows(["nope", "static-", "dynamic"]) == ["nope", "static-"]
    assert [attn_impl(r) for r in rows] == ["sdpa", "sdpa", "eager", "flex_attention", "flexicache", "flexicache"]
    assert [is_compiled(r) for r in rows] == [False, True, True, True, False, True]
    assert not is_compiled("offloaded") and not is_compiled("flexicache-again")
    assert probe_key("flexicache-graph", False) == "flexicache"
    assert probe_key("flexicache-graph", True) == "flexicache-graph" and probe_key("static", False) == "static"


def test_fit_prompt_and_kv_bytes():
    assert fit_prompt(8192, 256, 8192) == 7936  # SmolLM2's 8192 positions
    assert fit_prompt(16384, 256, 131072) == 16384 and fit_prompt(100, 10, None) == 100
    cfg = types.SimpleNamespace(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_size=4096)
    assert kv_bytes(cfg, 1, 1) == 2 * 32 * 8 * 128 * 2  # 128 KiB per token for Llama-3.1-8B
    assert kv_bytes(cfg, 16, 30720) == pytest.approx(64.4e9, rel=0.01)


def test_flexicache_rows_take_the_profile_settings_and_the_flags_on_top():
    """Unset flags leave the profile's settings (the README call's), set ones override single fields;
    ``flexicache-paper`` is ``FlexiCacheConfig.paper()`` with the flags on top."""
    import dataclasses
    from types import SimpleNamespace

    from transformers import LlamaConfig

    from flexicache_hf import FlexiCache, FlexiCacheConfig
    from flexicache_hf.bench.generate.run import new_cache

    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072)
    model = SimpleNamespace(config=cfg)
    readme = FlexiCache("Llama-3.1-8B-Instruct")
    args = build_parser().parse_args(["--host-limit-gb", "0"])
    graph = new_cache("flexicache-graph", model, "Llama-3.1-8B-Instruct", args, 1000)
    assert graph.config == readme.config and graph.profile == readme.profile and graph.max_tokens == 1000
    unsized = new_cache("flexicache-unsized", model, "Llama-3.1-8B-Instruct", args, 1000)
    assert unsized.config == readme.config and unsized.max_tokens is None
    args = build_parser().parse_args("--host-limit-gb 0 --budget 1024 --page-size 16".split())
    graph = new_cache("flexicache-graph", model, "Llama-3.1-8B-Instruct", args, 1000)
    assert (graph.config.token_budget, graph.config.page_size) == (1024, 16)
    assert graph.config.group_score == readme.config.group_score
    paper = new_cache("flexicache-paper", model, "Llama-3.1-8B-Instruct", args, 1000)
    assert paper.config == FlexiCacheConfig.paper(token_budget=1024, page_size=16)
    assert paper.is_compileable
    overlap = new_cache("flexicache-overlap", model, "Llama-3.1-8B-Instruct", args, 1000)
    assert overlap.config == dataclasses.replace(graph.config, overlap_loads=True) and overlap.is_compileable
    with pytest.warns(UserWarning, match="ignores"):  # the README call as written: the flags do not reach it
        unsized = new_cache("flexicache-unsized", model, "Llama-3.1-8B-Instruct", args, 1000)
    assert unsized.config == readme.config


def test_cli_flags_and_defaults():
    """The flags a recorded command line uses, with the defaults runs were measured at (``meta["args"]``)."""
    from pathlib import Path

    args = vars(build_parser().parse_args([]))
    assert args == {
        "model": "llama8b", "gguf": None, "task": "text", "cases": "1x16384,16x16384,16x30720",
        "rows": "dynamic,static,offloaded,flexicache,flexicache-graph,flexicache-unsized,flexicache-paper",
        "static_variants": "sdpa", "static_prefill_chunk": 0, "prefill_chunk": 0, "new_tokens": 256, "prompt_lookup": 0,
        "offloaded_tokens": 16, "budget": None, "rerank_interval": None, "stagger_reranks": None, "offload": None,
        "group_score": None,
        "page_size": None, "bound_shrink": None,
        "unstable_group_score": None, "exact_candidates": None, "keep_margin": None, "unstable_fraction": None,
        "prefill_profile": False,
        "profile_steps": 0, "largest_batch": None,
        "probe_tokens": 16, "probe_start": 16, "probe_step": 8, "max_probes": 8, "probe_compiled": False,
        "host_limit_gb": None, "followup": False, "followup_tokens": 512, "followup_repeats": 5,
        "out": Path(__file__).resolve().parents[1] / "docs" / "benchmarks", "tag": None}
    args = build_parser().parse_args("--cases 1x16384,16x16384 --rows flexicache-graph,static-sdpa_grouped "
                                     "--static-variants sdpa_grouped --new-tokens 128 --prompt-lookup 10 --model qwen "
                                     "--task copy".split())
    assert (args.cases, args.rows, args.static_variants, args.new_tokens, args.prompt_lookup, args.model,
            args.task) == ("1x16384,16x16384", "flexicache-graph,static-sdpa_grouped", "sdpa_grouped", 128, 10,
                           "qwen", "copy")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--model", "llama70b"])


def test_error_record():
    assert error_record(torch.OutOfMemoryError("CUDA out of memory. Tried 13 GiB"))["error"] == "out of memory"
    r = error_record(ValueError("flex_attention is not supported\nmore"))
    assert r["error"] == "ValueError: flex_attention is not supported" and "\n" not in r["detail"]


# ---- largest-batch search -------------------------------------------------------------------------------------
def capacity(cap, log=None):
    def try_batch(b):
        if log is not None:
            log.append(b)
        return b <= cap
    return try_batch


def test_search_doubles_then_bisects_to_step():
    log = []
    best, tried = search_largest(capacity(44, log))
    assert best == 40 and log == [16, 32, 64, 48, 40]
    assert tried == {16: True, 32: True, 64: False, 48: False, 40: True}


@pytest.mark.parametrize("cap", range(0, 128))
def test_search_exact_below_128_within_budget(cap):
    best, tried = search_largest(capacity(cap))
    assert len(tried) <= 8
    assert best == (cap // 8 * 8 if cap >= 8 else (1 if cap >= 1 else 0))


@pytest.mark.parametrize("cap", [128, 200, 255, 300, 1000, 5000, 10 ** 6])
def test_search_bounded_and_sound(cap):
    best, tried = search_largest(capacity(cap))
    assert len(tried) <= 8 and best <= cap and tried.get(best, True)
    assert best >= min(cap, 1024) // 2  # within the last doubling at worst


def test_search_first_failure_and_budget():
    best, tried = search_largest(capacity(12))  # 16 fails: bisect from 0 -> 8
    assert best == 8 and list(tried) == [16, 8]
    best, tried = search_largest(capacity(3))
    assert best == 1 and list(tried) == [16, 8, 1]
    best, tried = search_largest(capacity(0))
    assert best == 0 and list(tried) == [16, 8, 1]
    best, tried = search_largest(capacity(10 ** 9), max_probes=3)
    assert best == 64 and list(tried) == [16, 32, 64]
    with pytest.raises(ValueError):
        search_largest(capacity(10), max_probes=0)


def test_search_non_monotone_does_not_loop():
    calls = []
    best, tried = search_largest(lambda b: calls.append(b) or b in (16, 48), max_probes=8)
    assert len(calls) == len(set(calls)) <= 8 and tried[best] is True


def test_largest_batch_rows_are_measured_at_each_rows_own_largest_batch_and_marked(monkeypatch):
    """``--largest-batch``: each row searched, then measured at its own largest batch, the measured records marked
    ``largest_batch_row: true`` (the throughput table's rows); a largest batch whose measured call fails is recorded
    unmarked and the next one down measured instead."""
    from flexicache_hf.bench.generate import search

    fits = {"dynamic": 20, "flexicache-graph": 40}  # the most rows each "fits"
    fails_measured = {("flexicache-graph", 40)}  # passes its probe, fails its measured call

    def probe(model, ids, row, args, new, **kw):
        if ids.shape[0] > fits[row]:
            raise torch.OutOfMemoryError("CUDA out of memory")

    def measure(model, ids, row, args, profile, warmed, again):
        b = ids.shape[0]
        return [(row, {"error": "out of memory"} if (row, b) in fails_measured else
                 {"median_step_ms": 1.0, "batch": b, "decode_tokens_per_s": 100.0, "tokens": 4, "total_s": 2.0})]

    monkeypatch.setattr(search, "generate_once", probe)
    monkeypatch.setattr(search, "run_row", measure)
    monkeypatch.setattr(search, "release", lambda *a, **k: None)
    monkeypatch.setattr(search, "empty_host_cache", lambda: None)
    args = types.SimpleNamespace(probe_tokens=4, offloaded_tokens=4, new_tokens=4, probe_compiled=False,
                                 probe_start=16, probe_step=8, max_probes=8)
    got = []
    search.run_largest(None, lambda b, n: torch.zeros(b, n, dtype=torch.long), 8, ["dynamic", "flexicache-graph"],
                       args, None, set(), lambda case, row, res: got.append((case, row, res)))
    assert [(c, r, res["largest_batch"]) for c, r, res in got if c == "largest@8"] == [
        ("largest@8", "dynamic", 16), ("largest@8", "flexicache-graph", 40)]
    measured = [(c, r, res["largest_batch_row"]) for c, r, res in got if c != "largest@8"]
    assert measured == [("16x8", "dynamic", True), ("40x8", "flexicache-graph", False),
                        ("32x8", "flexicache-graph", True)]
    flexi = next(res for c, r, res in got if c == "32x8")  # whole-batch tokens a second, decoding and overall
    assert flexi["batch_decode_tokens_per_s"] == 3200 and flexi["batch_tokens_per_s"] == 64
    assert "batch_tokens_per_s" not in next(res for c, r, res in got if c == "40x8")  # failed: no throughput
    text = format_table([{"case": c, "row": r, **res} for c, r, res in got])
    assert "32x8         flexicache-graph         at its largest batch: 3200 decode tokens/s, 64.0 with" in text


# ---- profile: GPU busy fraction -------------------------------------------------------------------------------
def test_union_length():
    assert union_length([]) == 0
    assert union_length([(0, 10), (5, 15), (20, 30), (30, 31), (40, 40)]) == 26
    assert union_length([(20, 30), (0, 100)]) == 100


def test_concurrent_length():
    """Time with two or more intervals at once: touching ends do not overlap, a third stacked one counts once."""
    assert concurrent_length([]) == 0 and concurrent_length([(0, 10)]) == 0
    assert concurrent_length([(0, 10), (10, 20)]) == 0
    assert concurrent_length([(0, 10), (5, 15), (20, 30), (30, 31), (40, 40)]) == 5
    assert concurrent_length([(0, 100), (10, 20), (15, 30), (90, 100)]) == 30  # 10..30 and 90..100


def test_gpu_busy_window_and_counts():
    ms = 1e6  # ns
    marks = [i * 10 * ms for i in range(11)]  # 11 tokens, window marks[3]..marks[10] = 7 steps of 10 ms
    dev = []
    for i in range(10):  # per step: two kernels of 3 ms on two streams overlapping by 1 ms, one memcpy
        t = i * 10 * ms
        dev += [(t, t + 3 * ms, "kernel"), (t + 2 * ms, t + 5 * ms, "kernel"), (t + 6 * ms, t + 7 * ms, "memcpy")]
    dev.append((-5 * ms, 31 * ms, "kernel"))  # the prefill: clipped to 30..31 ms, inside step 3's first kernel
    r = gpu_busy(dev, marks, graph_launches=[(35 * ms, 36 * ms), (45 * ms, 46 * ms), (200 * ms, 201 * ms)])
    assert r["profile_window_steps"] == 7
    assert r["gpu_busy_fraction"] == pytest.approx(7 * 6 / 70)  # per step: kernels 0..5 ms (union), memcpy 1 ms
    assert r["kernels_per_step"] == pytest.approx(14 / 7) and r["memcpy_per_step"] == pytest.approx(1)
    assert r["gpu_busy_ms_per_step"] == pytest.approx(6) and r["window_ms_per_step"] == pytest.approx(10)
    assert r["graph_launches_per_step"] == pytest.approx(2 / 7)
    assert r["concurrent_ms_per_step"] == pytest.approx(8 / 7)  # the two kernels' 1 ms a step, the prefill's 1 ms once


def test_gpu_busy_errors():
    with pytest.raises(ValueError, match="step markers"):
        gpu_busy([(0, 1, "kernel")], [0, 1, 2])
    with pytest.raises(ValueError, match="no CUDA"):
        gpu_busy([(0, 1, "kernel")], [10, 20, 30, 40, 50])


class FakeKineto:
    def __init__(self, name, device, start, end, activity=None, annotation=False):
        self._v = name, device, start, end, activity, annotation

    def name(self): return self._v[0]
    def device_type(self): return f"DeviceType.{self._v[1]}"
    def start_ns(self): return self._v[2]
    def end_ns(self): return self._v[3]
    def activity_type(self): return self._v[4]
    def is_user_annotation(self): return self._v[5]


def test_split_events_kineto_and_function_events():
    ev = [FakeKineto(MARK, "CPU", 10, 10, "user_annotation", True),
          FakeKineto("gemm", "CUDA", 11, 15, "kernel"),
          FakeKineto("Memcpy HtoD (Pinned -> Device)", "CUDA", 15, 16, "gpu_memcpy"),
          FakeKineto("Memset (Device)", "CUDA", 16, 17, "gpu_memset"),
          FakeKineto("## Call CompiledFxGraph ##", "CUDA", 0, 100, "gpu_user_annotation", True),
          FakeKineto("cudaGraphLaunch", "CPU", 12, 13, "cuda_runtime"),
          FakeKineto("aten::mm", "CPU", 11, 12, "cpu_op")]
    dev, marks, launches = split_events(ev)
    assert dev == [(11, 15, "kernel"), (15, 16, "memcpy"), (16, 17, "memset")]
    assert marks == [10] and launches == [(12, 13)]
    # an older torch: no activity_type, kinds from the names; FunctionEvents with times in us
    fe = [types.SimpleNamespace(name="Memcpy DtoD", device_type="DeviceType.CUDA",
                                time_range=types.SimpleNamespace(start=1.0, end=2.0)),
          types.SimpleNamespace(name="triton_poi_fused", device_type="DeviceType.CUDA",
                                time_range=types.SimpleNamespace(start=2.0, end=4.0)),
          types.SimpleNamespace(name=MARK, device_type="DeviceType.CPU",
                                time_range=types.SimpleNamespace(start=0.5, end=0.5))]
    dev, marks, _ = split_events(fe)
    assert dev == [(1e3, 2e3, "memcpy"), (2e3, 4e3, "kernel")] and marks == [500.0]


# ---- ratios and the table ----------------------------------------------------------------------------------
def results():
    common = dict(ttft_s=1.0, p99_step_ms=1.0, decode_tokens_per_s=10.0, peak_gpu_bytes=20e9, pinned_bytes=2e9,
                  dynamo_graphs_added=0)
    return [
        {"case": "1x16384", "row": "dynamic", **common, "median_step_ms": 60.0},
        {"case": "1x16384", "row": "static", **common, "median_step_ms": 13.0},
        {"case": "1x16384", "row": "static-eager", **common, "median_step_ms": 12.0},
        {"case": "1x16384", "row": "flexicache-graph", **common, "median_step_ms": 6.0, "gpu_busy_fraction": 0.8},
        {"case": "16x30720", "row": "dynamic", "error": "out of memory", "detail": "x"},
        {"case": "16x30720", "row": "flexicache", **common, "median_step_ms": 40.0},
        {"case": "largest@30720", "row": "static", "largest_batch": 8, "tried": {"16": "out of memory", "8": "ok"}},
    ]


def test_add_ratios():
    rs = results()
    add_ratios(rs)
    by = {(r["case"], r["row"]): r for r in rs}
    fg = by["1x16384", "flexicache-graph"]
    assert fg["median_vs_dynamic"] == pytest.approx(0.1) and fg["median_vs_best_static"] == pytest.approx(0.5)
    assert fg["best_static_row"] == "static-eager"
    assert by["1x16384", "static"]["median_vs_best_static"] == pytest.approx(13 / 12)
    fc = by["16x30720", "flexicache"]  # no dense row ran: no ratios
    assert fc["median_vs_dynamic"] is None and fc["median_vs_best_static"] is None
    assert "median_vs_dynamic" not in by["16x30720", "dynamic"]


def test_format_table():
    rs = results()
    add_ratios(rs)
    text = format_table(rs)
    head, *lines = text.splitlines()
    for col in ("TTFT s", "med ms", "p99 ms", "dec tok/s", "peak GB", "pin GB", "med/dyn", "med/static"):
        assert col in head
    fg = next(l for l in lines if "flexicache-graph" in l).split()
    assert fg[:4] == ["1x16384", "flexicache-graph", "1.00", "6.00"]
    assert "0.10" in fg and "0.50" in fg and "80%" in fg and "20.0" in fg and "2.0" in fg
    assert any("16x30720" in l and "error: out of memory" in l for l in lines)
    assert any("1x16384: static-eager" in l for l in lines)  # which static row the ratio is against
    assert any("largest batch 8" in l and "8: ok" in l and "16: fail" in l for l in lines)
    fc = next(l for l in lines if l.startswith("16x30720") and "flexicache" in l).split()
    assert fc[8:10] == ["-", "-"]  # no ratio without a dense row


def test_format_table_columns_line_up():
    rs = results()
    add_ratios(rs)
    head, *lines = format_table(rs).splitlines()
    rows = [l for l in lines if l.startswith(("1x16384", "16x30720")) and "error" not in l]
    assert len({len(l) for l in rows} | {len(head)}) == 1  # "-" cells padded like numbers
    long = [{"case": "1x1", "row": "static-x", "error": "ValueError: " + "y" * 500}]
    assert len(format_table(long).splitlines()[1]) < 160


def test_top_kernels_rank_by_time_in_window():
    ms = 1e6
    marks = [i * 10 * ms for i in range(6)]  # window marks[3]..marks[5]: 2 steps
    dev = [(0, 9 * ms, "kernel", "prefill")]  # before the window: not counted
    for i in (3, 4):
        t = i * 10 * ms
        dev += [(t, t + 1 * ms, "kernel", "small"), (t + 1 * ms, t + 2 * ms, "kernel", "small"),
                (t + 2 * ms, t + 5 * ms, "kernel", "gemm" + "x" * 100)]
    top = top_kernels(dev, marks)
    assert [k["name"] for k in top] == ["gemm" + "x" * 76, "small"]
    assert top[0]["ms_per_step"] == pytest.approx(3) and top[1]["count_per_step"] == pytest.approx(2)
    assert top_kernels(dev, marks[:2]) == []
    assert gpu_busy(dev, marks)["kernels_per_step"] == pytest.approx(3)  # 4-tuples accepted


def test_step_timeline_is_the_middle_step_in_start_order():
    us = 1e3  # ns
    marks = [i * 100 * us for i in range(8)]  # window: marks[3]..marks[7], 4 steps; the middle one starts at 500 us
    dev = [(510 * us, 530 * us, "kernel", "b" * 50, 7), (502 * us, 512.5 * us, "kernel", "a"), (450 * us, 460 * us,
           "kernel", "earlier", 7), (600 * us, 601 * us, "kernel", "next step", 7)]
    assert step_timeline(dev, marks) == [[2.0, 10.5, -1, "a"], [10.0, 20.0, 7, "b" * 40]]
    assert step_timeline(dev, marks[:4]) == []


def test_launch_offsets_split_the_host_time_before_a_graph_from_its_launch_latency():
    us = 1e3  # ns
    marks = [i * 100 * us for i in range(8)]  # window: marks[3]..marks[7], 4 steps
    launches = [(330 * us, 331 * us), (440 * us, 443 * us), (550 * us, 552 * us), (560 * us, 561 * us)]
    # step at 300: 30 us in, a 1 us call; 400: 40, 3 us; 500: 50, 2 us (the first of two)
    dev = [(335 * us, 340 * us, "kernel"), (460 * us, 470 * us, "kernel"), (420 * us, 421 * us, "kernel"),
           (552 * us, 553 * us, "kernel"), (250 * us, 260 * us, "kernel")]
    out = launch_offsets(dev, marks, launches)
    assert out["host_to_launch_ms"] == pytest.approx(0.040)  # median of 30, 40, 50 us
    assert out["launch_to_device_ms"] == pytest.approx(0.005)  # median of 5, 20, 2 us (the one before 440 ignored)
    assert out["launch_api_ms"] == pytest.approx(0.002)  # median of 1, 3, 2 us
    assert launch_offsets(dev, marks, []) == {}


def test_split_events_with_names():
    ev = [FakeKineto("gemm", "CUDA", 11, 15, "kernel")]
    assert split_events(ev, names=True)[0] == [(11, 15, "kernel", "gemm", -1)]  # no stream id known
    ev[0].device_resource_id = lambda: 7
    assert split_events(ev, names=True)[0] == [(11, 15, "kernel", "gemm", 7)]


# ---- the static-sdpa_grouped row's attention: exact against transformers' sdpa --------------------------------
@pytest.mark.parametrize("padded", [False, True])
def test_grouped_sdpa_static_cache_equals_dynamic_sdpa(padded):
    from transformers import AutoModelForCausalLM, DynamicCache, StaticCache

    from conftest import tiny_config
    from flexicache_hf.bench import grouped_sdpa

    grouped_sdpa.register()
    cfg = tiny_config("llama", heads=8, kv_heads=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    ids = torch.randint(2, 90, (2, 37))
    mask = torch.ones_like(ids)
    if padded:
        ids[1, :5], mask[1, :5] = 0, 0
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0, disable_compile=True)
    with torch.no_grad():
        want = model.generate(ids, past_key_values=DynamicCache(), **kw)
        ref_logits = model(ids, attention_mask=mask).logits
        model.set_attn_implementation(grouped_sdpa.NAME)
        got = model.generate(ids, past_key_values=StaticCache(config=model.config, max_cache_len=64), **kw)
        chunked = model.generate(ids, past_key_values=StaticCache(config=model.config, max_cache_len=64),
                                 prefill_chunk_size=16, **kw)  # --static-prefill-chunk: later chunks take the mask
        logits = model(ids, attention_mask=mask).logits
    assert torch.equal(got, want) and torch.equal(chunked, want)
    keep = mask.bool()
    torch.testing.assert_close(logits[keep], ref_logits[keep], atol=1e-5, rtol=1e-4)


def test_grouped_sdpa_takes_the_lower_right_causal_path_for_an_unpadded_chunk():
    """A later prompt chunk of a static cache: transformers' mask is exactly causal from the chunk's offset, so the
    baseline attends the filled keys with torch's lower-right causal bias; anything else keeps the mask."""
    from transformers.masking_utils import sdpa_mask

    from flexicache_hf.bench import grouped_sdpa

    B, T, S, o = 2, 4, 12, 5
    full = torch.ones(B, S, dtype=torch.long)
    mask = sdpa_mask(batch_size=B, q_length=T, kv_length=S, q_offset=o, kv_offset=0, attention_mask=full,
                     allow_is_causal_skip=False)
    assert grouped_sdpa.causal_chunk_end(mask) == o + T
    padded = full.clone()
    padded[1, :2] = 0
    pmask = sdpa_mask(batch_size=B, q_length=T, kv_length=S, q_offset=o, kv_offset=0, attention_mask=padded,
                      allow_is_causal_skip=False)
    assert grouped_sdpa.causal_chunk_end(pmask) is None
    assert grouped_sdpa.causal_chunk_end(mask.transpose(-1, -2)[..., :T, :S]) is None  # not causal
    torch.manual_seed(0)
    q = torch.randn(B, 8, T, 16)
    k, v = torch.randn(B, 2, S, 16), torch.randn(B, 2, S, 16)
    k[:, :, o + T:] = v[:, :, o + T:] = float("nan")  # the unfilled tail is never read
    got, _ = grouped_sdpa.grouped_sdpa(None, q, k, v, mask, scaling=0.25)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k[:, :, :o + T].repeat_interleave(4, 1), v[:, :, :o + T].repeat_interleave(4, 1),
        attn_mask=mask[..., :o + T].bool(), scale=0.25).transpose(1, 2)
    torch.testing.assert_close(got, want)


def test_prefill_in_chunks_then_generate_gives_the_one_shot_tokens():
    """``--static-prefill-chunk``: eager chunks fill a StaticCache with all but the last prompt token, generate
    prefills that token and decodes; the tokens are those of a one-shot DynamicCache generate."""
    from transformers import AutoModelForCausalLM, DynamicCache, StaticCache

    from conftest import tiny_config
    from flexicache_hf.bench import grouped_sdpa

    grouped_sdpa.register()
    cfg = tiny_config("llama", heads=8, kv_heads=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    ids = torch.randint(2, 90, (2, 37))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False, pad_token_id=0,
              disable_compile=True)
    with torch.no_grad():
        want = model.generate(ids, past_key_values=DynamicCache(), **kw)
        model.set_attn_implementation(grouped_sdpa.NAME)
        cache = StaticCache(config=model.config, max_cache_len=64)
        prefill_in_chunks(model, ids, cache, 16)  # 36 tokens: chunks of 16, 16 and 4
        assert int(cache.get_seq_length()) == ids.shape[1] - 1
        got = model.generate(ids, past_key_values=cache, **kw)
    assert torch.equal(got, want)


def test_triton_compiles_counts_builds_and_hits_and_puts_the_listener_back():
    """The listener ``TritonCompiles`` installs counts compiles (their times summed, microseconds to seconds) and
    cache loads, passes each event on to the listener it found, and leaves that listener in place afterwards."""
    from flexicache_hf.bench.generate.device import TritonCompiles

    knobs = pytest.importorskip("triton").knobs
    if not hasattr(getattr(knobs, "compilation", None), "listener"):
        pytest.skip("this Triton has no compilation listener")
    seen = []

    def previous(**kw):
        seen.append(kw["cache_hit"])

    old = knobs.compilation.listener
    knobs.compilation.listener = previous
    try:
        with TritonCompiles() as tc:
            event = dict(src=types.SimpleNamespace(name="_kernel_a"), metadata={}, metadata_group={})
            knobs.compilation.listener(**event, times=types.SimpleNamespace(total=1_500_000), cache_hit=False)
            knobs.compilation.listener(**{**event, "src": None}, times=types.SimpleNamespace(total=250_000),
                                       cache_hit=False)
            knobs.compilation.listener(**event, times=types.SimpleNamespace(total=3), cache_hit=True)
        assert knobs.compilation.listener is previous
    finally:
        knobs.compilation.listener = old
    assert tc.record() == {"triton_compiles": 2, "triton_cache_hits": 1, "triton_compile_s": pytest.approx(1.75),
                           "triton_kernels": {"_kernel_a": [1, 1.5], "?": [1, 0.25]}}
    assert seen == [False, False, True]


def test_compile_phases_since_a_snapshot_are_the_phases_that_grew(monkeypatch):
    """``phases_since``: torch.compile's per-phase seconds spent after a snapshot, largest first, the unchanged and
    the negligible left out."""
    import torch._dynamo.utils as dynamo_utils

    from flexicache_hf.bench.generate.device import compile_phases, phases_since

    metrics = {"bytecode_tracing": [1.0, 2.0], "build_guards": [0.5]}
    monkeypatch.setattr(dynamo_utils, "compilation_time_metrics", metrics)
    before = compile_phases()
    assert before == {"bytecode_tracing": 3.0, "build_guards": 0.5}
    metrics["bytecode_tracing"].append(4.25)
    metrics["compile_fx"] = [7.0]
    metrics["tiny"] = [0.0001]
    assert phases_since(before) == {"compile_fx": 7.0, "bytecode_tracing": 4.25}
    assert list(phases_since(before, top=1)) == ["compile_fx"]


def test_config_flags_are_the_flags_set():
    from flexicache_hf.bench.generate.cli import build_parser
    from flexicache_hf.bench.generate.run import config_flags

    assert config_flags(build_parser().parse_args([])) == {}
    args = build_parser().parse_args("--no-offload --keep-margin 1 --page-size 16".split())
    assert config_flags(args) == {"offload": False, "keep_margin": 1.0, "page_size": 16}


def test_host_cuda_calls_are_ranked_per_step_like_device_operations():
    us = 1e3  # ns
    ev = [FakeKineto("cudaGraphLaunch", "CPU", 310 * us, 312 * us, "cuda_runtime"),
          FakeKineto("cuMemHostRegister_v2", "CPU", 420 * us, 470 * us, "cuda_driver"),
          FakeKineto("cudaGraphLaunch", "CPU", 410 * us, 416 * us, "cuda_runtime"),
          FakeKineto("cudaLaunchKernel", "CPU", 250 * us, 251 * us, "cuda_runtime"),  # before the window
          FakeKineto("aten::mm", "CPU", 320 * us, 330 * us, "cpu_op")]
    api: list = []
    _, _, launches = split_events(ev, api=api)
    assert launches == [(310 * us, 312 * us), (410 * us, 416 * us)] and len(api) == 4  # aten::mm is no CUDA call
    marks = [i * 100 * us for i in range(8)]  # window marks[3]..marks[7]: 4 steps
    assert top_kernels(api, marks, n=8) == [
        {"name": "cuMemHostRegister_v2", "ms_per_step": pytest.approx(0.0125), "count_per_step": 0.25},
        {"name": "cudaGraphLaunch", "ms_per_step": pytest.approx(0.002), "count_per_step": 0.5}]
    assert top_kernels(api, marks[:2]) == []
