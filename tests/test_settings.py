"""A profile's settings: round trip, validation naming the file, and what FlexiCache(profile) resolves to."""

import json
import pickle

import pytest
from transformers import LlamaConfig

from flexicache_hf import FlexiCache, FlexiCacheConfig
from flexicache_hf.head_profile import HeadProfile, ProfileError, available_profiles, resolve_profile
from flexicache_hf.settings import ProfileSettings, SettingsError, resolve_settings

FIELDS = {"page_size": 8, "group_score": "mass", "bound_shrink": 0.5, "unstable_group_score": "exact"}


def tiny(layers=4, kv=2):
    return LlamaConfig(num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=kv, hidden_size=64,
                       intermediate_size=64, vocab_size=32)


def measured(settings=None):
    scores = {(l, h): l + h / 10 for l in range(4) for h in range(2)}
    p = HeadProfile.from_scores(tiny(), scores, fraction=0.25, provenance={"kind": "measured"})
    return p if settings is None else HeadProfile(p.model, p.unstable, p.scores, p.provenance, settings=settings)


def settings(**extra):
    return ProfileSettings.from_dict({**FIELDS, "unstable_fraction": 0.5, "source": "accuracy/grid-x", **extra})


def test_round_trip_with_settings(tmp_path):
    p = measured(settings(note="not measured on this model"))
    q = HeadProfile.load(p.save(tmp_path / "p.json"))
    assert q == p and q.settings == p.settings and q.settings.config_fields == FIELDS
    assert q.settings.unstable_fraction == 0.5 and q.settings.note == "not measured on this model"
    d = json.loads((tmp_path / "p.json").read_text())["settings"]
    assert d == {**FIELDS, "unstable_fraction": 0.5, "source": "accuracy/grid-x", "note": "not measured on this model"}
    assert pickle.loads(pickle.dumps(p)) == p
    # a profile without settings writes none (old files load unchanged and save byte for byte)
    plain = measured()
    assert "settings" not in plain.to_dict() and HeadProfile.load(plain.save(tmp_path / "q.json")).settings is None


@pytest.mark.parametrize("bad, message", [
    ({"page_size": 12}, "page_size"),
    ({"no_such_field": 1}, "unknown FlexiCacheConfig fields"),
    ({"unstable_fraction": 1.5}, "unstable_fraction"),
    ({"source": ""}, "source"),
    ({"token_budget": 20}, "token_budget"),
])
def test_bad_settings_raise_naming_the_file(tmp_path, bad, message):
    d = measured(settings()).to_dict()
    d["settings"].update(bad)
    path = tmp_path / "broken-profile.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ProfileError, match=message) as e:
        HeadProfile.load(path)
    assert "broken-profile.json" in str(e.value) and "settings" in str(e.value)


def test_settings_need_a_source_and_scores_to_recut(tmp_path):
    with pytest.raises(SettingsError, match="source"):
        ProfileSettings.from_dict(FIELDS)
    with pytest.raises(ProfileError, match="needs per-head scores"):
        HeadProfile.from_unstable(tiny(), [(0, 1)]).__class__(
            HeadProfile.from_unstable(tiny(), [(0, 1)]).model, {(0, 1)}, settings=settings())
    # scores that miss a head: refused when the profile is read (naming its file), not when a cache re-cuts it
    d = measured(settings()).to_dict()
    d["scores"].pop()
    path = tmp_path / "unscored-head.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ProfileError, match=r"unscored-head\.json: scores must cover all 4x2 heads"):
        HeadProfile.load(path)
    # without a fraction a published head list (no scores) may carry settings
    p = HeadProfile(HeadProfile.all_stable(tiny()).model, {(0, 1)}, settings={**FIELDS, "source": "s"})
    assert p.settings.unstable_fraction is None and p.settings.config_fields == FIELDS


def test_precedence():
    p = measured(settings())
    # no config: the profile's settings, the profile re-cut to their fraction
    cache = FlexiCache(p)
    assert cache.config == FlexiCacheConfig(**FIELDS) and cache.settings_source == "accuracy/grid-x"
    assert cache.profile.unstable == p.least_stable(0.5).unstable and len(cache.profile.unstable) == 4
    assert cache.profile.settings.unstable_fraction is None  # cut once: passing it on does not cut again
    assert FlexiCache(cache.profile).profile.unstable == cache.profile.unstable
    assert "settings: accuracy/grid-x" in repr(cache)
    # keyword fields override single fields on top of the settings
    cache = FlexiCache(p, token_budget=1024, sink_pages=1)
    assert cache.config == FlexiCacheConfig(**FIELDS, token_budget=1024, sink_pages=1)
    assert cache.settings_source == "accuracy/grid-x + token_budget=1024 + sink_pages=1"
    # config= wins wholesale: no settings, no re-cut
    cache = FlexiCache(p, FlexiCacheConfig.paper())
    assert cache.config == FlexiCacheConfig.paper() and cache.profile is p and cache.settings_source == "config="
    with pytest.raises(TypeError, match="not both"):
        FlexiCache(p, FlexiCacheConfig(), token_budget=1024)
    # a profile without settings: FlexiCacheConfig's own defaults, the profile as it is
    plain = HeadProfile.random(tiny(), 0.25)
    cache = FlexiCache(plain, token_budget=1024)
    assert cache.config == FlexiCacheConfig(token_budget=1024) and cache.profile is plain
    assert cache.settings_source == "FlexiCacheConfig defaults + token_budget=1024"


def test_an_override_that_clashes_with_the_settings_names_the_settings_field():
    """The user passed only ``unstable_bound_shrink``: the refusal names the profile's ``unstable_group_score`` as
    the other side; an override wrong on its own is refused as FlexiCacheConfig refuses it."""
    p = measured(settings())
    from flexicache_hf import ConfigError

    with pytest.raises(ConfigError, match=r"unstable_group_score='exact': the profile's settings; override that too"):
        FlexiCache(p, unstable_bound_shrink=0.5)
    with pytest.raises(ConfigError, match=r"token_budget must be a multiple of page_size \(8\).*page_size=8: the prof"):
        FlexiCache(p, token_budget=12)
    with pytest.raises(ConfigError, match=r"rerank_interval must be a positive integer, got 0$"):
        FlexiCache(p, rerank_interval=0)


def test_resolve_settings_is_the_one_place():
    p = measured(settings())
    prof, cfg, source = resolve_settings(p, None, {})
    assert cfg.page_size == 8 and len(prof.unstable) == 4 and source == "accuracy/grid-x"
    with pytest.raises(TypeError, match="FlexiCacheConfig"):
        resolve_settings(p, {"page_size": 8}, {})


def test_shipped_profiles_carry_settings_with_their_source():
    for stem, path in available_profiles().items():
        p = HeadProfile.load(path)
        assert p.settings is not None, stem
        assert "accuracy" in p.settings.source, stem
        FlexiCache(p)  # resolves: valid settings, a re-cut only where the profile has scores
    qwen = resolve_profile("Qwen2.5-Coder-0.5B-Instruct")
    assert qwen.settings.config_fields == {**FIELDS, "rerank_interval": 8, "keep_margin": 1.0}
    assert qwen.settings.unstable_fraction == 0.375
    cache = FlexiCache(qwen)
    assert cache.config.token_budget == FlexiCacheConfig().token_budget and cache.profile.unstable_fraction == 0.375
    assert "select-16k-exact-gpu" in cache.settings_source and "keep-16k-gpu" in cache.settings_source
    assert cache.config.rerank_interval == 8 and cache.config.keep_margin == 1.0
