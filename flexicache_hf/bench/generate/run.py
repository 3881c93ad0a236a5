"""Running one row: the cache it passes to ``generate``, one timed call, the warm-up and measured calls, the
profiled call and the multi-turn follow-up."""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import statistics
import time
import warnings

import torch

from ...chunked_prefill import prefill_in_chunks
from ...hf_compat import generate_cache_kwarg
from .clock import StepClock, summarise, summarise_assisted
from .sampler import top_functions, top_lines
from .device import (HostLimitError, TritonCompiles, compile_phases, cudagraph_recordings, dynamo_counts,
                     empty_host_cache, error_record, kv_bytes, phases_since, pinned_stats, release)
from .rows import attn_impl, is_compiled, is_profiled, is_user_call
from .trace import TOP_KERNELS, gpu_busy, launch_offsets, split_events, step_timeline, top_kernels

WARMUP_STEPS = 4


def new_cache(row: str, model, profile, args, max_cache_len: int):
    """The cache object a row passes to ``generate`` (``None``: generate makes it from cache_implementation)."""
    from transformers import DynamicCache, StaticCache

    from ... import FlexiCache, FlexiCacheConfig

    if row == "flexicache-unsized":  # the README's first example, as written: the config flags do not apply
        if config_flags(args):
            warnings.warn(f"the flexicache-unsized row is FlexiCache(profile) as the README writes it: it ignores "
                          f"{sorted(config_flags(args))} (its JSON records the config it used)", stacklevel=2)
        return FlexiCache(profile)
    if row.startswith("flexicache"):
        limit = int(args.host_limit_gb * 1e9) if args.host_limit_gb > 0 else None
        sized = dict(max_cache_len=max_cache_len, model_config=model.config)
        if row == "flexicache-paper":  # FlexiCacheConfig.paper(): the paper's settings, the flags on top
            return FlexiCache(profile, config=FlexiCacheConfig.paper(**config_flags(args), host_memory_limit=limit),
                              **sized)
        overlap = dict(overlap_loads=True) if row == "flexicache-overlap" else {}
        return FlexiCache(profile, **config_flags(args), **overlap, host_memory_limit=limit, **sized)
    if is_compiled(row):  # static*
        try:
            return StaticCache(config=model.config, max_cache_len=max_cache_len)
        except TypeError:  # another signature: let generate make it (cache_implementation="static")
            return None
    return DynamicCache() if row == "dynamic" else None


def config_flags(args) -> dict:
    """The FlexiCacheConfig fields the run's flags set (unset flags: the profile's settings decide)."""
    names = dict(budget="token_budget", rerank_interval="rerank_interval", stagger_reranks="stagger_reranks",
                 group_score="group_score", page_size="page_size", bound_shrink="bound_shrink",
                 unstable_group_score="unstable_group_score", exact_candidates="exact_candidates",
                 keep_margin="keep_margin", offload="offload")
    return {field: getattr(args, flag) for flag, field in names.items() if getattr(args, flag, None) is not None}


