"""Profiler trace analysis for ``--profile-steps``: the device work between the step clock's markers.

Over the window from the 4th stamp to the last, the union of the CUDA kernel / memcpy / memset intervals (clipped to
the window) divided by the window is the GPU busy fraction; ``busy × step`` is GPU time, the rest of a step is host
time.  Times are in ns (the kineto events'), ``FunctionEvent`` times are converted from us.
"""

from __future__ import annotations

import statistics

from .clock import MARK

PROFILE_SKIP = 3  # the profile window starts at the 4th stamp
TOP_KERNELS = 80  # device operations listed per profiled row (names cut to 80 characters)


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by the union of ``(start, end)`` intervals."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(iv for iv in intervals if iv[1] > iv[0]):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def concurrent_length(intervals: list[tuple[float, float]]) -> float:
    """Total length during which two or more of the ``(start, end)`` intervals run at once (an interval ending where
    another starts does not overlap it)."""
    edges = sorted([(e, -1) for s, e in intervals if e > s] + [(s, 1) for s, e in intervals if e > s])
    total, depth, last = 0.0, 0, None
    for t, step in edges:  # at equal times ends (-1) sort before starts
        if depth >= 2:
            total += t - last
        depth, last = depth + step, t
    return total


def gpu_busy(device_events: list[tuple[float, float, str]], marks: list[float], *, skip: int = PROFILE_SKIP,
             graph_launches: list[tuple[float, float]] = ()) -> dict:
    """GPU busy fraction between ``marks[skip]`` and ``marks[-1]`` (one mark per generated token).

    ``device_events``: ``(start, end, kind)`` with kind ``kernel`` / ``memcpy`` / ``memset`` (any time unit;
    results in ms assume ns).  ``graph_launches``: ``(start, end)`` of ``cudaGraphLaunch`` calls (host side).
    """
    marks = sorted(marks)
    if len(marks) < skip + 2:
        raise ValueError(f"{len(marks)} step markers in the trace, need at least {skip + 2}")
    w0, w1 = marks[skip], marks[-1]
    steps = len(marks) - 1 - skip
    clipped = [(max(s, w0), min(e, w1)) for s, e, *_ in device_events if e > w0 and s < w1]
    if not clipped:
        raise ValueError("no CUDA kernel / memcpy events inside the decode window "
                         "(CUPTI did not record device activity?)")
    busy = union_length(clipped)
    both = concurrent_length(clipped)  # device time with two or more operations running (e.g. loads beside compute)
    count = {k: sum(1 for s, _, kind, *_ in device_events if kind == k and w0 <= s < w1)
             for k in ("kernel", "memcpy", "memset")}
    return {"gpu_busy_fraction": busy / (w1 - w0), "kernels_per_step": count["kernel"] / steps,
            "memcpy_per_step": count["memcpy"] / steps, "memset_per_step": count["memset"] / steps,
            "gpu_busy_ms_per_step": busy / steps / 1e6, "concurrent_ms_per_step": both / steps / 1e6,
            "window_ms_per_step": (w1 - w0) / steps / 1e6,
            "graph_launches_per_step": sum(1 for t, _ in graph_launches if w0 <= t < w1) / steps,
            "profile_window_steps": steps}


def top_kernels(device_events: list[tuple], marks: list[float], *, skip: int = PROFILE_SKIP, n: int = 15) -> list[dict]:
    """The ``n`` operations that take the most time per decode step in the window of :func:`gpu_busy`:
    ``{"name", "ms_per_step", "count_per_step"}`` from ``(start, end, kind, name)`` events (ns; device operations,
    or :func:`split_events`' host CUDA calls), names cut to 80 characters (Inductor's fused kernels carry long
    names)."""
    marks = sorted(marks)
    if len(marks) < skip + 2:
        return []
    w0, w1 = marks[skip], marks[-1]
    steps = len(marks) - 1 - skip
    total: dict[str, list[float]] = {}
    for s, e, _, name, *_ in device_events:
        if w0 <= s < w1:
            t = total.setdefault(name[:80], [0.0, 0])
            t[0] += e - s
            t[1] += 1
    ranked = sorted(total.items(), key=lambda kv: -kv[1][0])[:n]
    return [{"name": k, "ms_per_step": v[0] / steps / 1e6, "count_per_step": v[1] / steps} for k, v in ranked]


