import dataclasses
import json

import pytest
from hypothesis import given, settings, strategies as st
from transformers import LlamaConfig, MistralConfig, Qwen2Config

from flexicache_hf.head_profile import (
    FORMAT_VERSION, HeadProfile, ModelIdentity, ProfileError, available_profiles, resolve_profile,
)

SHIPPED = {  # stem: (name, architecture, model_type, layers, heads, kv_heads, head_dim, n_unstable, context)
    "Llama-3.1-8B-Instruct": ("meta-llama/Llama-3.1-8B-Instruct", "LlamaForCausalLM", "llama", 32, 32, 8, 128, 64,
                              131072),
    "Mistral-7B-Instruct-v0.2": ("mistralai/Mistral-7B-Instruct-v0.2", "MistralForCausalLM", "mistral", 32, 32, 8, 128,
                                 64, 32768),
    "Mistral-Small-24B-Instruct-2501": (
        "mistralai/Mistral-Small-24B-Instruct-2501", "MistralForCausalLM", "mistral", 40, 32, 8, 128, 80, 32768),
    "Qwen2.5-32B-Instruct": ("Qwen/Qwen2.5-32B-Instruct", "Qwen2ForCausalLM", "qwen2", 64, 40, 8, 128, 128, 32768),
}


def tiny(cls=LlamaConfig, layers=4, heads=4, kv=2, hidden=64):
    return cls(num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
               hidden_size=hidden, intermediate_size=64, vocab_size=32)


def test_identity_from_configs():
    for cls, arch in ((LlamaConfig, "LlamaForCausalLM"), (MistralConfig, "MistralForCausalLM"),
                      (Qwen2Config, "Qwen2ForCausalLM")):
        m = ModelIdentity.from_config(tiny(cls))
        assert (m.architecture, m.num_layers, m.num_attention_heads, m.num_kv_heads, m.head_dim) == (arch, 4, 4, 2, 16)
    c = tiny(layers=2, heads=8, kv=None, hidden=64)  # MHA: kv heads default to the attention heads
    assert ModelIdentity.from_config(c).num_kv_heads == 8
    c.architectures = ["Custom"]
    assert ModelIdentity.from_config(c).architecture == "Custom"


def test_same_shape_ignores_name_and_architecture():
    a = ModelIdentity("LlamaForCausalLM", "llama", 4, 4, 2, 16, "x")
    b = ModelIdentity("Other", "llama", 4, 4, 2, 16, None)
    assert a.same_shape(b) and not a.same_shape(ModelIdentity("L", "llama", 5, 4, 2, 16))


def test_queries():
    p = HeadProfile.from_unstable(tiny(), [(0, 1), (2, 0), (2, 1)])
    assert p.unstable_heads(2) == (0, 1) and p.stable_heads(2) == ()
    assert p.unstable_heads(1) == () and p.stable_heads(0) == (0,)
    assert p.is_unstable(0, 1) and not p.is_unstable(0, 0)
    assert p.unstable_fraction == 3 / 8
    with pytest.raises(ProfileError, match="layer"):
        p.unstable_heads(4)
    with pytest.raises(ProfileError, match="out of range"):
        p.is_unstable(0, 2)
    hash(p)  # usable as a dict key despite the mapping fields
    with pytest.raises(TypeError):
        p.provenance["kind"] = "changed"


def test_constructors():
    c = tiny()
    assert HeadProfile.all_stable(c).unstable_fraction == 0.0
    assert HeadProfile.all_unstable(c).unstable_fraction == 1.0
    r = HeadProfile.random(c, fraction=0.25, seed=3)
    assert len(r.unstable) == 2 and r == HeadProfile.random(c, fraction=0.25, seed=3)
    assert r.provenance["kind"] == "random"
    seeds = {HeadProfile.random(c, seed=s).unstable for s in range(8)}
    assert len(seeds) > 1
    big = tiny(layers=30, heads=9, kv=3, hidden=576)  # SmolLM2-135M shape
    assert len(HeadProfile.random(big, fraction=0.3, seed=0).unstable) == 27


def test_from_scores_ranks_and_breaks_ties():
    c = tiny(layers=2, kv=2)
    scores = {(0, 0): 0.5, (0, 1): 0.1, (1, 0): 0.5, (1, 1): 0.9}
    p = HeadProfile.from_scores(c, scores, fraction=0.5, provenance={"kind": "measured"})
    assert p.unstable == {(0, 1), (0, 0)}  # 0.1, then the (0, 0) / (1, 0) tie goes to (0, 0)
    assert p.scores == scores and p.provenance["kind"] == "measured"
    assert p == HeadProfile.from_scores(c, dict(reversed(scores.items())), 0.5, {"kind": "measured"})
    with pytest.raises(ProfileError, match="no score"):
        HeadProfile.from_scores(c, {(0, 0): 1.0})
    with pytest.raises(ProfileError, match="finite"):
        HeadProfile.from_scores(c, {**scores, (1, 1): float("nan")})
    with pytest.raises(ProfileError, match="fraction"):
        HeadProfile.from_scores(c, scores, fraction=1.5)


