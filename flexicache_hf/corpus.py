"""The built-in text corpus: long natural-language texts assembled from the installation itself.

FlexiCache only differs from a full cache once the context is longer than the device-resident pages, so
profiling, the evaluation harness, the demo and the tests need long real texts.  They come from three
sources that every CPython with this project's dependencies already holds, so nothing is downloaded and
the repository carries no copy of anyone's text:

* ``reference``: CPython's language-reference topics (``pydoc_data.topics``, the text behind
  ``help("with")``; PSF-2.0).
* ``license``: the license texts inside installed packages' ``*.dist-info`` folders.
* ``docstring``: docstrings of a fixed set of transformers and torch modules, read from the source files
  with :mod:`ast` (nothing is imported, so the build is fast and has no side effects).

Within each source a paragraph is kept only the first time it appears: the topics overlap (``specialnames``
contains ``customization``), dozens of packages ship the same Apache-2.0 text, and docstrings repeat
parameter descriptions.  What is left of a document after that must still be ``MIN_CHARS`` long.

The corpus is built on first use and cached as gzipped JSON lines (fields id, source, license, title,
text: the format :mod:`flexicache_hf.data` loads) in :func:`cache_dir`.  The file name carries a
fingerprint of what the texts were read from (Python version, name and version of every installed
distribution, ``BUILDER_VERSION``), so a changed environment gets a new file instead of a stale one.
For a given environment the build is deterministic, byte for byte: inputs are sorted, nothing depends
on set order or the string-hash seed, and the gzip header carries no time stamp.

    python -m flexicache_hf.corpus        # build if needed; print the cache path and per-source counts
"""

from __future__ import annotations

import argparse
import ast
import functools
import gzip
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

# Bump when the built texts change for an unchanged environment (new rule, new module list...), so
# that caches written by an older builder are not read.
BUILDER_VERSION = 1

CACHE_ENV = "FLEXICACHE_CACHE_DIR"

# The `source` field of each document.
REFERENCE = "Python language reference (pydoc_data.topics)"
LICENSES = "License texts of installed packages (*.dist-info)"
DOCSTRINGS = "Docstrings of transformers and torch (parsed from their source files)"
SOURCES = (REFERENCE, LICENSES, DOCSTRINGS)

REFERENCE_LICENSE = "PSF-2.0"  # pydoc_data ships with CPython, under the PSF license

# (distribution, package directories relative to the distribution's top-level package): every *.py
# directly inside each directory ("" is the package itself).  A bounded list, not the whole packages:
# parsing all of torch takes ~25 s on two cores, these modules a few seconds.
DOCSTRING_MODULES = (
    ("transformers", ("", "generation")),
    ("torch", ("nn/modules", "optim", "utils/data")),
)

# A license file, by name (LICENSE.txt, LICENCE, COPYING, NOTICE...).  AUTHORS files are lists of
# names, not license text, and are left out.
_LICENSE_NAME = re.compile(r"^(LICEN[CS]E|COPYING|NOTICE)", re.I)

MIN_CHARS = 1000  # shorter (what is left of) documents are dropped: they cannot fill a prompt
# Paragraphs shorter than this are never treated as duplicates: "Added in version 3.6." or "Example:"
# recur in distinct texts and belong to each of them.
_DEDUP_MIN_CHARS = 60
_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n")


class CorpusError(RuntimeError):
    """The built-in corpus cannot be assembled (a source missing from this installation)."""


