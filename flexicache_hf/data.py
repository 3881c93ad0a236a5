"""Loading the long-text corpus used by profiling, the evaluation harness, the demo and the tests.

Long documents matter: FlexiCache only differs from a full cache once the context is longer than the
device-resident top-K pages.  A corpus is a gzipped JSON-lines file of documents (fields id, source,
license, title, text).  Without an explicit path the built-in one is used: texts assembled from this
installation (CPython's language reference, installed packages' license texts, library docstrings) by
:mod:`flexicache_hf.corpus` on first use and cached.  A path (``path=`` / ``corpus=`` arguments,
``--corpus`` on the command lines) loads a corpus of your own in the same format instead.
"""

from __future__ import annotations

import functools
import gzip
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from . import corpus as _builtin

_FIELDS = ("id", "source", "license", "title", "text")


def corpus_path(path: str | os.PathLike | None = None) -> Path:
    """``path`` when given (it must exist), else the built-in corpus (built and cached first if needed)."""
    if path is None:
        return _builtin.ensure_built()
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no text corpus at {p}; pass the path of a gzipped JSON-lines file with "
                                f"string fields {list(_FIELDS)}, or no path for the built-in corpus")
    return p


@dataclass(frozen=True)
class Document:
    id: str
    source: str
    license: str
    title: str
    text: str


@functools.lru_cache(maxsize=4)
def _load(path: Path) -> tuple[Document, ...]:
    docs = []
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not a JSON object ({e})") from e
                bad = [k for k in _FIELDS if not isinstance(rec, dict) or not isinstance(rec.get(k), str)]
                if bad:
                    raise ValueError(f"{path}:{n}: expected string fields {list(_FIELDS)}, missing or not text: {bad}")
                docs.append(Document(*(rec[k] for k in _FIELDS)))
    except gzip.BadGzipFile as e:
        raise ValueError(f"{path}: a corpus is a gzipped JSON-lines file; this one is not gzipped ({e})") from e
    if not docs:
        raise ValueError(f"{path}: the corpus holds no documents")
    return tuple(docs)


def load_documents(path: str | os.PathLike | None = None) -> list[Document]:
    """All documents in file order (parsed once per resolved path)."""
    return list(_load(corpus_path(path).resolve()))


def documents_by_source(path: str | os.PathLike | None = None) -> dict[str, list[Document]]:
    """Documents grouped by ``source``, groups and members in file order."""
    groups: dict[str, list[Document]] = {}
    for d in load_documents(path):
        groups.setdefault(d.source, []).append(d)
    return groups


def token_ids(x) -> list[int]:
    """A flat list of token ids from whatever a tokenizer returned (dict, tensor, nested list)."""
    # apply_chat_template's return type has moved between transformers releases.
    if hasattr(x, "keys"):
        x = x["input_ids"]
    if hasattr(x, "tolist"):
        x = x.tolist()
    if x and isinstance(x[0], list):
        x = x[0]
    return list(x)


def _encode(tokenizer, text: str, instruction: str, chat: bool) -> list[int]:
    content = f"{text}\n\n{instruction}" if text else instruction
    if chat:
        msgs = [{"role": "user", "content": content}]
        return token_ids(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))
    return token_ids(tokenizer(content)["input_ids"])


def build_prompt(tokenizer, doc: Document, instruction: str, max_prompt_tokens: int, *, chat: bool = True) -> torch.LongTensor:
    """Document then instruction as one user turn, the document cut to fit.

    The cut is by tokens, measured on the final templated prompt (re-tokenising
    a cut can merge tokens differently at the seam, so the count is re-checked
    rather than computed).  Returns ``[1, T]`` with ``T <= max_prompt_tokens``.
    """
    full = _encode(tokenizer, doc.text, instruction, chat)
    if len(full) <= max_prompt_tokens:
        return torch.tensor([full], dtype=torch.long)
    overhead = len(_encode(tokenizer, "", instruction, chat))
    if overhead > max_prompt_tokens:
        raise ValueError(
            f"max_prompt_tokens={max_prompt_tokens} cannot hold even the template and instruction "
            f"({overhead} tokens); raise the limit or shorten the instruction"
        )
    doc_ids = token_ids(tokenizer(doc.text, add_special_tokens=False)["input_ids"])
    k = min(len(doc_ids), max_prompt_tokens - overhead)
    while True:
        # A cut inside a multi-byte character decodes to U+FFFD; drop it.
        text = tokenizer.decode(doc_ids[:k]).rstrip("\ufffd")
        ids = _encode(tokenizer, text, instruction, chat)
        if len(ids) <= max_prompt_tokens or k == 0:
            return torch.tensor([ids], dtype=torch.long)
        k = max(0, k - max(1, len(ids) - max_prompt_tokens))


def long_prompt(tokenizer, n_tokens: int, *, doc_index: int = 0, min_tokens: int | None = None,
                path: str | os.PathLike | None = None) -> torch.LongTensor:
    """Plain (untemplated) real text of ``n_tokens`` tokens, shape ``[1, T]``.

    Starts at document ``doc_index`` and, when it is too short, appends the next
    documents of the same source (wrapping round), so the text stays one kind of
    prose.  ``T == n_tokens`` unless the whole source is shorter; then the prompt
    is returned if it has at least ``min_tokens`` (default: ``n_tokens``) tokens,
    else ValueError.
    """
    if n_tokens < 1:
        raise ValueError(f"n_tokens must be >= 1, found {n_tokens}")
    need = n_tokens if min_tokens is None else min_tokens
    if not 1 <= need <= n_tokens:
        raise ValueError(f"min_tokens must be in [1, n_tokens={n_tokens}], found {min_tokens}")
    docs = load_documents(path)
    if not 0 <= doc_index < len(docs):
        raise ValueError(f"doc_index must be in [0, {len(docs)}), found {doc_index}")
    first = docs[doc_index]
    same = [i for i, d in enumerate(docs) if d.source == first.source]
    at = same.index(doc_index)
    order = [docs[i] for i in same[at:] + same[:at]]
    pieces: list[str] = []
    counted = 0
    ids: list[int] = []
    for j, d in enumerate(order):
        pieces.append(d.text)
        counted += len(token_ids(tokenizer(d.text, add_special_tokens=False)["input_ids"]))
        # Tokenise the joined text only once the pieces look long enough: cheap,
        # and the joined tokenisation is what the prompt really is.
        if counted >= n_tokens or j == len(order) - 1:
            ids = token_ids(tokenizer("\n\n".join(pieces))["input_ids"])
            if len(ids) >= n_tokens:
                break
    if len(ids) < need:
        raise ValueError(
            f"source {first.source!r} holds only {len(ids)} tokens, fewer than the {need} asked for; "
            "pick another doc_index or lower min_tokens"
        )
    return torch.tensor([ids[:n_tokens]], dtype=torch.long)
