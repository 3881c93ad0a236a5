"""The built-in corpus (assembled from this installation, cached) and loading corpora, built-in or your own."""

import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flexicache_hf import corpus
from flexicache_hf.data import Document, build_prompt, corpus_path, documents_by_source, load_documents, long_prompt
from flexicache_hf.models import load_default_tokenizer

KEYS = {corpus.REFERENCE: "reference", corpus.LICENSES: "license", corpus.DOCSTRINGS: "docstring"}


@pytest.fixture(scope="module")
def tok():
    # Only the tokenizer: a few seconds, against ~15 s for the whole GGUF model.
    return load_default_tokenizer()


def _write(path, records, raw=None):
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write(raw if raw is not None else "".join(json.dumps(r) + "\n" for r in records))
    return path


def _paragraph_keys(text):
    return [" ".join(p.split()) for p in re.split(r"\n[ \t]*\n", text)]


# ---- the built-in corpus ---------------------------------------------------------------------------
def test_builtin_corpus_has_three_labelled_sources():
    docs = load_documents()
    groups = documents_by_source()
    assert list(groups) == list(corpus.SOURCES)  # file order: reference, licenses, docstrings
    assert len({d.id for d in docs}) == len(docs)
    for d in docs:
        assert isinstance(d, Document) and d.license and d.title
        assert d.id.startswith(KEYS[d.source] + "/") and len(d.text) >= corpus.MIN_CHARS
    for source, group in groups.items():
        # Enough text per source for long prompts: each holds at least one document of ~5k+ tokens.
        assert len(group) >= 5 and max(len(d.text) for d in group) > 20_000, source
    assert {d.license for d in groups[corpus.REFERENCE]} == {"PSF-2.0"}
    assert all(d.title.startswith("reference/") for d in groups[corpus.REFERENCE])
    assert {d.title.split(".")[0] for d in groups[corpus.DOCSTRINGS]} == {"transformers", "torch"}
    assert all("/" in d.title for d in groups[corpus.LICENSES])  # package/relative-path
    assert not any(re.search(r"(^|/)AUTHORS", d.title) for d in groups[corpus.LICENSES])
    assert load_documents() == docs and load_documents() is not load_documents()  # copies of one parse


def test_builtin_corpus_repeats_no_paragraph_within_a_source():
    for source, group in documents_by_source().items():
        keys = [k for d in group for k in _paragraph_keys(d.text) if len(k) >= 60]
        assert len(keys) == len(set(keys)), source


def test_dedup_keeps_first_paragraph_and_drops_what_becomes_short():
    shared = "A paragraph of the same words that several texts carry, long enough to count as one. " * 2
    own = "Text only the first document has, repeated so that it passes the minimum length. " * 13
    lines = "\n\n".join(f"Line {k}." for k in range(200))  # short paragraphs only: never duplicates alone
    out = corpus._dedup([
        ("a", f"{shared}\n\n{own}\n\nShort line."),
        ("b", f"{shared}\n \n{own}\n\nShort line."),  # the same paragraphs: only "Short line." is left
        ("c", "Another text. " * 100 + "\n\nShort line."),  # a short paragraph is kept again
        ("d", lines),
        ("e", "  " + lines.replace("\n\n", "\n\n\n") + "\n"),  # equal to "d" but for whitespace
    ])
    assert [n for n, _ in out] == ["a", "c", "d"]
    assert out[0][1] == f"{shared.rstrip()}\n\n{own.rstrip()}\n\nShort line."
    assert out[1][1].endswith("\n\nShort line.") and out[2][1] == lines


def test_builtin_corpus_is_cached_in_the_cache_dir_and_reused(monkeypatch):
    path = corpus_path()
    assert path.parent == corpus.cache_dir() == Path(os.environ[corpus.CACHE_ENV])
    assert path.name == f"corpus-{corpus.fingerprint()}.jsonl.gz"
    stamp = path.stat().st_mtime_ns

    def no_build():
        raise AssertionError("the cached corpus should have been reused")
    monkeypatch.setattr(corpus, "build_records", no_build)
    assert corpus.ensure_built() == path and path.stat().st_mtime_ns == stamp
    assert not list(path.parent.glob("*.tmp"))  # no temp file left behind


def test_builtin_corpus_rebuilds_into_a_new_cache_dir_identically(tmp_path, monkeypatch):
    session_file = corpus_path()
    monkeypatch.setenv(corpus.CACHE_ENV, str(tmp_path / "new"))
    rebuilt = corpus.ensure_built()
    assert rebuilt.parent == tmp_path / "new" and rebuilt.read_bytes() == session_file.read_bytes()
    monkeypatch.setattr(corpus, "BUILDER_VERSION", corpus.BUILDER_VERSION + 1)
    assert corpus.cache_path() != rebuilt  # another builder: another file, never a stale one


def test_builtin_corpus_is_the_same_in_every_process(tmp_path):
    """Built from scratch in another process under another string-hash seed: the same bytes as this
    session's file (no set order or hash seed leaks into the corpus)."""
    seed = "1" if os.environ.get("PYTHONHASHSEED") != "1" else "2"  # this process runs under another one
    code = "from flexicache_hf import corpus; print(corpus.ensure_built())"
    env = {**os.environ, "PYTHONHASHSEED": seed, corpus.CACHE_ENV: str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    built = Path(done.stdout.strip())
    assert built.parent == tmp_path and built.name == corpus_path().name
    assert built.read_bytes() == corpus_path().read_bytes()


def test_missing_pydoc_data_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "pydoc_data.topics", None)  # importing it now raises ImportError
    with pytest.raises(corpus.CorpusError, match=r"pydoc_data\.topics.*--corpus"):
        corpus.reference_records()


