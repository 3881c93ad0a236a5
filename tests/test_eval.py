"""The accuracy-retention harness (flexicache_hf.eval) on a tiny random Llama: scorers, tasks, eviction
caches, policy equivalences and a whole tiny run."""

import random
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig

import flexicache_hf  # noqa: F401
from flexicache_hf import FlexiCache, FlexiCacheConfig, HeadProfile
from flexicache_hf.eval import fidelity, report, runner
from flexicache_hf.eval.decoding import greedy
from flexicache_hf.eval.eviction import EvictionCache, LServeLayer, lserve_cache, snapkv_cache, streaming_cache
from flexicache_hf.eval.grids import EvalConfig, full, only
from flexicache_hf.eval.policies import Policy, ProfileSource, make_cache
from flexicache_hf.eval.scorers import agreement_length, contains, lcs_length, match_all, rouge_l
from flexicache_hf.eval.tasks import make_samples, render, render_split, task_makers


class CharTokenizer:
    """Characters -> ids 1..126 (127 is EOS): enough tokenizer for tasks on a 128-token random model."""

    eos_token_id = 127
    chat_template = None

    def encode(self, text, add_special_tokens=False):
        return [ord(c) % 126 + 1 for c in text]

    def __call__(self, text, **kw):
        return {"input_ids": self.encode(text)}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i - 1 + 32) if 1 <= i <= 94 else " " for i in ids if i != self.eos_token_id)


def tiny_llama(attn="flexicache", seed=0):
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                      pad_token_id=0, eos_token_id=127, bos_token_id=1)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval()


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


