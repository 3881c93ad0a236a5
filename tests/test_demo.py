"""`make demo`'s job, small: generate with FlexiCache on the embedded SmolLM2 and report what it saved."""

from flexicache_hf import FlexiCache, FlexiCacheConfig, demo


def test_demo_uses_the_profiles_settings_and_reports_savings(capsys):
    report = demo.main(["--prompt-tokens", "600", "--new-tokens", "6", "--budget", "128", "--no-dense"])
    expected = FlexiCache(demo.DEMO_PROFILE, token_budget=128)  # the profile's settings, the budget alone set
    cfg = expected.config
    assert report["settings_source"] == expected.settings_source != "FlexiCacheConfig defaults + token_budget=128"
    assert (report["page_size"], report["sink_pages"], report["recent_pages"], report["group_score"],
            report["unstable_group_score"]) == (cfg.page_size, cfg.sink_pages, cfg.recent_pages, cfg.group_score,
                                                cfg.unstable_group_score)
    assert report["unstable_heads"] == len(expected.profile.unstable)  # the profile re-cut to its settings' fraction
    assert report["new_tokens"] == 6 and report["device_bytes"] < report["dense_bytes"]
    # K pages; a stable head also the page begun since its last re-rank (the prompt ends on a page boundary)
    assert 128 // cfg.page_size <= report["pages_per_head_step"] <= 128 // cfg.page_size + 1
    out = capsys.readouterr().out
    assert f"settings            {expected.settings_source}" in out


def test_demo_flags_override_single_settings_and_paper_gives_the_papers(capsys):
    report = demo.main(["--prompt-tokens", "400", "--new-tokens", "4", "--budget", "128", "--no-dense",
                        "--sink-pages", "1", "--recent-pages", "2", "--page-size", "16"])
    assert (report["page_size"], report["sink_pages"], report["recent_pages"]) == (16, 1, 2)
    assert report["settings_source"].endswith("+ page_size=16 + sink_pages=1 + recent_pages=2")
    assert "1 sink + 2 recent pages kept" in capsys.readouterr().out
    report = demo.main(["--prompt-tokens", "400", "--new-tokens", "4", "--budget", "128", "--no-dense", "--paper"])
    paper = FlexiCacheConfig.paper(token_budget=128)
    assert report["settings_source"] == "config=" and (report["page_size"], report["group_score"]) == (16, "max")
    assert (report["sink_pages"], report["bound_shrink"], report["unstable_group_score"]) == (
        paper.sink_pages, paper.bound_shrink, paper.unstable_group_score)


def test_demo_agreement_with_a_budget_covering_every_page_is_exact(capsys):
    report = demo.main(["--prompt-tokens", "400", "--new-tokens", "8", "--budget", "1024"])
    n = report["new_tokens"]
    assert report["teacher_forced_top1"] == 1.0 and report["greedy_agreement_tokens"] == n
    assert f"free-running, the first {n} of {n} tokens are identical" in capsys.readouterr().out
