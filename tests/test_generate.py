"""FlexiCache inside unmodified transformers models: generate, batches, multi-turn, beams, pipelines."""

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import DynamicCache, pipeline

from conftest import tiny_config, twin_models
from flexicache_hf import FlexiCache, FlexiCacheConfig, HeadProfile
from flexicache_hf.pipeline import FlexiCachePipeline

FULL = dict(page_size=4, token_budget=512, rerank_interval=3)  # covers every page of these prompts


def greedy(model, ids, cache, n=24, **kw):
    return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, past_key_values=cache, **kw)


@pytest.mark.parametrize("kind,heads,kv", [("llama", 4, 4), ("mistral", 6, 2), ("qwen2", 8, 2)])
@pytest.mark.parametrize("prompt_len", [37, 61])
def test_full_budget_greedy_equals_dense(kind, heads, kv, prompt_len):
    cfg = tiny_config(kind, heads=heads, kv_heads=kv, layers=3)
    fc, dense = twin_models(cfg)
    ids = torch.randint(2, 96, (1, prompt_len))
    cache = FlexiCache(HeadProfile.random(cfg, 0.25, seed=prompt_len), **FULL)
    assert torch.equal(greedy(fc, ids, cache), greedy(dense, ids, DynamicCache()))
    assert cache.get_seq_length() == prompt_len + 23  # the last token is never fed back


def test_offload_off_and_all_stable_also_exact():
    cfg = tiny_config("llama", heads=4, kv_heads=2)
    fc, dense = twin_models(cfg)
    ids = torch.randint(2, 96, (1, 29))
    want = greedy(dense, ids, DynamicCache())
    for profile in (HeadProfile.all_stable(cfg), HeadProfile.all_unstable(cfg)):
        for offload in (True, False):
            cache = FlexiCache(profile, FlexiCacheConfig(**FULL, offload=offload))
            assert torch.equal(greedy(fc, ids, cache), want)


def test_left_padded_batch_matches_rows_alone():
    cfg = tiny_config("qwen2", heads=8, kv_heads=2)
    fc, dense = twin_models(cfg)
    lengths = [23, 31, 17]
    rows = [torch.randint(2, 96, (1, n)) for n in lengths]
    L = max(lengths)
    ids = torch.zeros(3, L, dtype=torch.long)
    mask = torch.zeros(3, L, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, L - r.shape[1]:] = r[0]
        mask[i, L - r.shape[1]:] = 1
    cache = FlexiCache(HeadProfile.random(cfg, 0.25), **FULL)
    batch = greedy(fc, ids, cache, attention_mask=mask)
    for i, r in enumerate(rows):
        alone = greedy(dense, r, DynamicCache())
        assert torch.equal(batch[i, L:], alone[0, r.shape[1]:]), f"row {i}"


def test_small_budget_runs_and_saves_device_memory(monkeypatch):
    monkeypatch.setattr("flexicache_hf.reserve.CHUNK_TOKENS", 64)  # reserved storage's headroom, small at 900 tokens
    cfg = tiny_config("llama", heads=4, kv_heads=4, max_pos=4096)
    fc, _ = twin_models(cfg)
    ids = torch.randint(2, 96, (2, 900))
    cache = FlexiCache(HeadProfile.random(cfg, 0.25), page_size=16, token_budget=64, rerank_interval=4)
    out = greedy(fc, ids, cache, n=20)
    assert out.shape == (2, 920)
    report = cache.memory_report()
    assert report["device_saving"] > 0.4 and report["host_bytes"] > 0
    assert cache.stats.decode_steps == 19


def test_multi_turn_reuses_cache():
    cfg = tiny_config("mistral", heads=6, kv_heads=2)
    fc, dense = twin_models(cfg)
    turn1 = torch.randint(2, 96, (1, 30))
    c_fc, c_dense = FlexiCache(HeadProfile.random(cfg, 0.25), **FULL), DynamicCache()
    a = greedy(fc, turn1, c_fc, n=10)
    b = greedy(dense, turn1, c_dense, n=10)
    assert torch.equal(a, b)
    follow = torch.randint(2, 96, (1, 13))
    a2 = greedy(fc, torch.cat([a, follow], 1), c_fc, n=10)
    b2 = greedy(dense, torch.cat([b, follow], 1), c_dense, n=10)
    assert torch.equal(a2, b2)
    assert c_fc.get_seq_length() == c_dense.get_seq_length()


