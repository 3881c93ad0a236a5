"""The eval's grids: canonical ones registered in code, archived ones as JSON beside their results, and the JSON
round trip between them (field types included: a budget of 1024 tokens is no budget of 1024.0)."""

import hashlib
import json
from dataclasses import fields, is_dataclass

import pytest

from flexicache_hf.eval import __main__ as cli
from flexicache_hf.eval.grids import (ARCHIVE, CANONICAL, GRID_FILE, UNRUN_FOLDER, EvalConfig, archived_grids, describe,
                                      grid_from_json, grid_to_json, load_grid, named_configs, read_grid)
from flexicache_hf.eval.policies import Policy

# sha256 (first 16 hex digits) of grid_to_json(grid) with no description, for each grid as the code made it before it
# was archived: the JSON files must keep giving exactly those grids.
ARCHIVED_DIGESTS = {
    "exact-qwen-cpu": "6d7bab89b97cdeef",
    "exact-qwen-cpu-32k": "8f716f6683b96996",
    "free-8k": "06c1c8cdbb8dd60b",
    "gpu-short": "b930851348fbcaf2",
    "later-question-cpu": "7f8112bf6268eef0",
    "mass-tasks-cpu": "f43b6984b4835241",
    "oracle-16k": "ed923a1a2bd8bfe5",
    "oracle-16k-pages8": "70a90d1750e40108",
    "oracle-cpu": "c9ef4409d39fa89f",
    "oracle-qwen-cpu": "417c1e65520fa4ab",
    "profiles-3k": "562e7e1d90ffbb5a",
    "profiles-qwen-cpu": "bece4a88e63923ee",
    "profiles-qwen-cpu-budgets": "de2d7be0d2e117ee",
    "profiles-qwen-cpu-recommended": "197ca2c18473fbae",
    "question-in-prompt-cpu": "473f127c55cb233c",
    "qwen-16k-later-question": "c7df05557e234db1",
    "qwen-16k-retention": "6d25c5d6b017c218",
    "qwen-16k-retention-oracle": "3630b848d6f7280f",
    "qwen-16k-retention-oracle-unstable": "fdb1033f570feb4e",
    "qwen-16k-retention-split": "11da684885f8eefb",
    "qwen-16k-retention-unstable": "23cbff3b3af6a2f8",
    "qwen-32k-later-question": "e42eaeed9df7fb7f",
    "qwen-32k-retention": "c473d69f102524d4",
    "qwen-32k-retention-multikey": "5e3dd707e9e76ad6",
    "qwen-32k-retention-split": "89f03a559c7fdfeb",
    "qwen-32k-retention-tuned": "9f02934a67e2bbb2",
    "qwen-32k-retention-unstable": "94096700abf73b31",
    "qwen-8k": "95d3a0c515911fea",
    "retention-shrink-qwen-cpu": "2c29c45760d5a7cd",
    "select-16k": "2fd10ff2a1958b6b",
    "select-16k-pages8": "3efaf8a013b7c981",
    "select-16k-rest": "f4f72999769aa2c1",
    "select-16k-seat": "3e3818b1a84fa60a",
    "select-16k-shrink": "7e547b66359b723f",
    "select-16k-split": "7d4edb00d74d0ef2",
    "select-16k-unstable": "e7740d53be1177af",
    "select-16k-unstable-random": "8e79c56cf69668cb",
    "select-cpu": "283a59a84a4007ff",
    "shrink-cpu": "5ab2ab872a59a2f7",
    "shrink-qwen-cpu": "cd6a6d382dea5b2b",
    "shrink-qwen-cpu-512": "39c32cd9b33aa307",
    "sinks-3k": "08c55abf865fe58d",
    "split-qwen-cpu": "704fca4e3e964ca1",
    "split-qwen-cpu-max-shrink": "3d822ac8b3df8472",
}


def same(a, b, where="grid"):
    """``a == b`` with the type of every value too (EvalConfig's ``==`` takes 1024 for 1024.0, a list for a tuple
    nowhere, and skips ``extra``)."""
    if is_dataclass(a):
        assert type(a) is type(b), where
        for f in fields(a):
            same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
        return
    assert type(a) is type(b), (where, a, b)
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b), (where, a, b)
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), (where, a, b)
        for k in a:
            same(a[k], b[k], f"{where}[{k}]")
    else:
        assert a == b, (where, a, b)


def test_archived_grids_are_the_grids_the_code_made():
    archived = archived_grids()
    assert set(archived) == set(ARCHIVED_DIGESTS)
    for name, path in archived.items():
        cfg = read_grid(path)
        assert cfg.name == name and name not in CANONICAL
        assert hashlib.sha256(grid_to_json(cfg).encode()).hexdigest()[:16] == ARCHIVED_DIGESTS[name], name
        about = json.loads(path.read_text())["about"]
        assert about and path.read_text() == grid_to_json(cfg, about)  # the file is what grid_to_json writes


