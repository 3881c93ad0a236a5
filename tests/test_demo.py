"""`make demo`'s job, small: generate with FlexiCache on the embedded SmolLM2 and report what it saved."""

from flexicache_hf import demo


def test_demo_reports_savings_and_its_selection_options(capsys):
    report = demo.main(["--prompt-tokens", "600", "--new-tokens", "6", "--budget", "128", "--no-dense",
                        "--sink-pages", "1", "--recent-pages", "2"])
    assert report["new_tokens"] == 6 and (report["sink_pages"], report["recent_pages"]) == (1, 2)
    assert report["device_bytes"] < report["dense_bytes"]  # 128 of ~600 tokens on the device for stable heads
    # K pages; a stable head also the page begun since its last re-rank (the prompt ends on a page boundary)
    assert 128 // 16 <= report["pages_per_head_step"] <= 128 // 16 + 1
    assert "1 sink + 2 recent pages kept" in capsys.readouterr().out


def test_demo_agreement_with_a_budget_covering_every_page_is_exact(capsys):
    report = demo.main(["--prompt-tokens", "400", "--new-tokens", "8", "--budget", "1024"])
    n = report["new_tokens"]
    assert report["teacher_forced_top1"] == 1.0 and report["greedy_agreement_tokens"] == n
    assert f"free-running, the first {n} of {n} tokens are identical" in capsys.readouterr().out