def test_multi_turn_with_small_budget_and_offload():
    cfg = tiny_config("llama", heads=4, kv_heads=2)
    fc, _ = twin_models(cfg)
    cache = FlexiCache(HeadProfile.all_stable(cfg), page_size=4, token_budget=16, rerank_interval=4)
    a = greedy(fc, torch.randint(2, 96, (1, 50)), cache, n=9)
    a2 = greedy(fc, torch.cat([a, torch.randint(2, 96, (1, 21))], 1), cache, n=9)
    assert cache.get_seq_length() == a2.shape[1] - 1


def test_sampling_with_seed_and_num_return_sequences():
    cfg = tiny_config("llama", heads=4, kv_heads=2)
    fc, dense = twin_models(cfg)
    ids = torch.randint(2, 96, (1, 21))
    kw = dict(max_new_tokens=12, do_sample=True, top_k=20, num_return_sequences=3)
    torch.manual_seed(7)
    a = fc.generate(ids, past_key_values=FlexiCache(HeadProfile.random(cfg, 0.25), **FULL), **kw)
    torch.manual_seed(7)
    b = dense.generate(ids, past_key_values=DynamicCache(), **kw)
    assert a.shape[0] == 3 and torch.equal(a, b)


def test_beam_search_reorders_cache():
    cfg = tiny_config("qwen2", heads=4, kv_heads=2)
    fc, dense = twin_models(cfg)
    ids = torch.randint(2, 96, (1, 19))
    kw = dict(max_new_tokens=8, num_beams=3, do_sample=False)
    a = fc.generate(ids, past_key_values=FlexiCache(HeadProfile.random(cfg, 0.5), **FULL), **kw)
    b = dense.generate(ids, past_key_values=DynamicCache(), **kw)
    assert torch.equal(a, b)


def test_batch_repeat_interleave_and_select():
    cfg = tiny_config("llama", heads=4, kv_heads=2)
    fc, _ = twin_models(cfg)
    cache = FlexiCache(HeadProfile.all_stable(cfg), page_size=4, token_budget=8, rerank_interval=2)
    greedy(fc, torch.randint(2, 96, (2, 25)), cache, n=6)
    before = [layer.gather_tokens(layer.seq_len)[0].clone() for layer in cache.layers]
    cache.batch_repeat_interleave(2)
    after = [layer.gather_tokens(layer.seq_len)[0] for layer in cache.layers]
    for x, y in zip(before, after):
        assert torch.equal(x.repeat_interleave(2, 0), y)
    cache.batch_select_indices(torch.tensor([3, 0]))
    for x, layer in zip(before, cache.layers):
        assert torch.equal(layer.gather_tokens(layer.seq_len)[0], x[[1, 0]])


def test_pipeline_gives_every_call_an_empty_cache_reusing_a_sized_one_that_fits():
    from conftest import word_tokenizer

    tok = word_tokenizer()
    cfg = tiny_config("llama", heads=4, kv_heads=2)
    fc, dense = twin_models(cfg)
    profile = HeadProfile.random(cfg, 0.25)
    pipe = pipeline("text-generation", model=fc, tokenizer=tok, pipeline_class=FlexiCachePipeline,
                    flexicache_profile=profile, flexicache_config=FlexiCacheConfig(**FULL))
    ref = pipeline("text-generation", model=dense, tokenizer=tok)
    prompts = [" ".join(f"w{(7 * i + j) % 90 + 2}" for j in range(n)) for i, n in enumerate([15, 26])]
    kw = dict(max_new_tokens=8, do_sample=False, return_full_text=False)
    got = pipe(prompts, **kw)  # one forward per prompt: the second needs 26 + 8 tokens, more than the first's
    first_cache = pipe.last_cache
    assert got == ref(prompts, **kw)
    assert first_cache.get_seq_length() > 0 and first_cache.max_tokens == 26 + 8
    buffers = [t.data_ptr() for t in first_cache.layers[0].buffers()]
    # 15 + 8 tokens fit the last call's cache: reset and reused, buffers at the same addresses, same tokens
    assert pipe(prompts[:1], **kw) == ref(prompts[:1], **kw) and pipe.last_cache is first_cache
    assert [t.data_ptr() for t in first_cache.layers[0].buffers()] == buffers
    assert pipe.last_cache.get_seq_length() == 15 + 7
    # a longer call than the cache holds gets a new one; so does a call with no max_new_tokens (a growing cache)
    long = " ".join(f"w{j % 90 + 2}" for j in range(40))
    assert pipe(long, **kw) == ref(long, **kw) and pipe.last_cache is not first_cache
    grown = pipe.last_cache
    assert pipe(prompts[:1], do_sample=False, return_full_text=False) is not None and pipe.last_cache is not grown
    with pytest.raises(ValueError, match="makes its own cache"):
        pipe(prompts[:1], past_key_values=DynamicCache(), **kw)


