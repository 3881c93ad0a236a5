"""GPU micro-benchmarks (paper §4.4): ``python -m flexicache_hf.bench.decode`` and ``...bench.rerank``."""


def emit_json(out: dict, path=None) -> dict:
    """A benchmark's result: printed as one ``JSON {...}`` line (what a device run's log keeps) and, given a
    ``path``, written there indented."""
    import json

    print("JSON " + json.dumps(out))
    if path is not None:
        path.write_text(json.dumps(out, indent=1) + "\n")
    return out