# ---- scorers -------------------------------------------------------------------------------------------
def test_scorers_on_hand_cases():
    assert contains("The number is 1234.", "1234")
    assert not contains("The number is 12345.", "1234")
    assert contains("vars: ABCDE, fghij", "FGHIJ")
    assert match_all("7 and 9", ["7", "9", "8"]) == pytest.approx(2 / 3)
    assert match_all("nothing", ["1"]) == 0.0
    assert lcs_length("ABCBDAB", "BDCABA") == 4
    assert rouge_l([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert rouge_l([1, 2, 3, 4], [1, 3, 4]) == pytest.approx(2 * 3 / 7)
    assert rouge_l([], [1]) == 0.0
    assert agreement_length([1, 2, 3, 9], [1, 2, 3, 4, 5]) == 3
    assert agreement_length([], [1]) == 0


def test_tasks_are_deterministic_and_answerable():
    tok = CharTokenizer()
    for task in task_makers():
        a = make_samples(tok, task, 500, 2, seed=3)
        b = make_samples(tok, task, 500, 2, seed=3)
        assert [s.context for s in a] == [s.context for s in b]
        assert a[0].context != a[1].context
        for s in a:
            assert all(ans in s.context for ans in s.answers), task
            assert s.score(" ".join(s.answers)) == 1.0 and s.score("") == 0.0
            n = render(tok, s.context, s.question, s.answer_prefix).shape[1]
            assert 300 < n < 1000, (task, n)  # chars as tokens: paragraphs are coarse steps
    fwe = make_samples(tok, "frequent_words", 300, 1, seed=0)[0]
    counts = {w: fwe.context.split().count(w) for w in set(fwe.context.split())}
    top = sorted(counts.values(), reverse=True)
    assert [counts[w] for w in fwe.answers] == top[:3] and top[2] > top[3]  # no tie at the cut


def test_tasks_do_not_depend_on_the_string_hash_seed():
    """Samples are the same in every process (a set's order follows PYTHONHASHSEED; none may leak in)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys, hashlib; sys.path.insert(0, %r); from test_eval import CharTokenizer; "
            "from flexicache_hf.eval.tasks import make_samples, task_makers; "
            "print(hashlib.sha256(repr([(s.context, s.question, s.answers) for t in sorted(task_makers()) "
            "for s in make_samples(CharTokenizer(), t, 400, 2, seed=5)]).encode()).hexdigest())"
            % str(Path(__file__).parent))
    digests = {subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed},
                              capture_output=True, text=True, check=True).stdout for seed in ("1", "2", "3")}
    assert len(digests) == 1


def test_haystack_is_long_prose_of_one_source():
    """The built-in haystack source alone fills an 8k-token haystack many times over (no wrap-round)."""
    from flexicache_hf.corpus import REFERENCE
    from flexicache_hf.data import documents_by_source
    from flexicache_hf.eval.tasks import HAYSTACK_SOURCE, _paragraphs, haystack

    assert HAYSTACK_SOURCE == REFERENCE and REFERENCE in documents_by_source()
    paras = _paragraphs()
    assert len(paras) > 1000 and sum(map(len, paras)) > 8 * 8192 * 4  # ~4 characters a token
    tok = CharTokenizer()  # a character a token: the strictest case
    got = haystack(tok, 8192, random.Random(0))
    assert sum(len(p) + 1 for p in got) >= 8192 and len(got) == len(set(got))


# ---- eviction caches -----------------------------------------------------------------------------------
def _track(cache: EvictionCache, log: list):
    """Wrap every layer's update to record (mask kv length announced before, keys returned, stored after)."""
    for layer in cache.layers:
        orig = layer.update

        def update(k, v, *a, _layer=layer, _orig=orig, **kw):
            announced, offset = _layer.get_mask_sizes(k.shape[-2])
            keys, values = _orig(k, v, *a, **kw)
            log.append((announced, keys.shape[-2], _layer.stored(), _layer.get_seq_length(), offset))
            return keys, values
        layer.update = update
    return cache


@pytest.mark.parametrize("make", [lambda: streaming_cache(2, 32), lambda: snapkv_cache(2, 32, window=8),
                                  lambda: lserve_cache(2, 2, 32, interval=4)], ids=["streaming", "snapkv", "lserve"])
def test_eviction_cache_keeps_budget_and_mask_sizes(model, make):
    cache, log = make(), []
    _track(cache, log)
    prompt = torch.randint(1, 127, (1, 100))
    greedy(model, prompt, cache, 20)
    assert cache.get_seq_length() == 100 + 19
    for announced, returned, stored, logical, offset in log:
        assert announced == returned  # what the mask is built for is what attention receives
        assert stored == min(logical, 31)  # budget 32: 31 stored + the new token attended
        assert offset + announced == logical  # the new tokens sit at their logical positions in the mask
    assert all(layer.stored() == 31 for layer in cache.layers)
    # Every head attends exactly `budget` tokens per decode step.
    assert all(returned == 32 for _, returned, _, logical, _ in log if returned != 100)


def test_eviction_with_sdpa_and_chunked_prefill_is_causal():
    """Two prompt chunks through sdpa's mask (offsets) equal the flexicache dense fallback."""
    fc, sd = tiny_llama("flexicache"), tiny_llama("sdpa")
    ids = torch.randint(1, 127, (1, 90))
    outs = []
    for m in (fc, sd):
        cache = streaming_cache(2, 32)
        with torch.inference_mode():
            m(input_ids=ids[:, :60], past_key_values=cache, use_cache=True)
            outs.append(m(input_ids=ids[:, 60:], past_key_values=cache, use_cache=True).logits)
        assert cache.get_seq_length() == 90 and cache.layers[0].stored() == 31
    torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)
    # And with nothing evicted, it is exactly dense.
    cache = streaming_cache(2, 4096)
    with torch.inference_mode():
        sd(input_ids=ids[:, :60], past_key_values=cache, use_cache=True)
        a = sd(input_ids=ids[:, 60:], past_key_values=cache, use_cache=True).logits
        b = sd(input_ids=ids, past_key_values=DynamicCache(), use_cache=True).logits[:, 60:]
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_snapkv_pins_attended_prompt_tokens(model):
    cache = snapkv_cache(2, 32, window=8)
    greedy(model, torch.randint(1, 127, (1, 100)), cache, 5)
    layer = cache.layers[0]
    assert layer.pinned == 31 - 8
    # Per head different prompt tokens may be pinned, but every head stores the same count.
    assert layer.keys.shape[-2] == 31


def test_query_hungry_caches_refuse_to_run_blind(model):
    cache = snapkv_cache(2, 32, window=8)
    with pytest.raises(RuntimeError, match="capture_queries"), torch.inference_mode():
        model(input_ids=torch.randint(1, 127, (1, 100)), past_key_values=cache, use_cache=True)


def test_lserve_streaming_heads_keep_sink_and_recent(model):
    from flexicache_hf.eval.decoding import teacher_forced

    prompt, cont = torch.randint(1, 127, (1, 100)), torch.randint(1, 127, (6,)).tolist()
    cache, ref = lserve_cache(2, 2, 32, interval=4), streaming_cache(2, 32)
    teacher_forced(model, prompt, [cont], cache)
    teacher_forced(model, prompt, [cont], ref)
    layer = cache.layers[0]
    assert isinstance(layer, LServeLayer) and len(layer.streaming_heads) == 1
    h = layer.streaming_heads[0]
    # Layer 0's keys depend on the tokens only, so the streaming head must hold exactly StreamingLLM's tokens.
    torch.testing.assert_close(layer.keys[:, h], ref.layers[0].keys[:, h])
    r = 1 - h  # the retrieval head holds other tokens, chosen by its query
    assert not torch.equal(layer.keys[:, r], ref.layers[0].keys[:, r])


# ---- policies ------------------------------------------------------------------------------------------
def test_flexicache_with_full_budget_scores_like_dense(model):
    tok = CharTokenizer()
    profiles = ProfileSource(model.config, None)
    for s in make_samples(tok, "niah_single", 300, 2, seed=1):
        ids = render(tok, s.context, s.question, s.answer_prefix)
        dense = greedy(model, ids, make_cache(Policy("dense"), model.config, ids.shape[1], profiles), 12)[0]
        for fam in ("flexicache", "quest"):
            p = Policy(fam, 1024) if fam == "quest" else Policy(fam, 1024, 16, 0.5)
            out = greedy(model, ids, make_cache(p, model.config, ids.shape[1], profiles), 12)[0]
            assert out == dense
            assert s.score(tok.decode(out)) == s.score(tok.decode(dense))
    assert "random" in profiles.used[0.5]  # no profile for a random model: the report says so


def test_policy_labels_and_budgets():
    assert Policy("flexicache", 1 / 8, 32, 0.5).label == "flexicache-R32-u50@1/8"
    assert Policy("streaming", 256).label == "streaming@256"
    assert Policy("snapkv", 1 / 16).budget_tokens(800, 16) == 48
    assert Policy("snapkv", 1 / 64).budget_tokens(800, 16) == 32  # never below two pages
    with pytest.raises(ValueError):
        Policy("dense", 1 / 8)


def test_fidelity_of_dense_is_perfect(model):
    prompt = torch.randint(1, 127, (1, 80))
    refs = fidelity.references(model, prompt, 12, [0])
    (row,) = fidelity.score(model, refs, DynamicCache)
    assert row["top1_agreement"] == 1.0 and row["agreement_length"] == 12 and row["rouge_l"] == 1.0
    (low,) = fidelity.score(model, refs, lambda: streaming_cache(2, 16))
    assert low["nll"] >= 0 and 0 <= low["rouge_l"] <= 1


@pytest.mark.parametrize("make", [lambda cfg: DynamicCache(), lambda cfg: streaming_cache(2, 32),
                                  lambda cfg: snapkv_cache(2, 32, window=8), lambda cfg: lserve_cache(2, 2, 32, 4),
                                  lambda cfg: FlexiCache(HeadProfile.random(cfg, 0.5),
                                                         FlexiCacheConfig(page_size=16, token_budget=48,
                                                                          rerank_interval=4))],
                         ids=["dense", "streaming", "snapkv", "lserve", "flexicache"])
def test_fidelity_batch_scores_each_row_as_alone(model, make):
    """Documents scored as one batch get the rows each would get alone (the batch is only for speed)."""
    prompts = torch.randint(1, 127, (3, 90))
    refs = fidelity.references(model, prompts, 10, [0, 1, 2])
    alone = [fidelity.references(model, prompts[r:r + 1], 10, [r])[0] for r in range(3)]
    assert [r.continuation for r in refs] == [a.continuation for a in alone]
    batch = fidelity.score(model, refs, lambda: make(model.config))
    for ref, row in zip(alone, batch):
        (single,) = fidelity.score(model, [ref], lambda: make(model.config))
        assert row["nll"] == pytest.approx(single["nll"], rel=1e-4, abs=1e-5)
        assert (row["top1_agreement"], row["agreement_length"], row["rouge_l"]) == (
            single["top1_agreement"], single["agreement_length"], single["rouge_l"])


def test_greedy_batch_stops_rows_independently(model):
    prompts = torch.randint(1, 127, (2, 40))
    free = greedy(model, prompts, DynamicCache(), 8)
    stop = {free[0][2]}  # row 0 stops at its third token; row 1 only where it meets that token
    rows = greedy(model, prompts, DynamicCache(), 8, stop)
    assert rows[0] == free[0][:3]
    cut = next((i + 1 for i, t in enumerate(free[1]) if t in stop), 8)
    assert rows[1] == free[1][:cut]


def test_question_after_context_splits_the_same_prompt_and_decodes_the_same_when_nothing_is_evicted(model):
    """render_split gives render's tokens in two chunks (context first); fed in order, a cache that keeps
    everything decodes what one prompt forward gives, and a budget-capped eviction cache compresses the context
    before it sees the question (its stored tokens after the context chunk do not depend on the question)."""
    tok = CharTokenizer()
    profiles = ProfileSource(model.config, None)
    (s,) = make_samples(tok, "niah_single", 300, 1, seed=2)
    whole = render(tok, s.context, s.question, s.answer_prefix)
    head, tail = render_split(tok, s.context, s.question, s.answer_prefix)
    assert torch.equal(torch.cat([head, tail], 1), whole)
    assert head[0].tolist() == tok.encode(s.context)  # the context, and nothing of the question
    assert tail[0].tolist()[: len(s.question) + 2] == tok.encode(f"\n\n{s.question}")
    for p in (Policy("dense"), Policy("flexicache", 1024, 16, 0.5), Policy("quest", 1024)):
        one = greedy(model, whole, make_cache(p, model.config, whole.shape[1], profiles), 12)
        two = greedy(model, (head, tail), make_cache(p, model.config, whole.shape[1], profiles), 12)
        assert one == two, p.label
    kept = []
    for question in (s.question, "What is the secret?"):
        cache = snapkv_cache(2, 48, window=8)
        h, t = render_split(tok, s.context, question, s.answer_prefix)
        assert torch.equal(h, head)
        from flexicache_hf.eval.query_capture import capture_queries
        with capture_queries(model), torch.inference_mode():
            model(input_ids=h, past_key_values=cache, use_cache=True, logits_to_keep=1)
        kept.append(cache.layers[0].keys.clone())
    assert torch.equal(kept[0], kept[1])  # chosen before the question exists
    with pytest.raises(ValueError, match="nothing to store"):
        render_split(tok, "", s.question, s.answer_prefix)


def test_question_chunk_takes_a_token_that_spans_the_boundary():
    """A tokenizer with a ``".\n\n"`` token (Qwen2's has such merges): the cut falls before it, and the two chunks
    are still exactly the one-prompt tokens."""

    class Merging(CharTokenizer):
        MERGED = 126  # the one multi-character token

        def _pieces(self, text):
            i = 0
            while i < len(text):
                n = 3 if text.startswith(".\n\n", i) else 1
                yield i, i + n
                i += n

        def encode(self, text, add_special_tokens=False):
            return [self.MERGED if b - a == 3 else ord(text[a]) % 125 + 1 for a, b in self._pieces(text)]

        def __call__(self, text, return_offsets_mapping=False, **kw):
            out = {"input_ids": self.encode(text)}
            if return_offsets_mapping:
                out["offset_mapping"] = list(self._pieces(text))
            return out

    tok = Merging()
    head, tail = render_split(tok, "A context ends.", "Which one?", "Answer:")
    assert torch.equal(torch.cat([head, tail], 1), render(tok, "A context ends.", "Which one?", "Answer:"))
    assert head[0].tolist() == tok.encode("A context ends") and tail[0, 0] == Merging.MERGED


def test_runner_feeds_the_question_after_the_context_when_configured(model, tmp_path):
    cfg = EvalConfig(name="test", tasks=("niah_single",), task_length=200, samples=1, budgets=(1 / 4,),
                     families=("flexicache", "snapkv"), rerank_intervals=(), unstable_fractions=(), reach_lengths=(),
                     fidelity_docs=0, question_after_context=True)
    results = runner.run(model, CharTokenizer(), cfg, profile_name=None, progress=False)
    assert results["question_after_context"] and results["tasks"]
    assert all(r["question_tokens"] and r["question_tokens"] < r["context_tokens"] for r in results["tasks"])
    report.write(results, cfg, tmp_path, "cmd", "### test")
    assert "then the question" in (tmp_path / "report.md").read_text()


# ---- end to end ----------------------------------------------------------------------------------------
def test_tiny_run_end_to_end(model, tmp_path):
    cfg = EvalConfig(name="test", tasks=("niah_single", "variable_tracking", "frequent_words"), task_length=200,
                     samples=1, budgets=(1 / 4,), rerank_intervals=(8,), unstable_fractions=(0.5,),
                     reach_lengths=(128,), reach_samples=1, fidelity_prompt=160, fidelity_length=8,
                     fidelity_budgets=(64,))
    t0 = time.time()
    results = runner.run(model, CharTokenizer(), cfg, profile_name=None, progress=False)
    ret = report.write(results, cfg, tmp_path, "python -m flexicache_hf.eval --config test", "### test")
    assert time.time() - t0 < 60
    labels = {r["policy"] for r in results["tasks"]}
    assert {"dense", "flexicache-R16-u25@1/4", "quest@1/4", "streaming@1/4", "snapkv@1/4", "lserve-R16@1/4",
            "flexicache-R8-u50@1/8"} <= labels
    assert len(results["tasks"]) == 3 * len(cfg.task_policies())
    assert {r["family"] for r in results["fidelity"]} == {"dense", "flexicache", "quest", "streaming", "snapkv", "lserve"}
    for f in ("results.json", "report.md", "retention_vs_budget.png", "fidelity_vs_budget.png"):
        assert (tmp_path / f).is_file()
    # A random model scores ~0 everywhere: those tasks are reported but kept out of the means.
    assert set(ret["counted"]) <= set(ret["tasks"])
    text = (tmp_path / "report.md").read_text()
    assert "| policy |" in text and "NLL / dense" in text
    assert "| flexicache-R16-u25@64 | " in text  # FlexiCache minus each eviction baseline at budget 64
    assert ret["samples"] == 1 and not results["truncated"]


def test_time_limit_cuts_whole_samples_and_says_what(model, tmp_path):
    cfg = EvalConfig(name="test", tasks=("niah_single", "frequent_words"), task_length=200, samples=2,
                     budgets=(1 / 4,), families=("flexicache",), rerank_intervals=(), unstable_fractions=(),
                     reach_lengths=(), fidelity_prompt=160, fidelity_length=4, fidelity_budgets=(64,),
                     fidelity_families=("streaming",))
    results = runner.run(model, CharTokenizer(), cfg, profile_name=None, progress=False, max_seconds=0)
    assert results["tasks"] == [] and results["fidelity"] == []
    assert results["truncated"] == ["task samples 1..2", "fidelity"]
    report.write(results, cfg, tmp_path, "cmd", "### test")
    assert "task samples 1..2; fidelity left out" in (tmp_path / "report.md").read_text()


def test_config_parts_split_one_configuration():
    cfg = full()
    tasks, fid = only(cfg, "tasks"), only(cfg, "fidelity")
    assert tasks.task_policies() == cfg.task_policies() and tasks.fidelity_docs == 0
    assert fid.tasks == () and fid.reach_lengths == () and fid.fidelity_policies() == cfg.fidelity_policies()
    assert only(cfg, "all") is cfg
    with pytest.raises(ValueError):
        only(cfg, "reach")


def test_fidelity_documents_spread_over_sources():
    from flexicache_hf.data import documents_by_source, load_documents

    docs = load_documents(None)
    # Long documents are few (the built-in sources hold a handful each of > 23k characters), but every
    # source has one, so 4 picks take one from each source and then round again.
    long_per_source = {s: sum(len(d.text) > 3 * 7680 for d in g) for s, g in documents_by_source().items()}
    assert len(long_per_source) == 3 and min(long_per_source.values()) >= 1, long_per_source
    picked = fidelity.pick_documents(4, 7680)
    assert picked == fidelity.pick_documents(4, 7680) and len(set(picked)) == 4
    assert len({docs[i].source for i in picked}) == 3
    assert all(len(docs[i].text) > 3 * 7680 for i in picked)
    with pytest.raises(ValueError, match="long enough"):
        fidelity.pick_documents(10, 60_000)


def test_fidelity_summary_gives_the_nll_ratio_a_bootstrap_interval_over_documents():
    def row(policy, doc, nll):
        return {"policy": policy.label, "family": policy.family, "budget_tokens": policy.budget, "doc_index": doc,
                "nll": nll, "top1_agreement": 1.0, "agreement_length": 1}

    dense, same, spread = Policy("dense"), Policy("quest", 256), Policy("flexicache", 256)
    dense_nll = [0.5, 1.0, 2.0, 1.5]
    rows = [row(dense, i, x) for i, x in enumerate(dense_nll)]
    rows += [row(same, i, 1.2 * x) for i, x in enumerate(dense_nll)]  # the same ratio on every document
    rows += [row(spread, i, x * f) for i, (x, f) in enumerate(zip(dense_nll, (1.0, 1.0, 1.6, 1.0)))]
    s = report.fidelity_summary(rows)
    lo, hi = s[same.label]["nll_ratio_ci90"]
    assert lo == pytest.approx(1.2) and hi == pytest.approx(1.2)
    lo, hi = s[spread.label]["nll_ratio_ci90"]
    assert lo < s[spread.label]["nll_ratio"] < hi and lo >= 1.0 and hi <= 1.6
    assert s[spread.label]["nll_ratio_ci90"] == report.fidelity_summary(rows)[spread.label]["nll_ratio_ci90"]
    one_doc = [r for r in rows if r["doc_index"] == 0]
    assert report.fidelity_summary(one_doc)[spread.label]["nll_ratio_ci90"] is None


def test_fidelity_margins_compare_flexicache_with_each_eviction_baseline():
    rows = [{"policy": p.label, "family": p.family, "budget_tokens": p.budget, "doc_index": 0, "nll": nll,
             "top1_agreement": agree, "agreement_length": 1, "rouge_l": rl}
            for p, nll, agree, rl in ((Policy("dense"), 1.0, 1.0, 1.0), (Policy("flexicache", 256), 1.1, 0.9, 0.8),
                                      (Policy("flexicache", 256, 8, 0.5), 2.0, 0.1, 0.1),
                                      (Policy("streaming", 256), 1.3, 0.85, 0.6), (Policy("snapkv", 256), 1.5, 0.7, 0.5))]
    summary = report.fidelity_summary(rows)
    assert summary["flexicache-R16-u25@256"]["nll_ratio"] == pytest.approx(1.1)
    margins = report.fidelity_margins(summary)
    assert set(margins) == {"flexicache-R16-u25@256", "flexicache-R8-u50@256"}
    m = margins["flexicache-R16-u25@256"]
    assert set(m) == {"streaming@256", "snapkv@256"}
    assert m["streaming@256"]["top1_points"] == pytest.approx(5.0)
    assert m["snapkv@256"]["rouge_points"] == pytest.approx(30.0)


def test_task_indices_run_only_the_chosen_samples(tmp_path):
    """``task_indices`` runs the chosen samples of the ``samples`` drawn (the same samples a larger grid draws at
    those indices), says so in the report, and rejects an index past the draw before running anything."""
    from flexicache_hf.eval import report, runner
    from flexicache_hf.eval.grids import EvalConfig

    model = tiny_llama()
    base = dict(name="test", tasks=("niah_single",), task_length=200, samples=3, budgets=(), families=(),
                rerank_intervals=(), unstable_fractions=(), reach_lengths=(), fidelity_docs=0)
    full = runner.run(model, CharTokenizer(), EvalConfig(**base), profile_name=None, progress=False)
    cfg = EvalConfig(**base, task_indices=(2,))
    one = runner.run(model, CharTokenizer(), cfg, profile_name=None, progress=False)
    assert [r["index"] for r in one["tasks"]] == [2]
    assert one["tasks"][0] == [r for r in full["tasks"] if r["index"] == 2][0]
    report.write(one, cfg, tmp_path, "cmd", "### test")
    assert "(indices [2] of the 3 drawn)" in (tmp_path / "report.md").read_text()
    with pytest.raises(ValueError, match="task_indices"):
        runner.run(model, CharTokenizer(), EvalConfig(**base, task_indices=(3,)), profile_name=None, progress=False)