def test_the_cache_goes_in_under_the_name_this_transformers_takes():
    """Newer transformers renamed generate's ``past_key_values`` to ``cache`` (the old name warns until 6.0): the
    pipeline passes the cache under the current name, with no deprecation warning, and both names give a FlexiCache
    the same tokens where both exist."""
    import warnings

    from conftest import word_tokenizer
    from flexicache_hf.hf_compat import generate_cache_kwarg

    name = generate_cache_kwarg()
    assert name in ("cache", "past_key_values")
    cfg = tiny_config("llama", heads=4, kv_heads=2)
    fc, dense = twin_models(cfg)
    profile = HeadProfile.random(cfg, 0.25)
    ids = torch.randint(2, 96, (1, 40))
    caches = [FlexiCache(profile, page_size=4, token_budget=16, rerank_interval=3) for _ in range(2)]
    a = fc.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, **{name: caches[0]})
    b = greedy(fc, ids, caches[1], n=12)
    assert torch.equal(a, b) and caches[0].get_seq_length() == caches[1].get_seq_length() == 40 + 11
    pipe = pipeline("text-generation", model=fc, tokenizer=word_tokenizer(), pipeline_class=FlexiCachePipeline,
                    flexicache_profile=profile, flexicache_config=FlexiCacheConfig(**FULL))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        pipe("w5 w6 w7 w8 w9", max_new_tokens=4, do_sample=False)
    assert not [w for w in seen if "past_key_values" in str(w.message)]
    assert pipe.last_cache.get_seq_length() == 5 + 3


