"""A transformers text-generation pipeline where every call gets an empty FlexiCache.

    .venv/bin/python examples/pipeline.py

These chats are short (76 tokens for the last call), shorter than the 512-token budget, so every page is attended
and FlexiCache saves nothing: its device copy holds every page plus the MinMax cache and room to grow, and the host
tier a second copy of the stable heads' pages.  Measured with this script on the CPU (transformers 5.25): the last
call's cache holds 1.64x DynamicCache's bytes on the device, 2.74x counting the host tier (the script prints
both).  FlexiCache saves memory once the context is several times the budget (``make demo``: 3,000 tokens at a
budget of 1024).
"""

from transformers import pipeline

from flexicache_hf import FlexiCacheConfig
from flexicache_hf.models import load_default_model
from flexicache_hf.pipeline import FlexiCachePipeline

model, tok = load_default_model()
pipe = pipeline("text-generation", model=model, tokenizer=tok, pipeline_class=FlexiCachePipeline,
                flexicache_profile="SmolLM2-135M-Instruct", flexicache_config=FlexiCacheConfig(token_budget=512))
chats = [[{"role": "user", "content": q}] for q in ("What is a Python generator?", "Explain the GPL in one line.")]
for result in pipe(chats, max_new_tokens=48, do_sample=False):
    print(result[0]["generated_text"][-1]["content"], "\n---")
print("last call's cache:", pipe.last_cache.memory_report())