def test_missing_docstring_library_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(corpus, "DOCSTRING_MODULES", (("no_such_library_here", ("",)),))
    with pytest.raises(corpus.CorpusError, match="'no_such_library_here', which is not installed"):
        corpus.docstring_records()


def test_unwritable_cache_dir_is_a_clear_error(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(corpus.CACHE_ENV, str(blocker / "cache"))
    with pytest.raises(corpus.CorpusError, match=corpus.CACHE_ENV):
        corpus.ensure_built()


def test_cli_prints_path_and_counts(capsys):
    corpus_path()  # built already: the CLI only reads it
    assert corpus.main([]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == str(corpus_path())
    for source, group in documents_by_source().items():
        assert any(line.endswith(source) and line.split()[0] == str(len(group)) for line in out)


# ---- a corpus of your own --------------------------------------------------------------------------
def test_explicit_path_beats_the_builtin_corpus(tmp_path):
    rec = {"id": "a", "source": "s", "license": "l", "title": "t", "text": "hello world", "chars": 11}
    f = _write(tmp_path / "c.jsonl.gz", [], raw=json.dumps(rec) + "\n\n")
    assert corpus_path(f) == f and load_documents(f) == [Document("a", "s", "l", "t", "hello world")]
    assert documents_by_source(f) == {"s": [Document("a", "s", "l", "t", "hello world")]}
    with pytest.raises(FileNotFoundError, match="no text corpus at .*absent.gz"):
        corpus_path(tmp_path / "absent.gz")


def test_malformed_corpus(tmp_path):
    with pytest.raises(ValueError, match=":1: expected string fields.*license"):
        load_documents(_write(tmp_path / "a.gz", [{"id": "a", "source": "s", "title": "t", "text": "x"}]))
    with pytest.raises(ValueError, match=":2: not a JSON object"):
        good = json.dumps(dict(id="a", source="s", license="l", title="t", text="x"))
        load_documents(_write(tmp_path / "b.gz", [], raw=good + "\n{oops\n"))
    with pytest.raises(ValueError, match="not gzipped"):
        (tmp_path / "c.gz").write_text("{}\n")
        load_documents(tmp_path / "c.gz")
    with pytest.raises(ValueError, match="no documents"):
        load_documents(_write(tmp_path / "d.gz", [], raw="\n"))


# ---- prompts from it -------------------------------------------------------------------------------
def _longest():
    return max(load_documents(), key=lambda d: (len(d.text), d.id))


@pytest.mark.parametrize("limit", [60, 257, 1500])
def test_build_prompt_fits(tok, limit):
    doc = _longest()  # tens of thousands of characters: always cut at these limits
    ids = build_prompt(tok, doc, "Summarise the text above.", limit)
    assert ids.dtype == torch.long and ids.shape[0] == 1
    assert limit - 8 <= ids.shape[1] <= limit
    text = tok.decode(ids[0])
    assert text.endswith("Summarise the text above.<|im_end|>\n<|im_start|>assistant\n")
    assert doc.text[:40] in text
    assert torch.equal(ids, build_prompt(tok, doc, "Summarise the text above.", limit))


def test_build_prompt_short_doc_and_plain(tok):
    doc = Document("x", "s", "l", "t", "A short document.")
    full = build_prompt(tok, doc, "Repeat it.", 4096)
    assert "A short document.\n\nRepeat it." in tok.decode(full[0])
    plain = build_prompt(tok, _longest(), "Go on.", 100, chat=False)
    assert plain.shape[1] <= 100 and tok.decode(plain[0]).endswith("\n\nGo on.")
    with pytest.raises(ValueError, match="cannot hold"):
        build_prompt(tok, doc, "Repeat it.", 10)


@pytest.mark.parametrize("n", [1, 100, 3000])
def test_long_prompt_exact(tok, n):
    ids = long_prompt(tok, n, doc_index=2)
    assert ids.shape == (1, n) and ids.dtype == torch.long
    assert torch.equal(ids, long_prompt(tok, n, doc_index=2))


def test_long_prompt_concatenates_same_source(tok):
    docs = load_documents()
    # A short document (< ~700 tokens) followed by another of its source.
    i = next(i for i, d in enumerate(docs[:-1]) if len(d.text) < 2500 and docs[i + 1].source == d.source)
    ids = long_prompt(tok, 2000, doc_index=i)
    assert ids.shape == (1, 2000)
    text = tok.decode(ids[0])
    assert text.startswith(docs[i].text[:50]) and docs[i + 1].text[:50] in text


def test_long_prompt_short_source(tok):
    docs = load_documents()
    i = next(i for i, d in enumerate(docs) if d.source == corpus.LICENSES)  # ~200k characters here
    everything = long_prompt(tok, 10**7, doc_index=i, min_tokens=1)
    assert 10_000 < everything.shape[1] < 10**7
    with pytest.raises(ValueError, match="holds only"):
        long_prompt(tok, 10**7, doc_index=i)
    with pytest.raises(ValueError, match="doc_index"):
        long_prompt(tok, 10, doc_index=len(docs))
    with pytest.raises(ValueError, match="min_tokens"):
        long_prompt(tok, 10, min_tokens=11)
