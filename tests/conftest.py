import copy
import warnings

import pytest
import torch

import flexicache_hf  # noqa: F401  (registers attn_implementation="flexicache")

# transformers >= 5.2x renames generate's `past_key_values` to `cache`; the old name still works everywhere
# we support (>= 5.17), so the deprecation notice is noise in tests.
warnings.filterwarnings("ignore", message=".*past_key_values.*is deprecated.*", category=FutureWarning)


def tiny_config(kind: str, *, heads: int, kv_heads: int, layers: int = 2, head_dim: int = 16, max_pos: int = 1024):
    """A tiny random decoder config of the given family (full attention)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(vocab_size=97, hidden_size=heads * head_dim, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_pos,
                  head_dim=head_dim, pad_token_id=0, eos_token_id=96, bos_token_id=1)
    if kind == "llama":
        return LlamaConfig(**common)
    if kind == "mistral":
        return MistralConfig(**common, sliding_window=None)
    if kind == "qwen2":
        return Qwen2Config(**common, use_sliding_window=False)
    raise ValueError(kind)


def twin_models(config, seed: int = 0):
    """The same random weights loaded twice: with 'flexicache' and with 'sdpa' attention (fp32, eval)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    fc = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="flexicache").eval()
    dense = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa").eval()
    dense.load_state_dict(fc.state_dict())
    return fc, dense


def compile_config():
    """generate's compile of the decode step on the CPU: Dynamo + AOT autograd with the ``aot_eager`` backend (no
    code generation), the whole forward in one graph (``fullgraph=True``)."""
    from transformers import CompileConfig

    cc = CompileConfig(backend="aot_eager", fullgraph=True, mode=None)
    cc._compile_all_devices = True  # generate compiles on CUDA only unless told
    return cc


@pytest.fixture(scope="session", autouse=True)
def corpus_cache_dir(tmp_path_factory):
    """The built-in corpus is cached in a folder of this session: tests never write to the user's home,
    and the corpus is built once per session (the first test that needs it), then read from there.

    Subprocesses that tests start inherit the variable, so they read the same file.
    """
    from flexicache_hf.corpus import CACHE_ENV

    path = tmp_path_factory.mktemp("corpus-cache")
    mp = pytest.MonkeyPatch()
    mp.setenv(CACHE_ENV, str(path))
    yield path
    mp.undo()


def copied(cache, how: str):
    """``cache`` copied by ``copy.deepcopy`` ("deepcopy"), a ``pickle`` round trip ("pickle") or ``torch.save`` /
    ``torch.load`` ("torch.save")."""
    import io
    import pickle

    if how == "deepcopy":
        return copy.deepcopy(cache)
    if how == "pickle":
        return pickle.loads(pickle.dumps(cache))
    buf = io.BytesIO()
    torch.save(cache, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)  # a cache is an object graph, not a state dict


def word_tokenizer():
    """A left-padding tokenizer whose words "w0".."w96" are token ids 0..96 (for pipelines on tiny models)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({f"w{i}": i for i in range(97)}, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="w0", eos_token="w96", padding_side="left")


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2-135M-Instruct (loaded once per test session; ~30 s on 2 cores)."""
    from flexicache_hf.models import load_default_model

    model, tok = load_default_model(attn_implementation="flexicache")
    return model, tok


def top_k_lowest_ids(s, k, n):
    """The select kernels' contract spelled out (the interpreted and the GPU tests): rows cut to their ``n`` live pages,
    the newest forced, the ``k`` best scores with ties to the lowest page ids (a stable sort), ``-inf`` never
    returned, ascending, ``-1`` padded."""
    s = s[:, :, :n].clone()
    s[:, :, n - 1] = float("inf")
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices[:, :, :k]
    pages = torch.where(s.gather(-1, order) > float("-inf"), order, n).sort(-1).values
    pages = torch.where(pages == n, -1, pages)
    return torch.cat([pages, pages.new_full((*pages.shape[:2], k - pages.shape[-1]), -1)], -1)


def live_part(x: torch.Tensor, num_pages, active: torch.Tensor | None = None) -> torch.Tensor:
    """``x [B, h, ..., P]`` (a per-page output of ``page_scores``, ``page_lse`` or ``group_mass``) with what a backend
    may leave unwritten (the live part, ``flexicache_hf.kernels.reference``: pages at or past ``num_pages``, the rows
    of heads not ``active``) set to -inf, as the reference stores it."""
    n = int(num_pages.reshape(-1)[0]) if isinstance(num_pages, torch.Tensor) else num_pages
    keep = torch.arange(x.shape[-1], device=x.device) < n
    if active is not None:
        keep = keep & active.to(x.device).view(1, -1, *[1] * (x.dim() - 2))
    return torch.where(keep, x, float("-inf"))