def test_archived_grids_sit_beside_their_results():
    for name, path in archived_grids().items():
        if path.parent.name == UNRUN_FOLDER:
            ran = {json.loads(r.read_text())["config"]["name"].split("/")[0] for r in ARCHIVE.glob("*/results.json")}
            assert path.stem == name and name not in ran
        else:
            assert path.name == GRID_FILE
            ran = json.loads((path.parent / "results.json").read_text())["config"]["name"]
            assert ran.split("/")[0] == name  # "<grid>" or "<grid>/<part>"


@pytest.mark.parametrize("name", list(named_configs()))
def test_json_round_trip_keeps_every_field_and_type(name):
    cfg = load_grid(name)
    back = grid_from_json(grid_to_json(cfg, "about"))
    same(back, cfg)
    assert [p.label for p in back.task_policies()] == [p.label for p in cfg.task_policies()]
    assert [p.label for p in back.fidelity_policies()] == [p.label for p in cfg.fidelity_policies()]


def test_round_trip_of_every_kind_of_value():
    cfg = EvalConfig(name="kinds", budgets=(1 / 16, 1024), task_indices=(3,), fidelity_doc_indices=None,
                     task_extra=(Policy("flexicache", 2048, 1, 0.375, "random", 1, 4, "mass", 0.5, ("exact", 1.0)),
                                 Policy("quest", 1 / 8), Policy("dense")),
                     extra={"note": [1, 2]})
    back = grid_from_json(grid_to_json(cfg))
    same(back, cfg)
    labels = [p.label for p in back.task_policies()]
    assert back.extra == {"note": [1, 2]} and {"quest@1/16", "quest@1024"} <= set(labels)
    assert labels[-2:] == ["flexicache-R1-u38-random-sink1-recent4-mass-shrink0.5-unstable-exact@2048", "quest@1/8"]
    with pytest.raises(TypeError):
        grid_from_json(json.dumps({"config": {"name": "x", "no_such_field": 1}}))


def test_canonical_grids_by_name_and_archived_ones_by_name_or_path(tmp_path):
    assert list(named_configs())[:len(CANONICAL)] == list(CANONICAL)
    for name, make in CANONICAL.items():
        assert make().name == name and 0 < len(describe(name)) <= 90
    assert {"tiny", "full", "qwen-16k", "qwen-32k", "select-16k-exact"} <= set(CANONICAL)
    name, path = next(iter(archived_grids().items()))
    same(load_grid(name), load_grid(str(path)))
    mine = tmp_path / "mine.json"
    mine.write_text(grid_to_json(EvalConfig(name="mine", samples=2)))
    assert load_grid(str(mine)) == EvalConfig(name="mine", samples=2)
    with pytest.raises(ValueError, match="no grid"):
        load_grid("no-such-grid")


def test_cli_help_lists_canonical_grids_first_then_where_archived_ones_live(capsys, tmp_path):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = capsys.readouterr().out
    first = text.index("canonical grids")
    assert all(text.index(f"  {n} ") > first for n in CANONICAL)
    assert text.index("archived grids") > max(text.index(f"  {n} ") for n in CANONICAL)
    assert "grid.json" in text and UNRUN_FOLDER in text and "select-16k-shrink" in text
    with pytest.raises(SystemExit) as e:
        cli.main(["--config", "no-such-grid", "--out", str(tmp_path)])
    assert e.value.code == 2 and "no grid" in capsys.readouterr().err


def test_overlap_loads_policy_and_its_grid():
    from flexicache_hf.eval.grids import grid_from_json, grid_to_json, named_configs
    from flexicache_hf.eval.policies import Policy

    with pytest.raises(ValueError, match="overlap_loads"):
        Policy("quest", 64, overlap_loads=True)
    assert Policy("flexicache", 64, overlap_loads=True).label == "flexicache-R16-u25-overlap@64"
    cfg = named_configs()["overlap-16k"]()
    rows = cfg.fidelity_policies()
    assert [p.overlap_loads for p in rows if p.family == "flexicache"] == [False, True, False, True]
    assert all(p.rerank_interval == 8 and p.keep_margin == 1.0 and p.stagger_reranks for p in rows
               if p.family == "flexicache")
    back = grid_from_json(grid_to_json(cfg))
    assert [p.label for p in back.fidelity_policies()] == [p.label for p in rows]
    assert "overlap_loads" not in grid_to_json(named_configs()["keep-16k"]())  # archived grids' policies unchanged
