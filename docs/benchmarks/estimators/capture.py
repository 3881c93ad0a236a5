"""Capture post-RoPE keys (as cached) and the last NQ positions' post-RoPE queries of every layer.

python docs/benchmarks/estimators/capture.py MODEL NTOK NQ DOC [DOC ...]
Writes cache/{MODEL}_{NTOK}_doc{DOC}.pt : {"keys": [L][H,T,D], "queries": [L][Hq,NQ,D],
"scaling": float, "ids": [T]}
"""
import sys, time, torch
from pathlib import Path
from transformers import DynamicCache
from flexicache_hf.models import load_model
from flexicache_hf.data import long_prompt
from flexicache_hf.eval.query_capture import _queries

CACHE = Path(__file__).resolve().parent / "cache"  # git-ignored: ~0.5 GB for the study
CACHE.mkdir(exist_ok=True)
torch.manual_seed(0)
name, ntok, nq = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
docs = [int(x) for x in sys.argv[4:]]
t0 = time.time()
model, tok = load_model(name, dtype=torch.float32, attn_implementation="sdpa")
print("loaded", time.time() - t0, flush=True)
attn = [m for m in model.modules() if hasattr(m, "q_proj") and hasattr(m, "layer_idx")]
store = {}

def hook(module, args, kwargs):
    hidden = args[0] if args else kwargs["hidden_states"]
    q = _queries(module, hidden, kwargs["position_embeddings"])
    store[module.layer_idx] = (q[0, :, -nq:].detach().clone(), float(module.scaling))
    return None

hs = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in attn]
for d in docs:
    ids = long_prompt(tok, ntok, doc_index=d)
    cache = DynamicCache()
    t0 = time.time()
    with torch.inference_mode():
        model.model(input_ids=ids, past_key_values=cache, use_cache=True)
    L = len(attn)
    keys = [cache.layers[i].keys[0].float().clone() for i in range(L)]
    queries = [store[i][0] for i in range(L)]
    out = {"keys": keys, "queries": queries, "scaling": store[0][1], "ids": ids[0],
           "model": name, "doc": d}
    torch.save(out, CACHE / f"{name}_{ntok}_doc{d}.pt")
    print("doc", d, "T", ids.shape[1], "L", L, "keys", tuple(keys[0].shape), "q", tuple(queries[0].shape),
          "scale", store[0][1], "time", round(time.time() - t0, 1), flush=True)
    store.clear()