# ---- where it lives --------------------------------------------------------------------------------
def cache_dir() -> Path:
    """$FLEXICACHE_CACHE_DIR, else $XDG_CACHE_HOME/flexicache_hf, else ~/.cache/flexicache_hf."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "flexicache_hf"


def _norm_name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@functools.lru_cache(maxsize=1)
def _distributions() -> tuple[importlib.metadata.Distribution, ...]:
    """Installed distributions, one per name (the first on sys.path, the one imports use), sorted by name.

    Cached for the process: installing packages while it runs is not something this tracks.
    """
    seen: dict[str, importlib.metadata.Distribution] = {}
    for d in importlib.metadata.distributions():
        name = d.metadata["Name"]
        if name and _norm_name(name) not in seen:
            seen[_norm_name(name)] = d
    return tuple(seen[k] for k in sorted(seen))


@functools.lru_cache(maxsize=1)
def _versions() -> tuple[str, ...]:
    # Cached with _distributions: reading every METADATA file costs ~0.1-0.2 s, and the corpus path is
    # looked up on every load.
    return tuple(f"{_norm_name(d.metadata['Name'])}={d.version}" for d in _distributions())


def fingerprint() -> str:
    """A short hash of what the corpus is read from (same environment, same fingerprint)."""
    python = f"{sys.implementation.name}-{'.'.join(map(str, sys.version_info[:3]))}"
    parts = [f"builder={BUILDER_VERSION}", f"python={python}"]
    return hashlib.sha256("\n".join(parts + list(_versions())).encode()).hexdigest()[:16]


def cache_path() -> Path:
    """Where the built corpus of this environment is (or will be) cached."""
    return cache_dir() / f"corpus-{fingerprint()}.jsonl.gz"


# ---- de-duplication --------------------------------------------------------------------------------
def _squash(text: str) -> str:
    return " ".join(text.split())


def _dedup(named_texts: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Keep each paragraph the first time it appears, in the given order; drop what ends up too short.

    Whole texts that are equal after whitespace normalisation count once (the first name wins).
    """
    seen_texts: set[str] = set()  # membership only: never iterated, so hash order cannot leak out
    seen_paras: set[str] = set()
    out = []
    for name, text in named_texts:
        whole = _squash(text)
        if whole in seen_texts:
            continue
        seen_texts.add(whole)
        kept = []
        for para in _PARAGRAPH_BREAK.split(text.strip()):
            key = _squash(para)
            if not key:
                continue
            if len(key) >= _DEDUP_MIN_CHARS:
                if key in seen_paras:
                    continue
                seen_paras.add(key)
            kept.append(para.strip("\n").rstrip())
        body = "\n\n".join(kept)
        if len(body) >= MIN_CHARS:
            out.append((name, body))
    return out


def _record(key: str, name: str, source: str, license: str, text: str, title: str | None = None) -> dict:
    """One JSONL record; its id, "<key>/<name>", depends only on where the text came from."""
    return {"id": f"{key}/{name}", "source": source, "license": license, "title": title or name, "text": text}