def test_least_stable_recuts_a_measured_profile_from_its_scores():
    c = tiny(layers=2, kv=2)
    scores = {(0, 0): 0.5, (0, 1): 0.1, (1, 0): 0.7, (1, 1): 0.9}
    p = HeadProfile.from_scores(c, scores, fraction=0.25, provenance={"kind": "measured"})
    wider = p.least_stable(0.75)
    assert p.unstable == {(0, 1)} and wider.unstable == {(0, 1), (0, 0), (1, 0)}
    assert wider.scores == scores and wider.provenance["kind"] == "measured"
    assert wider.provenance["fraction"] == 0.75 and wider.provenance["recut_from_fraction"] == 0.25
    assert wider.least_stable(0.25).unstable == p.unstable  # the same cut whatever it was cut from
    with pytest.raises(ProfileError, match="no per-head scores"):
        HeadProfile.from_unstable(c, [(0, 1)]).least_stable(0.5)
    with pytest.raises(ProfileError, match="fraction"):
        p.least_stable(2.0)


def test_save_load_round_trip(tmp_path):
    p = HeadProfile.from_scores(tiny(), {(l, h): l + h / 10 for l in range(4) for h in range(2)},
                                provenance={"kind": "measured", "tokens": [1, 2]})
    path = p.save(tmp_path / "p.json")
    q = HeadProfile.load(path)
    assert q == p and q.scores == p.scores and q.model == p.model
    d = json.loads(path.read_text())
    assert d["format"] == "flexicache-head-profile" and d["unstable_heads"] == sorted(d["unstable_heads"])
    assert d["scores"][0] == [0, 0, 0.0]


def _write(tmp_path, d):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    return path


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(format="something-else"), "not a head profile"),
    (lambda d: d.update(format_version=FORMAT_VERSION + 1), "upgrade"),
    (lambda d: d.update(format_version="1"), "format_version"),
    (lambda d: d.pop("scores"), "missing"),
    (lambda d: d.update(extra=1), "unexpected"),
    (lambda d: d.update(unstable_heads=[[0, 9]]), "out of range"),
    (lambda d: d.update(unstable_heads=[[4, 0]]), "out of range"),
    (lambda d: d.update(unstable_heads=[[0, 0], [0, 0]]), "twice"),
    (lambda d: d.update(unstable_heads=[[0, "1"]]), "pair of integers"),
    (lambda d: d.update(unstable_heads={"0": 1}), "must be a list"),
    (lambda d: d.update(scores=[[0, 0]]), r"\[layer, kv_head, ts\]"),
    (lambda d: d.update(scores=[[9, 0, 1.0]]), "out of range"),
    (lambda d: d.update(provenance=[]), "provenance"),
    (lambda d: d["model"].pop("num_layers"), "missing keys"),
    (lambda d: d["model"].update(num_layers=0), "positive integer"),
    (lambda d: d["model"].update(num_kv_heads=3), "multiple"),
])
def test_load_rejects(tmp_path, mutate, message):
    d = HeadProfile.all_unstable(tiny()).to_dict()
    mutate(d)
    with pytest.raises(ProfileError, match=message):
        HeadProfile.load(_write(tmp_path, d))


def test_load_rejects_non_json_and_missing(tmp_path):
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(ProfileError, match="cannot read"):
        HeadProfile.load(tmp_path / "x.json")
    with pytest.raises(ProfileError, match="no head profile file"):
        HeadProfile.load(tmp_path / "absent.json")
    with pytest.raises(ProfileError, match="JSON object"):
        HeadProfile.from_dict([1, 2])


def test_check_model_names_both_shapes():
    p = HeadProfile.all_stable(tiny(LlamaConfig))
    p.check_model(tiny(LlamaConfig))
    for other in (tiny(MistralConfig), tiny(Qwen2Config), tiny(LlamaConfig, layers=5), tiny(LlamaConfig, kv=4)):
        with pytest.raises(ProfileError) as e:
            p.check_model(other)
        msg = str(e.value)
        assert "llama: 4 layers" in msg and ModelIdentity.from_config(other).describe() in msg


def test_bad_construction():
    m = ModelIdentity.from_config(tiny())
    with pytest.raises(ProfileError, match="JSON-serialisable"):
        HeadProfile(m, frozenset(), provenance={"f": object()})
    with pytest.raises(ProfileError, match="pair of integers"):
        HeadProfile.from_unstable(m, [(True, 0)])
    with pytest.raises(ProfileError, match="model_type"):
        ModelIdentity.from_config(object())


