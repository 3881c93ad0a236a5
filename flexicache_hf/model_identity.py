"""The model shape a head profile belongs to (:class:`ModelIdentity`), and the error every profile check raises.

A profile is tied to a model's attention shape (layers, KV heads, head dim, query heads) and checked against the
model before use; :mod:`flexicache_hf.head_profile` builds on this.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any


class ProfileError(ValueError):
    """A head profile, or the input used to build or find one, is invalid."""


def _is_int(x: Any) -> bool:
    # bool is an int subclass; True as a layer index is always a bug.
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _architecture_for(model_type: str) -> str:
    # GGUF-loaded configs carry no `architectures`; ask transformers' own table
    # before guessing, so the name matches what a hub config would report.
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    except ImportError:
        name = None
    if name:
        return name
    return "".join(p[:1].upper() + p[1:] for p in re.split(r"[_\-]", model_type)) + "ForCausalLM"


@dataclass(frozen=True)
class ModelIdentity:
    """The attention shape a profile was measured on.

    Only the shape (``same_shape``) decides compatibility; ``architecture`` and
    ``name`` are informative, because the same weights may be loaded through
    different classes (a GGUF SmolLM2 reports ``LlamaForCausalLM``).
    ``max_positions`` (``max_position_embeddings`` in the file, optional) is the
    context the profiled model was made for: an unsized cache reserves its storage
    for it from its first forward, before it sees the model's config
    (:mod:`flexicache_hf.reserve`); the config's own value rules once seen.
    """

    architecture: str
    model_type: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    name: str | None = None
    max_positions: int | None = None

    def __post_init__(self) -> None:
        for key in ("architecture", "model_type"):
            if not isinstance(getattr(self, key), str):
                raise ProfileError(f"model.{key} must be a string, found {getattr(self, key)!r}")
        for key in ("num_layers", "num_attention_heads", "num_kv_heads", "head_dim"):
            v = getattr(self, key)
            if not _is_int(v) or v <= 0:
                raise ProfileError(f"model.{key} must be a positive integer, found {v!r}")
        if self.num_attention_heads % self.num_kv_heads:
            raise ProfileError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads}); check the model config"
            )
        if self.name is not None and not isinstance(self.name, str):
            raise ProfileError(f"model.name must be a string or null, found {self.name!r}")
        if self.max_positions is not None and (not _is_int(self.max_positions) or self.max_positions <= 0):
            raise ProfileError(f"model.max_position_embeddings must be a positive integer or absent, found "
                               f"{self.max_positions!r}")

    @classmethod
    def from_config(cls, config: Any) -> ModelIdentity:
        """Read the shape from a transformers ``PretrainedConfig`` (or a model)."""
        config = getattr(config, "config", config)  # accept a model too
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        model_type = getattr(text, "model_type", None) or getattr(config, "model_type", None)
        layers = getattr(text, "num_hidden_layers", None)
        heads = getattr(text, "num_attention_heads", None)
        if not model_type or layers is None or heads is None:
            raise ProfileError(
                "expected a transformers decoder config with model_type, num_hidden_layers and "
                f"num_attention_heads, found {type(config).__name__}; pass model.config"
            )
        kv = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None)
        if not head_dim:
            hidden = getattr(text, "hidden_size", None)
            if hidden is None:
                raise ProfileError(f"{type(config).__name__} has neither head_dim nor hidden_size")
            head_dim = hidden // heads
        archs = getattr(config, "architectures", None)
        arch = archs[0] if archs else _architecture_for(model_type)
        name = getattr(config, "name_or_path", None)
        if name is None:
            name = getattr(config, "_name_or_path", None)
        context = getattr(text, "max_position_embeddings", None)
        return cls(arch, model_type, layers, heads, kv, head_dim, None if name is None else str(name),
                   context if _is_int(context) and context > 0 else None)

    def same_shape(self, other: ModelIdentity) -> bool:
        return self._shape() == other._shape()

    def _shape(self) -> tuple:
        return (self.model_type, self.num_layers, self.num_attention_heads, self.num_kv_heads, self.head_dim)

    def describe(self) -> str:
        who = f"{self.name} " if self.name else ""
        return (
            f"{who}({self.model_type}: {self.num_layers} layers, {self.num_attention_heads} attention "
            f"heads, {self.num_kv_heads} KV heads, head_dim {self.head_dim})"
        )

    def to_dict(self) -> dict:
        return {
            "architecture": self.architecture,
            "model_type": self.model_type,
            "num_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "name": self.name,
            **({} if self.max_positions is None else {"max_position_embeddings": self.max_positions}),
        }

    @classmethod
    def from_dict(cls, d: Any) -> ModelIdentity:
        if not isinstance(d, dict):
            raise ProfileError(f"'model' must be a JSON object, found {type(d).__name__}")
        required = ("architecture", "model_type", "num_layers", "num_attention_heads", "num_kv_heads", "head_dim")
        missing = [k for k in required if k not in d]
        if missing:
            raise ProfileError(f"'model' is missing keys {missing}; expected {list(required) + ['name']}")
        optional = ("name", "max_position_embeddings")
        extra = sorted(set(d) - set(required) - set(optional))
        if extra:
            raise ProfileError(f"'model' has unexpected keys {extra}; expected {list(required) + list(optional)}")
        return cls(**{k: d[k] for k in required}, name=d.get("name"), max_positions=d.get("max_position_embeddings"))


def _identity(model: Any) -> ModelIdentity:
    return model if isinstance(model, ModelIdentity) else ModelIdentity.from_config(model)