# ---- the three sources ------------------------------------------------------------------------------
def reference_records() -> list[dict]:
    """CPython's language-reference topics, longest first (so overlapping topics keep the fullest copy)."""
    try:
        from pydoc_data.topics import topics
    except ImportError as e:
        raise CorpusError(
            "the built-in corpus needs CPython's pydoc_data.topics (the language-reference texts behind "
            "help()), which this Python installation lacks (some distributions package it separately); "
            "install the full standard library or pass your own corpus with --corpus / path="
        ) from e
    ordered = sorted(topics.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    # Titles like "reference/specialnames": the topic's name, marked as language-reference text.
    return [_record("reference", name, REFERENCE, REFERENCE_LICENSE, text, title=f"reference/{name}")
            for name, text in _dedup(ordered)]


def _license_of(dist: importlib.metadata.Distribution) -> str:
    """The distribution's declared license: License-Expression, else a one-line License field, else its
    license classifiers; "unspecified" when it declares none (some put the whole text in License)."""
    md = dist.metadata
    if md.get("License-Expression"):
        return md["License-Expression"].strip()
    lic = (md.get("License") or "").strip()
    if lic and "\n" not in lic and len(lic) <= 100:
        return lic
    classifiers = [c.split(" :: ")[-1] for c in (md.get_all("Classifier") or []) if c.startswith("License ::")]
    return "; ".join(classifiers) or "unspecified"


def _license_files(dist: importlib.metadata.Distribution) -> list[tuple[str, str]]:
    """(path relative to the dist-info folder, text) of each license file a distribution installed."""
    out = []
    for f in dist.files or ():
        parts = f.parts
        inside = [i for i, p in enumerate(parts) if p.endswith(".dist-info")]
        if not inside or not _LICENSE_NAME.match(parts[-1]):
            continue
        try:
            text = Path(dist.locate_file(f)).read_text(encoding="utf-8", errors="replace")
        except OSError:  # listed in RECORD but not on disk: nothing to read
            continue
        # Relative to the dist-info folder: stable across versions ("licenses/LICENSE"); vendored
        # packages' own dist-info folders (setuptools/_vendor/...) keep their path.
        rel = "/".join(parts[inside[0] + 1:]) if inside[0] == 0 else "/".join(parts)
        out.append((rel, text))
    return sorted(out)


def license_records() -> list[dict]:
    """License texts of installed distributions, by distribution name then path, de-duplicated.

    Name order (not longest first): a common license (Apache-2.0, MIT...) then stays whole in the first
    package that ships it, and the long bundles (numpy's, pillow's) keep only their own paragraphs.
    """
    named, licenses = [], {}
    for d in _distributions():
        pkg = _norm_name(d.metadata["Name"])
        for rel, text in _license_files(d):
            title = f"{pkg}/{rel}"
            named.append((title, text))
            licenses[title] = _license_of(d)
    if not named:
        raise CorpusError("the built-in corpus found no license files in any installed *.dist-info folder")
    return [_record("license", t, LICENSES, licenses[t], text) for t, text in _dedup(named)]


def _docstrings(tree: ast.Module) -> str:
    """The module docstring, then each class's and function's (nested in classes too) under its name."""
    pieces = []
    doc = ast.get_docstring(tree)
    if doc:
        pieces.append(doc)

    def walk(body, prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                qual = prefix + node.name
                doc = ast.get_docstring(node)
                if doc:
                    pieces.append(f"class {qual}\n\n{doc}")
                walk(node.body, qual + ".")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    pieces.append(f"{prefix}{node.name}({ast.unparse(node.args)})\n\n{doc}")

    walk(tree.body, "")
    return "\n\n".join(pieces)


def _package_dir(package: str) -> Path:
    # find_spec of a top-level name locates it without importing it (no torch import at build time).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise CorpusError(f"the built-in corpus reads docstrings of {package!r}, which is not installed")
    return Path(list(spec.submodule_search_locations)[0])


def docstring_records() -> list[dict]:
    """One document per module of ``DOCSTRING_MODULES``, modules in sorted order."""
    named, licenses = [], {}
    dists = {_norm_name(d.metadata["Name"]): d for d in _distributions()}
    for dist_name, subdirs in DOCSTRING_MODULES:
        root = _package_dir(dist_name)
        lic = _license_of(dists[dist_name]) if dist_name in dists else "unspecified"
        for sub in subdirs:
            for path in sorted((root / sub).glob("*.py")):
                parts = [dist_name, *Path(sub).parts, path.stem]
                module = ".".join(parts[:-1] if path.stem == "__init__" else parts)
                tree = ast.parse(path.read_bytes(), filename=str(path))
                named.append((module, _docstrings(tree)))
                licenses[module] = lic
    return [_record("docstring", m, DOCSTRINGS, licenses[m], text) for m, text in _dedup(named)]


def build_records() -> list[dict]:
    """The whole corpus, sources in ``SOURCES`` order."""
    return reference_records() + license_records() + docstring_records()


# ---- the cache -------------------------------------------------------------------------------------
def _write(records: list[dict], path: Path) -> None:
    """Write gzipped JSON lines atomically: a temp file beside ``path``, then os.replace.

    Concurrent builders each write their own temp file and the last rename wins; both hold the same
    bytes, and a reader never sees a half-written file.
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as raw:
            # mtime=0 and no file name in the header: the same records give the same bytes.
            with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
                for r in records:
                    gz.write((json.dumps(r, ensure_ascii=False) + "\n").encode("utf-8"))
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache holds nothing secret
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def ensure_built() -> Path:
    """The path of this environment's built corpus, building and caching it first if needed."""
    path = cache_path()
    if path.is_file():
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)  # before the build: fail fast where it cannot go
        _write(build_records(), path)
    except OSError as e:
        raise CorpusError(f"cannot write the built-in corpus to {path.parent} ({e}); set {CACHE_ENV} "
                          "to a writable folder") from e
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flexicache_hf.corpus", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rebuild", action="store_true", help="build again even if the cache file exists")
    args = ap.parse_args(argv)
    path = cache_path()
    t0 = time.perf_counter()
    if args.rebuild or not path.is_file():
        records = build_records()
        path.parent.mkdir(parents=True, exist_ok=True)
        _write(records, path)
        print(f"built in {time.perf_counter() - t0:.1f} s")
    else:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip()]
    print(path)
    for source in SOURCES:
        texts = [r["text"] for r in records if r["source"] == source]
        print(f"{len(texts):5d} documents {sum(map(len, texts)):9,d} characters  {source}")
    print(f"{len(records):5d} documents {sum(len(r['text']) for r in records):9,d} characters  in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
