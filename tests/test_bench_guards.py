"""``bench.guards``: Dynamo's per-call work around a compiled decode step, on a 2-layer narrow shape (CPU)."""

from __future__ import annotations

from flexicache_hf.bench.guards import guard_counts, main


def test_guard_counts_reads_the_kinds_from_a_guard_tree():
    text = "RootGuardManager\n| +- TENSOR_MATCH: x\n| +- LAMBDA_GUARD: a is b\n\n| +- NO_TENSOR_ALIASING\n"
    assert guard_counts(text) == {"guard_lines": 4, "tensor_match": 1, "no_aliasing_tensors": 1, "lambda_guards": 1}


def test_both_rows_measure_a_call_around_their_graph_and_its_guards():
    out = main(["--layers", "2", "--calls", "3"])
    rows = {r["row"]: r for r in out["rows"]}
    assert set(rows) == {"static", "flexicache"}
    for r in rows.values():
        assert r["us_per_call"] > 0 and r["graph_inputs"] > 0 and r["graph_nodes"] > 0
        assert r["tensor_match"] > 0 and r["guard_lines"] > r["tensor_match"]
        assert 0 < r["guard_check_us"] < r["us_per_call"] * 5  # the frame's locals found: its guards pass
    # StaticCache's two tensors a layer are graph inputs; FlexiCache's graph reads one tensor of the whole cache (its
    # schedule's length: a layer's step is one op, graph_step.py)
    assert rows["flexicache"]["graph_inputs"] < rows["static"]["graph_inputs"]
