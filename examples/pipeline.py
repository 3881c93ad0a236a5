"""A transformers text-generation pipeline where every call gets an empty FlexiCache.

    python examples/pipeline.py
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