def test_forward_callers_pass_the_cache_under_the_name_the_forward_takes():
    """transformers 5.40 drops the model forward's ``past_key_values=`` (5.24 takes ``cache=`` and warns on the old
    name): the eval harness and the benchmark's chunked prefill call the forward under the name the installed
    release takes, and no forward call of the package or the examples spells the old name."""
    import ast
    import inspect
    import pathlib
    import warnings

    from flexicache_hf import prefill_in_chunks
    from flexicache_hf.eval.decoding import greedy as eval_greedy
    from flexicache_hf.hf_compat import forward_cache_kwarg

    cfg = tiny_config("llama", heads=4, kv_heads=2)
    fc, dense = twin_models(cfg)
    name = forward_cache_kwarg(fc)
    assert name in inspect.signature(inspect.unwrap(type(fc).forward)).parameters
    real = fc.forward

    def forward_of_this_release(*args, **kwargs):  # refuses the old name where the forward has the new one
        if name == "cache" and "past_key_values" in kwargs:
            raise TypeError("forward() got an unexpected keyword argument 'past_key_values'")
        return real(*args, **kwargs)

    fc.forward = forward_of_this_release
    ids = torch.randint(2, 96, (1, 30))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        rows = eval_greedy(fc, ids, FlexiCache(HeadProfile.random(cfg, 0.25), **FULL), 6)
        cache = FlexiCache(HeadProfile.random(cfg, 0.25), **FULL)
        prefill_in_chunks(fc, ids, cache, 8)
    assert rows[0] == greedy(dense, ids, DynamicCache(), n=6)[0, 30:].tolist()
    assert cache.get_seq_length() == 29
    root = pathlib.Path(__file__).resolve().parent.parent
    for path in [*root.joinpath("flexicache_hf").rglob("*.py"), *root.joinpath("examples").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and not (isinstance(node.func, ast.Attribute) and node.func.attr == "generate"):
                assert "past_key_values" not in [k.arg for k in node.keywords], f"{path.name}:{node.lineno}"


@pytest.mark.slow
def test_smollm2_full_budget_equals_dense_on_corpus_prompt(smollm2):
    from flexicache_hf.data import long_prompt

    model, tok = smollm2
    ids = long_prompt(tok, 1600, doc_index=3)  # a language-reference section of the built-in corpus
    cache = FlexiCache(HeadProfile.random(model.config, 0.25), token_budget=2048)
    a = greedy(model, ids, cache, n=64)
    model.config._attn_implementation = "sdpa"
    try:
        b = greedy(model, ids, DynamicCache(), n=64)
    finally:
        model.config._attn_implementation = "flexicache"
    assert torch.equal(a, b)


def test_two_caches_two_models_in_threads():
    """The handle travels with each call: concurrent generations on separate caches do not interfere."""
    import threading

    cfg_a, cfg_b = tiny_config("llama", heads=4, kv_heads=2), tiny_config("qwen2", heads=8, kv_heads=2)
    (fa, _), (fb, _) = twin_models(cfg_a, seed=1), twin_models(cfg_b, seed=2)
    ids_a, ids_b = torch.randint(2, 96, (1, 40)), torch.randint(2, 96, (2, 33))
    small = dict(page_size=4, token_budget=16, rerank_interval=2)
    want_a = greedy(fa, ids_a, FlexiCache(HeadProfile.random(cfg_a, 0.25), **small))
    want_b = greedy(fb, ids_b, FlexiCache(HeadProfile.random(cfg_b, 0.25), **small))
    got = {}

    def run(name, model, ids, cfg):
        got[name] = greedy(model, ids, FlexiCache(HeadProfile.random(cfg, 0.25), **small))

    threads = [threading.Thread(target=run, args=("a", fa, ids_a, cfg_a)),
               threading.Thread(target=run, args=("b", fb, ids_b, cfg_b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert torch.equal(got["a"], want_a) and torch.equal(got["b"], want_b)


def test_one_cache_two_threads_refuses_the_second_while_the_first_runs():
    """A thread that reaches a cache while another thread's forward through it is under way gets a clear
    ConcurrentUseError (generate, a forward, get_seq_length, reset, a copy), changing nothing: the first thread's
    generation is exact, and the cache serves the second thread once the first is done."""
    import copy
    import threading

    from flexicache_hf import ConcurrentUseError

    cfg = tiny_config("llama", heads=4, kv_heads=2, layers=3)
    fc, _ = twin_models(cfg)
    make = lambda: FlexiCache(HeadProfile.random(cfg, 0.25), page_size=4, token_budget=16, rerank_interval=2)  # noqa: E731
    cache = make()
    ids, other = torch.randint(2, 96, (1, 40)), torch.randint(2, 96, (1, 21))
    want = greedy(fc, ids, make())
    inside, go = threading.Event(), threading.Event()
    calls = []

    def pause(*_):  # the first thread's decode step waits between layers 1 and 2 until the main thread is done
        calls.append(1)
        if len(calls) == 5:
            inside.set()
            go.wait(60)

    hook = fc.model.layers[1].mlp.register_forward_hook(pause)
    got = {}
    worker = threading.Thread(target=lambda: got.setdefault("out", greedy(fc, ids, cache)))
    worker.start()
    try:
        assert inside.wait(60)
        for attempt in (lambda: greedy(fc, other, cache), lambda: fc(other, past_key_values=cache),
                        cache.get_seq_length, cache.reset, lambda: copy.deepcopy(cache)):
            with pytest.raises(ConcurrentUseError, match="in use by another thread"):
                attempt()
    finally:
        go.set()
        worker.join(60)
        hook.remove()
    assert torch.equal(got["out"], want)
    cache.reset()  # the first thread is done: the cache serves this one
    assert torch.equal(greedy(fc, other, cache), greedy(fc, other, make()))
    assert cache.get_seq_length() == 21 + 23


def test_stored_tokens_equal_dynamic_cache_after_decode_and_follow_up_chunk():
    """Every stored token, wherever it lives, equals DynamicCache's after a prompt, decode steps that leave the
    newest page partly filled, and a follow-up chunk that crosses pages (the multi-turn path)."""
    cfg = tiny_config("llama", heads=4, kv_heads=2)
    fc, dense = twin_models(cfg)
    # A budget covering every page keeps the stored states exact, while stable heads still live in slots + host.
    cache, ref = FlexiCache(HeadProfile.all_stable(cfg), page_size=4, token_budget=512), DynamicCache()
    steps = [torch.randint(2, 96, (1, 30))] + [torch.randint(2, 96, (1, 1)) for _ in range(9)]
    steps.append(torch.randint(2, 96, (1, 14)))
    for ids in steps:
        fc(ids, past_key_values=cache)
        dense(ids, past_key_values=ref)
        for layer, want in zip(cache.layers, ref.layers):
            k, v = layer.gather_tokens(layer.seq_len)
            torch.testing.assert_close(k, want.keys)
            torch.testing.assert_close(v, want.values)


def chat_turns(model, cache, turns, n):
    """Greedy multi-turn chat on one cache: each turn appends its new tokens to the conversation so far."""
    conversation = None
    for turn in turns:
        ids = turn if conversation is None else torch.cat([conversation, turn], 1)
        conversation = greedy(model, ids, cache, n=n, attention_mask=torch.ones_like(ids))
    return conversation


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("n", [9, 10, 11])  # follow-ups start at every phase of the re-rank interval (R = 3)
def test_multi_turn_equals_dense_at_every_rerank_phase(offload, n):
    cfg = tiny_config("llama", heads=4, kv_heads=2)
    fc, dense = twin_models(cfg)
    turns = [torch.randint(2, 96, (1, 30)), torch.randint(2, 96, (1, 13)), torch.randint(2, 96, (1, 22))]
    cache = FlexiCache(HeadProfile.random(cfg, 0.25, seed=1), FlexiCacheConfig(**FULL, offload=offload))
    assert torch.equal(chat_turns(fc, cache, turns, n), chat_turns(dense, DynamicCache(), turns, n))


@pytest.mark.parametrize("offload", [False, True])
def test_multi_turn_small_budget_follow_ups_of_many_pages(offload):
    """A follow-up prompt adds many pages since the stable heads' last re-rank; the next step re-ranks them all."""
    cfg = tiny_config("llama", heads=4, kv_heads=2)
    fc, _ = twin_models(cfg)
    turns = [torch.randint(2, 96, (1, 50)), torch.randint(2, 96, (1, 21)), torch.randint(2, 96, (1, 40))]
    for profile in (HeadProfile.all_stable(cfg), HeadProfile.random(cfg, 0.5, seed=2)):
        for n in (6, 7, 8, 9):
            cache = FlexiCache(profile, page_size=4, token_budget=16, rerank_interval=4, offload=offload)
            out = chat_turns(fc, cache, turns, n)
            assert cache.get_seq_length() == out.shape[1] - 1


@pytest.mark.parametrize("max_cache_len", [None, 80])
def test_chunked_prefill_equals_dense(max_cache_len):
    """``generate(prefill_chunk_size=...)`` feeds the prompt as a first chunk and follow-up chunks: the follow-ups
    attend exactly over the cached prefix, and step 0 re-ranks every head over every page; a budget covering every
    page decodes as dense, a small one keeps the cache consistent."""
    cfg = tiny_config("llama", heads=4, kv_heads=2)
    fc, dense = twin_models(cfg)
    ids = torch.randint(2, 96, (2, 45))
    want = greedy(dense, ids, DynamicCache(), n=12)
    profile = HeadProfile.random(cfg, 0.25, seed=3)
    cache = FlexiCache(profile, **FULL, max_cache_len=max_cache_len)
    assert torch.equal(greedy(fc, ids, cache, n=12, prefill_chunk_size=16), want)
    small = FlexiCache(profile, page_size=4, token_budget=16, rerank_interval=4, max_cache_len=max_cache_len)
    out = greedy(fc, ids, small, n=12, prefill_chunk_size=16)
    assert small.get_seq_length() == out.shape[1] - 1 and small.stats.prompt_tokens == 45


@pytest.mark.parametrize("max_cache_len", [None, 80])
def test_chunks_through_forward_then_generate_equals_dense(max_cache_len):
    """The README's route around a compiled chunked prefill: the prompt's chunks through the model's forward
    (``flexicache_hf.prefill_in_chunks``), then ``generate`` on the filled cache; dense tokens at a full budget."""
    from flexicache_hf import prefill_in_chunks

    cfg = tiny_config("llama", heads=4, kv_heads=2)
    fc, dense = twin_models(cfg)
    ids = torch.randint(2, 96, (2, 45))
    want = greedy(dense, ids, DynamicCache(), n=12)
    cache = FlexiCache(HeadProfile.random(cfg, 0.25, seed=3), **FULL, max_cache_len=max_cache_len)
    prefill_in_chunks(fc, ids, cache, 16)
    assert cache.get_seq_length() == ids.shape[1] - 1
    assert torch.equal(greedy(fc, ids, cache, n=12), want)


def _offload_case(i: int) -> dict:
    """The ``i``-th of a fixed set of small random multi-turn configurations (small budgets)."""
    import random

    r = random.Random(2000 + i)
    ps = r.choice([2, 4, 8])
    turns = [ps * r.randint(3, 8) if r.random() < 0.5 else r.randint(5, 60)]  # a first prompt often page-aligned
    turns += [r.randint(1, 30) for _ in range(r.randint(0, 2))]
    return dict(ps=ps, R=r.choice([1, 2, 4, 8, 16]), pages=r.randint(2, 5), n=r.randint(3, 20), turns=turns,
                stagger=r.random() < 0.4, unstable=r.choice([0.0, 0.25, 0.5]), seed=r.randint(0, 99),
                chunk=r.choice([None, None, 16]))


@pytest.mark.parametrize("i", range(24))
def test_offload_changes_where_pages_live_not_what_is_attended(i):
    """Seeded random small-budget chats (page size, interval, stagger, unstable share, page-aligned prompts, follow-up
    turns, chunked prefill): a cache that offloads its stable heads gives exactly the logits of one that keeps every
    page on the device, turn after turn (offload moves pages between tiers; it must never change the selection or the
    data a selected page holds)."""
    c = _offload_case(i)
    if c["chunk"] and len(c["turns"]) > 1 and Version(transformers.__version__) < Version("5.24"):
        pytest.skip("transformers 5.17's generate(prefill_chunk_size=...) on a filled cache cuts the attention mask "
                    "from position 0 (16 columns for 54 keys), which FlexiCache refuses; 5.24 passes it whole")
    cfg = tiny_config("llama", heads=4, kv_heads=2)
    fc, _ = twin_models(cfg)
    g = torch.Generator().manual_seed(c["seed"])
    turns = [torch.randint(2, 96, (1, t), generator=g) for t in c["turns"]]
    profile = HeadProfile.random(cfg, c["unstable"], seed=c["seed"])
    logits = {}
    for offload in (False, True):
        cache = FlexiCache(profile, page_size=c["ps"], token_budget=c["ps"] * c["pages"], rerank_interval=c["R"],
                           stagger_reranks=c["stagger"], offload=offload)
        conversation, out = None, []
        for turn in turns:
            ids = turn if conversation is None else torch.cat([conversation, turn], 1)
            res = fc.generate(ids, max_new_tokens=c["n"], min_new_tokens=c["n"], do_sample=False, past_key_values=cache,
                              attention_mask=torch.ones_like(ids), output_logits=True, return_dict_in_generate=True,
                              prefill_chunk_size=c["chunk"])
            conversation = res.sequences
            out += list(res.logits)
        logits[offload] = (conversation, torch.stack(out))
    assert torch.equal(logits[False][0], logits[True][0])
    torch.testing.assert_close(logits[True][1], logits[False][1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("R,most", [(16, 6), (64, 12)])
def test_a_stable_head_attends_its_selection_and_the_pages_since_its_last_rerank_as_documented(R, most):
    """Budget 4 pages of 8 tokens: between re-ranks a stable head attends its 4 pages plus every page created since
    its last re-rank, up to K + ceil(R / page_size) pages (6 at R = 16, 12 at R = 64), which the configuration's
    documentation states; an unstable head attends its K pages."""
    import dataclasses

    from flexicache_hf.kernels import reference

    cfg = tiny_config("llama", heads=4, kv_heads=2)
    fc, _ = twin_models(cfg)
    profile = HeadProfile.random(cfg, 0.5, seed=1)  # one stable and one unstable KV head per layer
    cache = FlexiCache(profile, page_size=8, token_budget=32, rerank_interval=R)
    seen = {True: 0, False: 0}

    def counting(layer):
        def sparse_decode(q, k_pool, v_pool, table, pages, valid_lo, length, scale):
            listed = (pages >= 0).sum(-1).amax(0)  # [H] pages attended per KV head (the widest row)
            for h, n in enumerate(listed.tolist()):
                stable = bool(layer.reranker.is_stable[h])
                seen[stable] = max(seen[stable], n)
            return reference.sparse_decode(q, k_pool, v_pool, table, pages, valid_lo, length, scale)
        return sparse_decode

    ids = torch.randint(2, 96, (1, 160))  # ends on a page boundary: the longest window follows the prompt's seat
    fc(ids, past_key_values=cache)
    for layer in cache.layers:
        layer.storage.ops = dataclasses.replace(layer.storage.ops, sparse_decode=counting(layer))
    tok = ids[:, -1:]
    for _ in range(R + 2):
        tok = fc(tok, past_key_values=cache).logits[:, -1:].argmax(-1)
    assert seen == {True: most, False: 4}
    doc = " ".join(FlexiCacheConfig.__doc__.split())
    assert "plus every page created since that re-rank" in doc and "up to ``K + ceil(R / page_size)`` pages" in doc


@pytest.mark.parametrize("kind,heads,kv", [("llama", 4, 2), ("mistral", 6, 2), ("qwen2", 8, 2)])
@pytest.mark.parametrize("page_size", [8, 16])
@pytest.mark.parametrize("budget", [32, 64, "full"])
def test_a_rows_tokens_never_depend_on_its_batch(kind, heads, kv, page_size, budget, forced=(0, 0)):
    """Every row of a left-padded batch decodes the tokens it decodes alone, at every budget: its pages are its own
    (paddings here are no multiple of the page size), as with SDPA + DynamicCache."""
    cfg = tiny_config(kind, heads=heads, kv_heads=kv, layers=2)
    fc, _ = twin_models(cfg, seed=1)
    with torch.no_grad():  # (the pad token's embedding is zero, padding_idx: generated, its query would be zero and
        # every page score tie, and which tied pages a top-K keeps is the selection kernel's choice)
        fc.model.embed_tokens.weight[0].normal_(generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(page_size)
    lengths = [150, 3, 47, 101, 149]  # paddings 0, 147, 103, 49, 1
    rows = [torch.randint(2, 96, (1, n), generator=g) for n in lengths]
    L = max(lengths)
    ids, mask = torch.zeros(len(rows), L, dtype=torch.long), torch.zeros(len(rows), L, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, L - r.shape[1]:], mask[i, L - r.shape[1]:] = r[0], 1
    profile = HeadProfile.random(cfg, 0.25, seed=2)
    config = dict(page_size=page_size, token_budget=512 if budget == "full" else budget, rerank_interval=3,
                  sink_pages=forced[0], recent_pages=forced[1])
    batch = greedy(fc, ids, FlexiCache(profile, **config), n=16, attention_mask=mask)
    for i, r in enumerate(rows):
        alone = greedy(fc, r, FlexiCache(profile, **config), n=16)
        assert torch.equal(batch[i, L:], alone[0, r.shape[1]:]), f"row {i} (padding {L - r.shape[1]})"


@pytest.mark.parametrize("budget", [32, 64])
def test_a_rows_sink_pages_are_its_own_first_pages_in_a_batch(budget):
    """With sink and recent pages forced into every selection, still each row's own tokens: a row's sink page is its
    first page holding a token that is not padding."""
    test_a_rows_tokens_never_depend_on_its_batch("llama", 4, 2, 8, budget, forced=(1, 1))


def row_cache(cfg, sized: bool, budget: int = 512):
    return FlexiCache(HeadProfile.random(cfg, 0.5, seed=3), page_size=4, token_budget=budget, rerank_interval=3,
                      max_cache_len=100 if sized else None)


def decode(model, cache, first: torch.Tensor, n: int = 6) -> torch.Tensor:
    """Greedy tokens ``[B, n]`` fed one at a time from ``first [B, 1]`` (logits' argmax)."""
    out, tok = [], first
    with torch.no_grad():
        for _ in range(n):
            tok = model(tok, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            out.append(tok)
    return torch.cat(out, 1)


@pytest.mark.parametrize("sized", [False, True])
def test_row_operations_take_negative_indices_as_torch_indexing_does(sized):
    """``reorder_cache([-1, 0])`` is ``reorder_cache([1, 0])`` (DynamicCache's ``index_select`` refuses it; its
    ``batch_select_indices`` takes negative indices), sized storage included (it took every layer's pages apart)."""
    cfg = tiny_config("llama", heads=4, kv_heads=2, layers=2)
    fc, dense = twin_models(cfg)
    ids = torch.randint(2, 96, (2, 21), generator=torch.Generator().manual_seed(11))
    neg, pos, ref = row_cache(cfg, sized), row_cache(cfg, sized), DynamicCache()
    with torch.no_grad():
        for cache, model in ((neg, fc), (pos, fc), (ref, dense)):
            model(ids, past_key_values=cache, use_cache=True)
    neg.reorder_cache(torch.tensor([-1, 0]))
    pos.reorder_cache(torch.tensor([1, 0]))
    ref.reorder_cache(torch.tensor([1, 0]))
    first = ids[[1, 0], -1:]
    want = decode(dense, ref, first)
    assert torch.equal(decode(fc, neg, first), want) and torch.equal(decode(fc, pos, first), want)
    neg.batch_select_indices(torch.tensor([-2]))  # row 0 of the reordered batch
    ref.batch_select_indices(torch.tensor([-2]))
    assert torch.equal(decode(fc, neg, want[:1, -1:]), decode(dense, ref, want[:1, -1:]))


@pytest.mark.parametrize("sized", [False, True])
def test_row_operations_refuse_bad_arguments_before_any_layer_changes(sized):
    """An index or a repeat count no layer could take is refused with a clear error before any layer changes: the
    cache then decodes as an untouched one (before, a negative index on sized storage failed in a later layer's
    copy after earlier layers had taken it)."""
    cfg = tiny_config("llama", heads=4, kv_heads=2, layers=3)
    fc, _ = twin_models(cfg)
    ids = torch.randint(2, 96, (2, 21), generator=torch.Generator().manual_seed(5))
    cache, untouched = row_cache(cfg, sized, budget=8), row_cache(cfg, sized, budget=8)
    with torch.no_grad():
        fc(ids, past_key_values=cache, use_cache=True)
        fc(ids, past_key_values=untouched, use_cache=True)
    bad = [("reorder_cache", torch.tensor([0.0, 1.0]), TypeError), ("reorder_cache", torch.tensor([True, False]),
           TypeError), ("reorder_cache", torch.tensor([[0, 1]]), ValueError),
           ("batch_select_indices", torch.tensor([], dtype=torch.long), ValueError),
           ("batch_select_indices", torch.tensor([0, 2]), IndexError), ("reorder_cache", torch.tensor([-3, 0]),
           IndexError), ("batch_repeat_interleave", 0, ValueError), ("batch_repeat_interleave", 1.5, ValueError)]
    for method, arg, error in bad:
        with pytest.raises(error, match=method):
            getattr(cache, method)(arg)
    assert [layer.storage.batch for layer in cache.layers] == [2, 2, 2]
    assert torch.equal(decode(fc, cache, ids[:, -1:]), decode(fc, untouched, ids[:, -1:]))


def test_selecting_the_unpadded_rows_of_a_padded_batch_takes_a_follow_up_turn():
    """Rows kept from a left-padded batch: the cache knows whether they still hold padding, so a follow-up chunk
    without padding is taken (it was refused as "a later prompt chunk changed the left padding") and equals
    DynamicCache's."""
    cfg = tiny_config("llama", heads=4, kv_heads=2, layers=2, head_dim=16)
    fc, dense = twin_models(cfg)
    ids = torch.randint(2, 90, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    ids[1, :5] = 0
    cache, ref = FlexiCache(HeadProfile.random(cfg, 0.5, seed=3), **FULL), DynamicCache()
    out = greedy(fc, ids, cache, n=5, attention_mask=mask)
    assert torch.equal(out, greedy(dense, ids, ref, n=5, attention_mask=mask))
    for keep in ([0], [1, 0]):  # the unpadded row alone; then (a fresh pair) a padded row kept with it
        if keep == [1, 0]:
            cache, ref = FlexiCache(HeadProfile.random(cfg, 0.5, seed=3), **FULL), DynamicCache()
            greedy(fc, ids, cache, n=5, attention_mask=mask)
            greedy(dense, ids, ref, n=5, attention_mask=mask)
        cache.batch_select_indices(torch.tensor(keep))
        ref.batch_select_indices(torch.tensor(keep))
        x = torch.cat([out[keep], torch.randint(2, 90, (len(keep), 4), generator=torch.Generator().manual_seed(2))], 1)
        m = torch.cat([mask[keep], torch.ones((len(keep), x.shape[1] - mask.shape[1]), dtype=mask.dtype)], 1)
        assert torch.equal(greedy(fc, x, cache, n=5, attention_mask=m), greedy(dense, x, ref, n=5, attention_mask=m))