@pytest.mark.parametrize("stem", sorted(SHIPPED))
def test_shipped_profiles(stem):
    name, arch, mt, layers, heads, kv, hd, n, context = SHIPPED[stem]
    p = HeadProfile.load(available_profiles()[stem])
    assert p.model == ModelIdentity(arch, mt, layers, heads, kv, hd, name, context)
    assert len(p.unstable) == n and p.unstable_fraction == 0.25
    assert p.scores is None and p.provenance["kind"] == "published"
    assert p.provenance["list"] == f"unstable-{n}-profile-gov_report-topk-64"
    cfg_cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}[mt]
    p.check_model(cfg_cls(num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                          hidden_size=heads * hd))
    for spec in (stem, name, name.lower(), f"someone/{stem}", str(available_profiles()[stem])):
        assert resolve_profile(spec) == p


def test_resolve(tmp_path):
    assert set(SHIPPED) <= set(available_profiles())
    p = HeadProfile.random(tiny(), seed=1)
    assert resolve_profile(p) is p
    path = p.save(tmp_path / "tiny-model.json")
    assert resolve_profile(path) == p and resolve_profile(str(path)) == p
    assert resolve_profile("tiny-model", profiles_dir=tmp_path) == p
    with pytest.raises(ProfileError) as e:
        resolve_profile("no-such-model")
    assert all(stem in str(e.value) for stem in SHIPPED)
    with pytest.raises(ProfileError, match="tiny-model"):
        resolve_profile("other", profiles_dir=tmp_path)
    with pytest.raises(ProfileError, match="none"):
        resolve_profile("x", profiles_dir=tmp_path / "empty")
    with pytest.raises(ProfileError, match="no head profile file"):
        resolve_profile(str(tmp_path / "absent.json"))
    with pytest.raises(ProfileError, match="expected a HeadProfile"):
        resolve_profile(3)


def test_an_unreadable_profile_file_does_not_hide_the_others_from_a_lookup_by_name(tmp_path):
    """A broken ``*.json`` beside a good profile: the good one is found by its recorded model name, and an unknown
    name is answered as unknown, naming the broken file as skipped (its read error answered both before)."""
    random = HeadProfile.random(tiny(), seed=1)
    p = dataclasses.replace(random, model=dataclasses.replace(random.model, name="org/My-Model"))
    p.save(tmp_path / "good.json")
    (tmp_path / "aaa-broken.json").write_text('{"format": "flexicache-head-profile", ')
    assert resolve_profile("org/My-Model", profiles_dir=tmp_path) == p
    assert resolve_profile("my-model", profiles_dir=tmp_path) == p
    with pytest.raises(ProfileError, match=r"no head profile named 'other'.*skipped unreadable.*aaa-broken\.json"):
        resolve_profile("other", profiles_dir=tmp_path)
    with pytest.raises(ProfileError, match="cannot read head profile"):  # asked for by its own name: its error
        resolve_profile("aaa-broken", profiles_dir=tmp_path)


@st.composite
def profiles(draw):
    kv = draw(st.integers(1, 4))
    m = ModelIdentity("LlamaForCausalLM", "llama", draw(st.integers(1, 6)), kv * draw(st.integers(1, 3)), kv,
                      draw(st.sampled_from([8, 64, 128])), draw(st.none() | st.text(max_size=20)))
    every = [(l, h) for l in range(m.num_layers) for h in range(m.num_kv_heads)]
    unstable = draw(st.sets(st.sampled_from(every)))
    score = st.floats(allow_nan=False, allow_infinity=False)
    scores = draw(st.none() | st.dictionaries(st.sampled_from(every), score)
                  | st.fixed_dictionaries({h: score for h in every}))
    prov = draw(st.dictionaries(st.text(max_size=8), st.integers() | st.text(max_size=8) | st.lists(st.integers(), max_size=3)))
    fields = draw(st.fixed_dictionaries({}, optional={"page_size": st.sampled_from([8, 16]),
                                                       "group_score": st.sampled_from(["max", "mass"]),
                                                       "bound_shrink": st.sampled_from([0.5, 1.0]),
                                                       "sink_pages": st.integers(0, 2)}))
    fraction = st.none() | st.sampled_from([0.25, 0.375]) if scores and len(scores) == len(every) else st.none()
    settings = draw(st.none() | st.builds(lambda f: {**fields, "source": "grid", **({} if f is None else
                                                     {"unstable_fraction": f})}, fraction))
    return HeadProfile(m, frozenset(unstable), scores, prov, settings=settings)


@settings(max_examples=60, deadline=None)
@given(profiles())
def test_json_round_trip_property(p):
    q = HeadProfile.from_dict(json.loads(p.to_json()))
    assert q == p and hash(q) == hash(p) and q.to_dict() == p.to_dict()