def generate_once(model, ids, row: str, args, new: int, *, profile=None, stop_after=None, cache=None,
                  cache_len: int | None = None, eager: bool = False, clock: StepClock | None = None):
    """One timed generate call of ``new`` tokens; returns (summary dict, cache used, output ids).

    ``cache_len``: the cache's size (default prompt + ``new``); ``eager``: no compile even for a compiled row.
    """
    from transformers import StoppingCriteriaList

    clock = clock or StepClock(stop_after)
    kw = dict(max_new_tokens=new, min_new_tokens=new if stop_after is None else None, do_sample=False,
              attention_mask=torch.ones_like(ids), logits_processor=[clock],
              stopping_criteria=StoppingCriteriaList([clock.stop]), pad_token_id=0)
    if eager or not (is_compiled(row) or is_user_call(row)):
        kw["disable_compile"] = True
    lookup = getattr(args, "prompt_lookup", 0)
    if lookup:  # drafts are verified in multi-token forwards, which a compiled decode step does not take
        kw.update(prompt_lookup_num_tokens=lookup, disable_compile=True)
    chunk = (args.static_prefill_chunk if row.startswith("static")
             else args.prefill_chunk if row.startswith("flexicache") else 0)
    if row == "offloaded" and args.host_limit_gb > 0:
        need = kv_bytes(model.config, ids.shape[0], ids.shape[1] + new)
        if need > args.host_limit_gb * 1e9:
            raise HostLimitError(f"the offloaded KV needs {need / 1e9:.1f} GB of host memory, over --host-limit-gb "
                                 f"{args.host_limit_gb:.1f}")
    model.set_attn_implementation(attn_impl(row))
    passed_in = cache is not None  # (the -reset row's: it runs on its own storage)
    # (a verify forward of prompt lookup may run a few drafted positions past prompt + new)
    headroom = lookup + 1 if lookup else 0
    cache = cache if cache is not None else new_cache(row, model, profile, args,
                                                      cache_len or ids.shape[1] + new + headroom)
    if chunk and cache is None:
        raise RuntimeError("--static-prefill-chunk needs a StaticCache made here (this transformers' StaticCache "
                           "signature is unknown)")
    if chunk and int(cache.get_seq_length()):
        chunk = 0  # a later turn on a filled cache (the follow-up case): generate takes it whole
    if cache is not None:
        kw[generate_cache_kwarg()] = cache
    else:
        kw["cache_implementation"] = "static" if is_compiled(row) else row
    before = pinned_stats()
    graphs0, cg0 = dynamo_counts()
    rec0 = cudagraph_recordings()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.synchronize()
    clock.start()
    with TritonCompiles() as builds:
        if chunk:  # the time to first token includes the chunks
            prefill_in_chunks(model, ids, cache, chunk)
        out = model.generate(ids, **kw)
        torch.cuda.synchronize()
    new_tokens = out.shape[1] - ids.shape[1]
    res = summarise_assisted(clock, new_tokens, time.perf_counter()) if lookup else summarise(clock)
    # The generated tokens' digest: two runs (two versions of the code) decoded the same tokens iff it matches.
    res["tokens_sha1"] = hashlib.sha1(out[:, ids.shape[1]:].cpu().numpy().tobytes()).hexdigest()[:16]
    after = pinned_stats()
    graphs1, cg1 = dynamo_counts()
    rec1 = cudagraph_recordings()
    res.update(peak_gpu_bytes=torch.cuda.max_memory_allocated(), pinned_bytes=after["pinned_bytes"],
               pinned_allocs_during=after["pinned_allocs"] - before["pinned_allocs"],
               pinned_bytes_added=after["pinned_locked"] - before["pinned_locked"],
               pin_wait_s=after["pin_wait_s"] - before["pin_wait_s"],
               dynamo_graphs_added=graphs1 - graphs0, batch=ids.shape[0], prompt_tokens=ids.shape[1],
               compiled=(bool(getattr(cache, "is_compileable", False)) if is_user_call(row) else is_compiled(row))
               and not eager and not lookup, prefill_chunk_size=chunk or None,
               prompt_lookup=lookup or None, **builds.record())
    if clock.profiler is not None:  # the calling thread's Python up to the first token (--prefill-profile)
        res["prefill_profile"] = top_functions(clock.profiler, 60)  # (the outer ~20 are generate's own chain)
        res["prefill_lines"] = top_lines(clock.profiler)
    if rec0 is not None and rec1 is not None and rec1 >= rec0:
        res["cudagraphs_recorded"] = rec1 - rec0  # 0: every compiled step replayed graphs recorded earlier
    cg = {k: v - cg0.get(k, 0) for k, v in cg1.items() if v - cg0.get(k, 0)}
    if cg:
        res["cudagraph_counters_added"] = cg
    if row.startswith("flexicache"):
        # storage_reused: a new cache took a dropped one's storage at its first forward (recycling.py)
        res.update(storage_reused=not passed_in and cache.storage_reused, promoted_pages=cache.stats.promoted_pages,
                   host_tier_bytes=cache.host_bytes(),
                   device_kv_bytes=cache.device_bytes(), dense_kv_bytes=cache.dense_bytes(),
                   cache_is_compileable=bool(cache.is_compileable), **cache.commit_seconds(),
                   config=dataclasses.asdict(cache.config), settings_source=cache.settings_source)
    return res, cache, out


def profile_decode(model, ids, row, args, profile) -> dict:
    """``--profile-steps``: one more generate of N + 8 tokens under torch.profiler; GPU busy fraction and
    kernels per step over the decode window (:mod:`.trace`).  Errors come back as ``profile_error``."""
    from torch.profiler import ProfilerActivity

    new = args.profile_steps + 8
    clock = StepClock(mark=True)
    try:
        with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            res, _, _ = generate_once(model, ids, row, args, new, profile=profile, clock=clock,
                                      cache_len=ids.shape[1] + max(new, args.new_tokens))
        t = time.perf_counter()
        kineto = getattr(getattr(prof, "profiler", None), "kineto_results", None)
        events = kineto.events() if kineto is not None else prof.events()
        api: list = []
        dev, marks, launches = split_events(events, names=True, api=api)
        out = gpu_busy(dev, marks, graph_launches=launches)
        out["api_calls"] = top_kernels(api, marks, n=8)  # the host CUDA calls of a step, from any thread
        out["top_kernels"] = top_kernels(dev, marks, n=TOP_KERNELS)
        out["step_timeline"] = step_timeline(dev, marks)
        out.update(launch_offsets(dev, marks, launches))
        out.update(profile_tokens=new, profile_median_step_ms=res.get("median_step_ms"),
                   profile_graphs_added=res["dynamo_graphs_added"], profile_parse_s=time.perf_counter() - t)
        return out
    except Exception as e:  # noqa: BLE001  (a profile that fails keeps the row's measurement)
        return {"profile_error": error_record(e)["error"]}


