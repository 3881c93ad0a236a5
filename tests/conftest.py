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


def padded_pair(length: int, pads: int):
    """A 2-layer tiny Llama twin pair (``twin_models``, Dynamo reset first) and a 2-row batch of ``length`` tokens
    whose second row is left-padded by ``pads``: ``(config, flexicache model, dense model, ids, mask)``."""
    torch._dynamo.reset()
    cfg = tiny_config("llama", heads=4, kv_heads=2, layers=2, head_dim=16)
    fc, dense = twin_models(cfg)
    ids = torch.randint(2, 90, (2, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :pads] = 0
    return cfg, fc, dense, ids, mask


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


def schedule_steps_agree(plan_step, begin_layer, device, capacity: int, overlap: bool, steps: int = 14) -> None:
    """``plan_step`` and ``begin_layer`` (a backend's) against the reference, from the same state, over ``steps``
    decode steps of three layers: every scalar equal after every step, in a run that starts pages, fills them,
    re-ranks on each layer's phase (step 0 with ``rerank_all``) and, with a ``capacity``, clamps the position and
    raises ``overflow`` past it (each of these seen at least once)."""
    from flexicache_hf.kernels import reference_schedule as RS

    def state():
        long = lambda v=0: torch.tensor([v], dtype=torch.long, device=device)  # noqa: E731
        flag = lambda v=False: torch.tensor([v], device=device)  # noqa: E731
        step = dict(length=long(5), step=long(0), current=long(), pos=long(), page=long(), offset=long(),
                    num_pages=long(), new_page=flag(), page_full=flag(), overflow=flag())
        return step, [dict(due=flag(), anchor=long(-1), late=flag(), since=long(7)) for _ in range(3)]

    mine, theirs = state(), state()
    origin, rerank_all = torch.tensor([2], device=device), torch.tensor([True], device=device)
    phases = [torch.tensor([p], device=device) for p in (0, 1, 3)]
    seen = set()
    for _ in range(steps):
        for (step, layers), plan, begin in ((mine, plan_step, begin_layer), (theirs, RS.plan_step, RS.begin_layer)):
            plan(*step.values(), origin, 4, capacity)
            for layer, phase in zip(layers, phases):
                begin(*layer.values(), step["current"], phase, rerank_all, step["page"], 4, overlap)
        for a, b in ((mine[0], theirs[0]), *zip(mine[1], theirs[1])):
            for name in a:
                assert torch.equal(a[name], b[name]), name
        seen |= {k for k in ("new_page", "page_full", "overflow") if bool(theirs[0][k])}
        seen |= {k for layer in theirs[1] for k in ("due", "late") if bool(layer[k])}
    want = {"new_page", "page_full", "due"} | ({"late"} if overlap else set())
    want |= {"overflow"} if capacity > 0 else set()
    assert seen >= want, seen
