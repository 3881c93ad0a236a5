"""``python -m flexicache_hf.bench.compile_time`` on the CPU at one layer: each row compiles the decode step in one
graph in a fresh interpreter and reports the compile's phases."""

import json

from flexicache_hf.bench import compile_time


def test_each_row_compiles_one_graph_and_reports_its_phases(tmp_path, capsys):
    path = tmp_path / "compile.json"
    out = compile_time.main(["--layers", "1", "--rows", "flexicache,static", "--json", str(path)])
    assert json.loads(path.read_text()) == out
    assert [r["row"] for r in out["rows"]] == ["flexicache", "static"]
    for row in out["rows"]:
        assert row["graphs"] == 1 and row["layers"] == 1 and row["device"] == "cpu"
        phases = row["phases"]
        assert 0 < phases["_compile.compile_inner"] <= row["generate_s"]
        assert phases["Scheduler.__init__"] > 0
    assert out["command"].endswith("--layers 1 --rows flexicache,static --json " + str(path))
    assert capsys.readouterr().out.startswith("JSON ")


def test_the_unsized_row_compiles_the_readme_call_in_the_mode_given(tmp_path):
    out = compile_time.main(["--layers", "1", "--rows", "flexicache-unsized", "--mode", "default"])
    (row,) = out["rows"]
    assert row["row"] == "flexicache-unsized" and row["graphs"] == 1 and row["mode"] == "default"
