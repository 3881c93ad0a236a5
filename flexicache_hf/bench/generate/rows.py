"""The rows of the benchmark (one cache configuration each) and what each name implies."""

from __future__ import annotations

DEFAULT_ROWS = ("dynamic", "static", "offloaded", "flexicache", "flexicache-graph", "flexicache-unsized",
                "flexicache-paper")
ROWS = DEFAULT_ROWS + ("flexicache-overlap",)
# ``flexicache-unsized``: the README's first example exactly, ``generate(..., past_key_values=FlexiCache(profile))``:
# the config's defaults (no budget or other flag of the run), no max_cache_len, and generate left to decide whether
# to compile (it compiles the decode step of a cache that says it is compileable).  ``flexicache`` (eager) and
# ``flexicache-graph`` (compiled): sized, the profile's settings with the run's flags on top;
# ``flexicache-paper``: sized and compiled, ``FlexiCacheConfig.paper()`` with the flags on top;
# ``flexicache-overlap``: ``flexicache-graph`` with ``overlap_loads=True``.


def expand_rows(rows: list[str], static_variants: list[str]) -> list[str]:
    """``static`` becomes one row per attention variant (``sdpa`` -> ``static``, else ``static-<impl>``)."""
    out: list[str] = []
    for row in rows:
        names = [static_row(v) for v in static_variants] if row == "static" else [row]
        out.extend(n for n in names if n not in out)
    return out


def static_row(impl: str) -> str:
    return "static" if impl == "sdpa" else f"static-{impl}"


def check_rows(rows: list[str]) -> list[str]:
    """The names among ``rows`` that are no row (``static-<impl>`` is one for any impl)."""
    return sorted(r for r in set(rows) if r not in ROWS and not (r.startswith("static-") and len(r) > 7))


def attn_impl(row: str) -> str:
    if row.startswith("flexicache"):
        return "flexicache"
    if row.startswith("static-"):
        return row[len("static-"):]
    return "sdpa"


def is_compiled(row: str) -> bool:
    """Rows whose decode step ``generate`` compiles."""
    return (row in ("flexicache-graph", "flexicache-paper", "flexicache-overlap") or row == "static"
            or row.startswith("static-"))


def is_user_call(row: str) -> bool:
    """Rows whose ``generate`` call sets nothing the README's call does not (``disable_compile`` included): generate
    compiles or not as it would for a user; warmed up at the measured shape like the compiled rows."""
    return row == "flexicache-unsized"


def is_profiled(row: str) -> bool:
    return is_compiled(row) or is_user_call(row)


def probe_key(row: str, compiled_probes: bool) -> str:
    """Rows whose probes are the same calls share one search: an eager probe of ``flexicache-graph`` is
    exactly ``flexicache``'s."""
    return "flexicache" if row == "flexicache-graph" and not compiled_probes else row
