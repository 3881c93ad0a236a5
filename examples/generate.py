"""Generate with FlexiCache on a model you already load with transformers.

    .venv/bin/python examples/generate.py                      # the embedded SmolLM2 (CPU is fine)
    .venv/bin/python examples/generate.py --model PATH --profile Llama-3.1-8B-Instruct --device cuda --dtype bfloat16

The cache is sized for the prompt + the new tokens (``max_cache_len``, as for StaticCache), so on CUDA
``generate`` compiles and CUDA-graphs its decode step (the first call of a process spends a while compiling);
``--eager`` keeps every step eager.  ``--prefill-chunk N`` fills a long prompt N tokens a forward first
(``prefill_in_chunks``: bounded activations, and the decode still compiles).
"""

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from flexicache_hf import FlexiCache, prefill_in_chunks  # the import registers attn_implementation="flexicache"
from flexicache_hf.data import build_prompt, load_documents
from flexicache_hf.models import load_default_model

ap = argparse.ArgumentParser()
ap.add_argument("--model", default=None, help="local HF model folder (default: embedded SmolLM2)")
ap.add_argument("--profile", default="SmolLM2-135M-Instruct", help="profile name or JSON path")
ap.add_argument("--device", default="cpu")
ap.add_argument("--dtype", default="float32")
ap.add_argument("--budget", type=int, default=1024)
ap.add_argument("--new-tokens", type=int, default=96)
ap.add_argument("--eager", action="store_true", help="do not let generate compile the decode step")
ap.add_argument("--prefill-chunk", type=int, default=0, help="fill the prompt this many tokens a forward first")
args = ap.parse_args()

dtype = getattr(torch, args.dtype)
if args.model is None:
    model, tok = load_default_model(dtype=dtype, device=args.device)
else:
    tok = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation="flexicache",
                                                 local_files_only=True).to(args.device).eval()

# The built-in corpus (assembled from this installation on first use); load_documents(path) reads your own.
doc = max(load_documents(), key=lambda d: (len(d.text), d.id))  # long enough for the 2500-token prompt
ids = build_prompt(tok, doc, "What are the key points of this document?", 2500).to(args.device)
cache = FlexiCache(args.profile, token_budget=args.budget, model_config=model.config,  # the profile's settings
                   max_cache_len=ids.shape[1] + args.new_tokens)
if args.prefill_chunk:
    prefill_in_chunks(model, ids, cache, args.prefill_chunk)  # all but the last token; generate does the rest
out = model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False, past_key_values=cache,
                     disable_compile=args.eager)
print(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
print(cache.memory_report())
