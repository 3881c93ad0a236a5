"""The rows of the benchmark (one cache configuration each) and what each name implies."""

from __future__ import annotations

ROWS = ("dynamic", "static", "offloaded", "flexicache", "flexicache-graph")


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
    return row == "flexicache-graph" or row == "static" or row.startswith("static-")


def is_profiled(row: str) -> bool:
    return is_compiled(row)


def probe_key(row: str, compiled_probes: bool) -> str:
    """Rows whose probes are the same calls share one search: an eager probe of ``flexicache-graph`` is
    exactly ``flexicache``'s."""
    return "flexicache" if row == "flexicache-graph" and not compiled_probes else row
