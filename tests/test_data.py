import gzip
import json

import pytest
import torch

from flexicache_hf import data
from flexicache_hf.data import Document, build_prompt, corpus_path, documents_by_source, load_documents, long_prompt
from flexicache_hf.models import load_default_tokenizer


@pytest.fixture(scope="module")
def tok():
    # Only the tokenizer: a few seconds, against ~15 s for the whole GGUF model.
    return load_default_tokenizer()


def _index(doc_id):
    return next(i for i, d in enumerate(load_documents()) if d.id == doc_id)


def test_corpus_loads():
    docs = load_documents()
    assert len(docs) == 179 and len({d.id for d in docs}) == 179
    assert all(isinstance(d, Document) and d.text and d.license for d in docs)
    groups = documents_by_source()
    assert sum(map(len, groups.values())) == 179 and len(groups) == 3
    assert load_documents() == docs and load_documents() is not load_documents()  # copies of one parse


def test_corpus_path_order(tmp_path, monkeypatch):
    f = tmp_path / "c.jsonl.gz"
    rec = {"id": "a", "source": "s", "license": "l", "title": "t", "text": "hello world", "chars": 11}
    with gzip.open(f, "wt") as out:
        out.write(json.dumps(rec) + "\n\n")
    monkeypatch.delenv(data.CORPUS_ENV, raising=False)
    assert corpus_path().name == "longtext.jsonl.gz"
    monkeypatch.setenv(data.CORPUS_ENV, str(f))
    assert corpus_path() == f and load_documents() == [Document("a", "s", "l", "t", "hello world")]
    assert corpus_path(data._default_corpus()) == data._default_corpus()  # the argument beats the env var
    monkeypatch.setenv(data.CORPUS_ENV, str(tmp_path / "absent.gz"))
    with pytest.raises(FileNotFoundError, match=data.CORPUS_ENV):
        corpus_path()
    with pytest.raises(FileNotFoundError, match="explicitly"):
        corpus_path(tmp_path / "absent.gz")


def test_malformed_corpus(tmp_path):
    f = tmp_path / "bad.jsonl.gz"
    with gzip.open(f, "wt") as out:
        out.write(json.dumps({"id": "a", "source": "s", "title": "t", "text": "x"}) + "\n")
    with pytest.raises(ValueError, match="license"):
        load_documents(f)


@pytest.mark.parametrize("limit", [60, 257, 1500])
def test_build_prompt_fits(tok, limit):
    doc = load_documents()[0]  # ~31k characters: always cut at these limits
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
    plain = build_prompt(tok, load_documents()[1], "Go on.", 100, chat=False)
    assert plain.shape[1] <= 100 and tok.decode(plain[0]).endswith("\n\nGo on.")
    with pytest.raises(ValueError, match="cannot hold"):
        build_prompt(tok, doc, "Repeat it.", 10)


@pytest.mark.parametrize("n", [1, 100, 3000])
def test_long_prompt_exact(tok, n):
    ids = long_prompt(tok, n, doc_index=2)
    assert ids.shape == (1, n) and ids.dtype == torch.long
    assert torch.equal(ids, long_prompt(tok, n, doc_index=2))


def test_long_prompt_concatenates_same_source(tok):
    i = _index("license/BSD")  # the shortest document, ~400 tokens
    ids = long_prompt(tok, 2000, doc_index=i)
    assert ids.shape == (1, 2000)
    text = tok.decode(ids[0])
    docs = load_documents()
    assert text.startswith(docs[i].text[:50]) and docs[i + 1].text[:50] in text


def test_long_prompt_short_source(tok):
    i = _index("license/BSD")
    everything = long_prompt(tok, 10**7, doc_index=i, min_tokens=1)
    assert 10_000 < everything.shape[1] < 10**7
    with pytest.raises(ValueError, match="holds only"):
        long_prompt(tok, 10**7, doc_index=i)
    with pytest.raises(ValueError, match="doc_index"):
        long_prompt(tok, 10, doc_index=179)
    with pytest.raises(ValueError, match="min_tokens"):
        long_prompt(tok, 10, min_tokens=11)