def step_timeline(device_events: list[tuple], marks: list[float], *, skip: int = PROFILE_SKIP) -> list[list]:
    """One decode step of the window of :func:`gpu_busy` (its middle one) as device operations in start order:
    ``[start µs after the step's mark, µs, stream, name cut to 40 characters]`` from ``(start, end, kind, name[,
    stream])`` events (ns), so what ran beside what (a load stream's copies beside the compute, or not) can be read
    off one step."""
    marks = sorted(marks)
    if len(marks) < skip + 2:
        return []
    i = skip + (len(marks) - 1 - skip) // 2
    t0, t1 = marks[i], marks[i + 1]
    ops = sorted((ev[0], ev[1], ev[4] if len(ev) > 4 else -1, ev[3]) for ev in device_events if t0 <= ev[0] < t1)
    return [[round((s - t0) / 1e3, 1), round((e - s) / 1e3, 1), stream, name[:40]] for s, e, stream, name in ops]


def launch_offsets(device_events: list[tuple], marks: list[float], launches: list[tuple[float, float]], *,
                   skip: int = PROFILE_SKIP) -> dict:
    """Where a compiled step's time before its graph goes, median over the steps of :func:`gpu_busy`'s window:
    ``host_to_launch_ms``, from the step's mark (the previous token stamped) to the host's first graph launch
    (``generate``'s loop, the cache's eager hooks, dynamo's guards, the compiled wrappers); ``launch_to_device_ms``,
    from that launch to the first device operation starting after it (the launch's own latency), and of that
    ``launch_api_ms``, the host's ``cudaGraphLaunch`` call itself (``launches``: ``(start, end)``).  Empty without
    graph launches in the window."""
    marks = sorted(marks)
    host, device, api = [], [], []
    for t0, t1 in zip(marks[skip:], marks[skip + 1:]):
        launch, end = min(((t, e) for t, e in launches if t0 <= t < t1), default=(None, None))
        if launch is None:
            continue
        host.append(launch - t0)
        api.append(end - launch)
        first = min((ev[0] for ev in device_events if launch <= ev[0] < t1), default=None)
        if first is not None:
            device.append(first - launch)
    out = {"host_to_launch_ms": statistics.median(host) / 1e6, "launch_api_ms": statistics.median(api) / 1e6} \
        if host else {}  # ns -> ms
    if device:
        out["launch_to_device_ms"] = statistics.median(device) / 1e6
    return out


def device_kind(name: str, activity: str | None) -> str | None:
    """``kernel`` / ``memcpy`` / ``memset`` for a device-side profiler event, ``None`` for anything else
    (GPU user annotations: record_function ranges projected on the GPU timeline, which are no work)."""
    if activity:
        return {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}.get(activity)
    if name.startswith("Memcpy"):
        return "memcpy"
    if name.startswith("Memset"):
        return "memset"
    return "kernel"


def split_events(events, *, names: bool = False, api: list | None = None
                 ) -> tuple[list[tuple], list[float], list[tuple[float, float]]]:
    """(device events, step marks, graph launches ``(start, end)``) in ns, from kineto events
    (``prof.profiler.kineto_results.events()``) or, failing that, ``FunctionEvent``s (``prof.events()``, times in
    us).  A device event is ``(start, end, kind)``, with ``names`` ``(start, end, kind, name, stream)`` (the CUDA
    stream's id, -1 unknown).  ``api``: a list that receives ``(start, end, "api", name)`` of every host-side CUDA
    runtime or driver call (names ``cuda*`` / ``cu*``), from any thread: :func:`top_kernels` ranks them as it ranks
    device operations (e.g. a page-locking ``cuMemHostRegister`` on another thread that a graph launch waits on)."""
    dev, marks, launches = [], [], []
    for e in events:
        if hasattr(e, "start_ns"):
            name, start, end = e.name(), float(e.start_ns()), float(e.end_ns())
            on_device = str(e.device_type()).rsplit(".", 1)[-1] == "CUDA"
            activity = e.activity_type() if hasattr(e, "activity_type") else None
            annotation = e.is_user_annotation() if hasattr(e, "is_user_annotation") else False
            stream = e.device_resource_id() if hasattr(e, "device_resource_id") else -1
        else:
            name, start, end = e.name, 1e3 * e.time_range.start, 1e3 * e.time_range.end
            on_device = str(e.device_type).rsplit(".", 1)[-1] == "CUDA"
            activity = getattr(e, "activity_type", None)
            annotation = bool(getattr(e, "is_user_annotation", False))
            stream = getattr(e, "device_resource_id", -1)
        if name == MARK and not on_device:
            marks.append(start)
        elif on_device and not annotation and name != MARK:
            kind = device_kind(name, activity)
            if kind is not None:
                dev.append((start, end, kind, name, stream) if names else (start, end, kind))
        elif not on_device and name.startswith("cu"):
            if name in ("cudaGraphLaunch", "cudaGraphLaunch_v10000", "cuGraphLaunch"):
                launches.append((start, end))
            if api is not None:
                api.append((start, end, "api", name))
    return dev, marks, launches

