"""The head-stability profiler end to end on a tiny random Llama (CPU, seconds), and its CLI."""

import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig

import flexicache_hf  # noqa: F401  registers attn_implementation="flexicache"
from flexicache_hf import profile as cli
from flexicache_hf.head_profile import HeadProfile
from flexicache_hf.kernels.reference import select_pages
from flexicache_hf.stability import SelectionRecord
from flexicache_hf.stability.profiler import _Recorder, _run_sample, profile_model, write_figures
from flexicache_hf.corpus import SOURCES
from flexicache_hf.stability.tasks import Sample, default_tasks, get_tasks

LAYERS, KV_HEADS = 3, 4  # 12 KV heads -> 3 unstable at 25 %
SMALL = dict(new_tokens=20, k_pages=4, page_size=8, window=6, progress=False)


def tiny_model(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(num_hidden_layers=LAYERS, num_attention_heads=8, num_key_value_heads=KV_HEADS,
                      hidden_size=64, intermediate_size=96, vocab_size=128, max_position_embeddings=1024,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="flexicache").eval()


def token_tasks(seed=0, n_tasks=3, per_task=2, length=120):
    g = torch.Generator().manual_seed(seed)
    return {f"task{t}": [torch.randint(3, 128, (length + 7 * i,), generator=g) for i in range(per_task)]
            for t in range(n_tasks)}


class CharTokenizer:
    """A tokenizer-shaped stand-in (printable ASCII <-> ids 3..127) so corpus tasks run on the tiny model."""

    def _enc(self, text):
        return [ord(c) - 29 if 32 <= ord(c) < 127 else 3 for c in text]

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": self._enc(text)}

    def apply_chat_template(self, msgs, add_generation_prompt=True, tokenize=True, return_dict=False):
        return [1] + self._enc(msgs[0]["content"]) + [2]

    def decode(self, ids, skip_special_tokens=False):
        ids = ids.tolist() if hasattr(ids, "tolist") else ids
        return "".join(chr(i + 29) for i in ids if i >= 3)


@pytest.fixture(scope="module")
def run():
    model = tiny_model()
    return model, profile_model(model, tasks=token_tasks(), oracle=True, **SMALL)


def test_end_to_end_profile(run, tmp_path):
    model, result = run
    path = result.profile.save(tmp_path / "tiny.json")
    loaded = HeadProfile.load(path)
    loaded.check_model(model.config)  # validates against the model it was measured on
    assert loaded == result.profile
    assert len(loaded.unstable) == 3 == 0.25 * LAYERS * KV_HEADS
    assert set(loaded.scores) == {(l, h) for l in range(LAYERS) for h in range(KV_HEADS)}
    assert all(0.0 <= s <= 1.0 for s in loaded.scores.values())
    prov = loaded.provenance
    for key in ("tool_version", "created", "k_pages", "window", "page_size", "decode_steps", "tasks",
                "samples_per_task", "max_prompt_tokens", "fraction"):
        assert key in prov, key
    assert (prov["k_pages"], prov["window"], prov["page_size"], prov["decode_steps"]) == (4, 6, 8, 20)
    assert [t["name"] for t in prov["tasks"]] == ["task0", "task1", "task2"]

    for est in (result.estimated, result.oracle):
        assert est.overlap.shape == (3, 3) and np.allclose(np.diag(est.overlap), 1.0)
        assert np.allclose(est.overlap, est.overlap.T) and ((0 <= est.overlap) & (est.overlap <= 1)).all()
        assert all(len(s) == 3 for s in est.task_unstable.values())
        assert est.rco_by_offset.shape == (SMALL["window"] - 1, LAYERS, KV_HEADS)
    assert set(result.agreement()) == {"task0", "task1", "task2", "all"}


def test_figures_and_metrics_written(run, tmp_path):
    _, result = run
    paths = write_figures(result, tmp_path / "figs", "tiny")
    for key in ("rco_vs_offset", "ts_distribution", "overlap_estimated", "overlap_oracle", "metrics"):
        assert paths[key].is_file() and paths[key].stat().st_size > 1000, key
        assert paths[key].read_bytes()[:4] == b"\x89PNG" or key == "metrics"
    metrics = json.loads(paths["metrics"].read_text())
    assert metrics["estimated"]["cross_task_overlap"]["tasks"] == ["task0", "task1", "task2"]
    assert len(metrics["oracle"]["unstable_heads"]) == 3 and len(metrics["samples"]) == 6


def test_same_seed_same_profile(run):
    _, first = run
    again = profile_model(tiny_model(), tasks=token_tasks(), oracle=True, **SMALL)
    a, b = first.profile.to_dict(), again.profile.to_dict()
    a["provenance"].pop("created"), b["provenance"].pop("created")
    assert a == b
    assert np.array_equal(first.oracle.overlap, again.oracle.overlap)


def test_profiling_decodes_densely_and_records_topk(tmp_path):
    """The recording cache must not make generation sparse, and every selection is a top-K with the
    newest page, exactly as select_pages would choose."""
    model = tiny_model(1)
    ids = torch.randint(3, 128, (1, 90), generator=torch.Generator().manual_seed(5))
    rec, new = _run_sample(model, Sample("t", "t/0", "t", ids), new_tokens=16, k_pages=3, page_size=8,
                           scaling=None, device=torch.device("cpu"), on_step=None)
    with torch.inference_mode():
        dense = model.generate(ids, max_new_tokens=17, min_new_tokens=17, do_sample=False, pad_token_id=0,
                               past_key_values=DynamicCache())
    assert torch.equal(new, dense[0, 90:])
    r = rec.estimated
    assert r.num_steps == 16 and r.k == 3
    for layer in range(LAYERS):
        pages, n = r.layer_pages(layer), r.layer_num_pages(layer)
        # N_t grows with the context (pages counted back from the prompt's end: 6 empty positions first)
        assert (n == np.ceil((6 + 90 + 1 + np.arange(16)) / 8)).all()
        assert ((pages >= 0).sum(-1) == 3).all()
        assert all((pages[s] == n[s] - 1).any(-1).all() for s in range(16))  # newest page always in


def test_oracle_mass_matches_explicit_softmax():
    model = tiny_model(2)
    seen = {}

    class Spy(_Recorder):
        def _attention_mass(self, event):
            mass = super()._attention_mass(event)
            if event.layer_idx == 1 and event.step == 3:
                layer = self.cache.layers[1]
                keys, _ = layer.gather_tokens(layer.seq_len)
                seen.update(mass=mass.clone(), keys=keys[0].clone(), q=event.query[0].clone(), n=event.num_pages)
            return mass

    import flexicache_hf.stability.profiler as prof

    ids = torch.randint(3, 128, (1, 50), generator=torch.Generator().manual_seed(0))
    orig = prof._Recorder
    prof._Recorder = Spy
    try:
        prof._run_sample(model, Sample("t", "t/0", "t", ids), new_tokens=6, k_pages=2, page_size=8,
                         scaling={}, device=torch.device("cpu"), on_step=None)
    finally:
        prof._Recorder = orig
    keys, q, n = seen["keys"], seen["q"], seen["n"]
    group = q.shape[0] // KV_HEADS
    want = torch.zeros(KV_HEADS, n)
    for qh in range(q.shape[0]):
        p = torch.softmax(keys[qh // group].float() @ q[qh].float() * q.shape[1] ** -0.5, dim=0)
        p = torch.nn.functional.pad(p, (6, 0))  # pages counted back from the 50-token prompt's end (6 empty first)
        per_page = torch.stack([p[i * 8:(i + 1) * 8].sum() for i in range(n)])
        want[qh // group] = torch.maximum(want[qh // group], per_page)
    assert torch.allclose(seen["mass"], want, atol=1e-5)
    assert torch.equal(select_pages(want[None], 2)[0], select_pages(seen["mass"][None], 2)[0])


def test_records_saved_and_loadable(tmp_path):
    profile_model(tiny_model(), tasks=token_tasks(n_tasks=1, per_task=1), records_dir=tmp_path, **SMALL)
    (path,) = tmp_path.glob("*.estimated.npz")
    rec = SelectionRecord.load(path)
    assert (rec.num_layers, rec.num_kv_heads, rec.k, rec.num_steps) == (LAYERS, KV_HEADS, 4, 20)


def test_argument_validation():
    with pytest.raises(ValueError, match="window"):
        profile_model(tiny_model(), tasks=token_tasks(), **{**SMALL, "new_tokens": 4})
    with pytest.raises(ValueError, match="fraction"):
        profile_model(tiny_model(), tasks=token_tasks(), **{**SMALL, "fraction": 1.5})
    with pytest.raises(ValueError, match="tokenizer"):
        profile_model(tiny_model(), tasks=get_tasks(["api-explain"]), **SMALL)


def test_tasks_are_distinct_and_deterministic():
    tasks = default_tasks()
    assert len(tasks) >= 4 and len({t.instruction for t in tasks}) == len(tasks)
    picked = {t.name: [d.id for d in t.documents(3, min_chars=8000)] for t in tasks}
    assert picked == {t.name: [d.id for d in t.documents(3, min_chars=8000)] for t in default_tasks()}
    ids = [i for v in picked.values() for i in v]
    assert len(ids) == len(set(ids)) == 3 * len(tasks)  # different documents within and across tasks
    assert {t.source for t in tasks} == set(SOURCES)  # every source of the built-in corpus is used
    for t in tasks:  # each task reads its own source, and long documents when asked for them
        assert all(d.source == t.source and len(d.text) >= 8000 for d in t.documents(3, min_chars=8000))
    with pytest.raises(ValueError, match="unknown"):
        get_tasks(["nope"])


def test_cli_parsing_defaults_follow_the_api():
    args = cli.build_parser().parse_args([])
    assert (args.model, args.samples, args.prompt_tokens, args.new_tokens, args.k_pages, args.window,
            args.fraction, args.oracle) == ("smollm2", 2, 3072, 256, 32, 32, 0.25, False)
    assert args.tasks == [t.name for t in default_tasks()] and args.corpus is None
    args = cli.build_parser().parse_args(["--model", "/m", "--gguf", "f.gguf", "--out", "p.json", "--tasks",
                                          "api-explain", "reference-qa", "--k-pages", "16", "--oracle",
                                          "--dtype", "bfloat16", "--device", "cuda"])
    assert (args.model, args.gguf, str(args.out), args.tasks, args.k_pages, args.oracle, args.dtype,
            args.device) == ("/m", "f.gguf", "p.json", ["api-explain", "reference-qa"], 16, True, "bfloat16", "cuda")
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--tasks", "nope"])


def test_cli_end_to_end_with_corpus_tasks(tmp_path, monkeypatch):
    monkeypatch.setattr(cli, "_load", lambda args: (tiny_model(), CharTokenizer(), "tiny/Tiny-Llama", "random"))
    threads = torch.get_num_threads()
    rc = cli.main(["--out", str(tmp_path / "p" / "Tiny.json"), "--figures", str(tmp_path / "f"), "--samples", "1",
                   "--prompt-tokens", "400", "--new-tokens", "16", "--k-pages", "4", "--page-size", "8",
                   "--window", "4", "--quiet"])
    assert rc == 0 and torch.get_num_threads() == threads
    prof = HeadProfile.load(tmp_path / "p" / "Tiny.json")
    assert prof.model.name == "tiny/Tiny-Llama" and prof.provenance["weights"] == "random"
    assert [t["name"] for t in prof.provenance["tasks"]] == [t.name for t in default_tasks()]
    assert all(n <= 400 for n in prof.provenance["prompt_tokens"])
    assert {p.name for p in (tmp_path / "f").iterdir()} == {
        "Tiny.rco_vs_offset.png", "Tiny.ts_distribution.png", "Tiny.overlap_estimated.png", "Tiny.metrics.json"}
    docs = {t["name"]: t["documents"] for t in prof.provenance["tasks"]}
    assert docs["reference-summary"][0].startswith("reference/") and docs["api-explain"][0].startswith("docstring/")


def test_cli_reads_a_corpus_of_your_own(tmp_path, monkeypatch):
    """--corpus replaces the built-in texts (the tasks find documents by the built-in source labels)."""
    import gzip

    from flexicache_hf.corpus import LICENSES

    f = tmp_path / "mine.jsonl.gz"
    with gzip.open(f, "wt") as out:
        for k in range(2):
            out.write(json.dumps({"id": f"mine/{k}", "source": LICENSES, "license": "CC0-1.0", "title": f"t{k}",
                                  "text": f"Clause {k}: you may do as you like. " * 60}) + "\n")
    monkeypatch.setattr(cli, "_load", lambda args: (tiny_model(), CharTokenizer(), "tiny/Tiny-Llama", "random"))
    rc = cli.main(["--out", str(tmp_path / "Tiny.json"), "--corpus", str(f), "--tasks", "license-obligations",
                   "--samples", "2", "--prompt-tokens", "200", "--new-tokens", "8", "--k-pages", "4",
                   "--page-size", "8", "--window", "4", "--quiet"])
    assert rc == 0
    tasks = HeadProfile.load(tmp_path / "Tiny.json").provenance["tasks"]
    assert [t["documents"] for t in tasks] == [["mine/0", "mine/1"]]