def run_row(model, ids, row, args, profile, warmed: set, *, again: bool = True) -> list[tuple[str, dict]]:
    """Warm-up, then the measured call(s) of one row (``again``: the flexicache rows' second fresh cache).

    The compiling rows warm up at the very shapes they are measured at (a compiled step is specialised to the
    cache's shape), stopped after a few steps; the eager rows once per process on a short prompt (kernel
    builds, allocator), so no row's measured call pays a one-time cost.  Any error (out of memory, an
    unsupported attention) ends the row with ``{"error": ...}``; memory is freed before the next row.
    """
    results: list[tuple[str, dict]] = []
    compiled = is_compiled(row) or is_user_call(row)  # (warmed up at the measured shape)
    new = args.offloaded_tokens if row == "offloaded" else args.new_tokens
    names = (row, f"{row}-again") if again and row.startswith("flexicache") else (row,)
    current, err = row, None
    try:
        warm = {}
        if compiled:
            t, phases = time.perf_counter(), compile_phases()
            clock = StepClock(WARMUP_STEPS, profile_prefill=getattr(args, "prefill_profile", False))
            res, _, _ = generate_once(model, ids, row, args, new, profile=profile, stop_after=WARMUP_STEPS,
                                      clock=clock)
            # warmup_ttft_s: the row's first cache's time to first token (the prefill runs eagerly, before the
            # decode step compiles): for the first cache row of a process, its first cache's (page-locking included)
            warm = {"warmup_s": time.perf_counter() - t, "warmup_graphs_added": res["dynamo_graphs_added"],
                    "warmup_ttft_s": res.get("ttft_s"), "warmup_host_wait_s": res.get("host_wait_s"),
                    "warmup_host_commit_s": res.get("host_commit_s"),
                    "warmup_device_commit_s": res.get("device_commit_s"),
                    "warmup_triton_compile_s": res.get("triton_compile_s"),
                    "warmup_triton_kernels": res.get("triton_kernels"),
                    "warmup_compile_phases": phases_since(phases),  # torch.compile's phases, seconds
                    "warmup_prefill_profile": res.get("prefill_profile"),
                    "warmup_prefill_lines": res.get("prefill_lines"),
                    "compile_skipped": res["dynamo_graphs_added"] == 0}  # generate declined to compile
        elif row not in warmed:
            generate_once(model, ids[:1, :1024], row, args, 8, profile=profile)
            warmed.add(row)
        for name in names:
            current = name
            cache = None  # the previous fresh cache dies first: its pinned blocks are what the next one reuses
            gc.collect()
            res, cache, _ = generate_once(model, ids, row, args, new, profile=profile)
            if name == row:
                res.update(warm)
            results.append((name, res))
        if again and row.startswith("flexicache"):  # the last cache once more after reset(): buffers kept
            current = f"{row}-reset"
            cache.reset()
            res, _, _ = generate_once(model, ids, row, args, new, profile=profile, cache=cache)
            results.append((current, res))
        cache = None
        if args.profile_steps > 0 and is_profiled(row):
            current = row
            gc.collect()
            results[0][1].update(profile_decode(model, ids, row, args, profile))
    except Exception as e:  # noqa: BLE001  (recorded; the run goes on)
        err = error_record(e)
    if err is not None:
        results.append((current, err))
    release(model, compiled=compiled or err is not None)
    if row == "offloaded" or err is not None:  # offloaded KV sits in pinned blocks no FlexiCache reuses
        empty_host_cache()
    return results


def run_followup(model, ids, args, profile, make_prompt) -> list[tuple[str, dict]]:
    """Multi-turn: a prefix turn, then a ``--followup-tokens`` new prompt on the same cache (its TTFT); eager.

    One warm-up pass, then ``--followup-repeats`` measured ones (each on a fresh cache and prefix turn): a
    follow-up's first token takes ~0.1 s at 1 × 16k, where one call varies by tens of percent, so ``ttft_s`` is
    the median of the repeats (every one in ``ttft_runs_s``)."""
    out = []
    extra = make_prompt(ids.shape[0], args.followup_tokens)
    for row in ("dynamic", "flexicache"):
        err = None
        try:
            runs = []
            for attempt in range(1 + max(1, args.followup_repeats)):  # the first pass warms up
                total = ids.shape[1] + 8 + args.followup_tokens + args.new_tokens
                cache = new_cache(row, model, profile, args, total)
                _, cache, first = generate_once(model, ids, row, args, 8, profile=profile, cache=cache)
                turn = torch.cat([first, extra], dim=1)
                res, _, _ = generate_once(model, turn, row, args, args.new_tokens, profile=profile, cache=cache,
                                          stop_after=4)
                if attempt:
                    runs.append(res["ttft_s"])
                cache = None
            out.append((f"{row}-followup", {**res, "ttft_s": statistics.median(runs), "ttft_runs_s": runs,
                                            "prefix_tokens": ids.shape[1] + 8,
                                            "followup_tokens": args.followup_tokens}))
        except Exception as e:  # noqa: BLE001
            err = error_record(e)
        if err is not None:
            out.append((f"{row}-followup", err))
        cache = first = turn = None
        release(model, compiled=False)
    return out
