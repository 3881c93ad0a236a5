"""One long prompt prefilled once, then deep-copied for each question (transformers' prefix-reuse pattern).

    .venv/bin/python examples/prefix_reuse.py            # the embedded SmolLM2 on the CPU

The shared prefix (a document) goes through the model once into a FlexiCache; every question then starts
from ``copy.deepcopy`` of that cache, so only the question's tokens are prefilled and the answers never see
each other.  The copy is independent: pages, host tier and selection state are duplicated, the head profile
and observer are shared.
"""

import copy
import time

import torch

from flexicache_hf import FlexiCache
from flexicache_hf.data import load_documents, token_ids
from flexicache_hf.hf_compat import forward_cache_kwarg, generate_cache_kwarg
from flexicache_hf.models import load_default_model

model, tok = load_default_model()
doc = load_documents()[0]
doc_text = tok.decode(token_ids(tok(doc.text, add_special_tokens=False))[:800])

# The chat template around a placeholder question: everything before it is the shared prefix.
MARK = "<<QUESTION>>"
chat = tok.apply_chat_template([{"role": "user", "content": f"{doc_text}\n\n{MARK}"}], add_generation_prompt=True,
                               tokenize=False)
head, tail = chat.split(MARK)
prefix = torch.tensor([token_ids(tok(head, add_special_tokens=False))])

prompt_cache = FlexiCache("SmolLM2-135M-Instruct", token_budget=512, model_config=model.config)
t0 = time.perf_counter()
with torch.no_grad():  # fill the cache with the prefix only
    model(prefix, **{forward_cache_kwarg(model): prompt_cache})
print(f"prefix: {prefix.shape[1]} tokens prefilled once in {time.perf_counter() - t0:.1f} s")

for question in ("What is this document about?", "Name one thing it says you should avoid.",
                 "Who is this document written for?"):
    suffix = torch.tensor([token_ids(tok(question + tail, add_special_tokens=False))])
    ids = torch.cat([prefix, suffix], 1)
    cache = copy.deepcopy(prompt_cache)  # the prefix's pages, independent of the other questions
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), **{generate_cache_kwarg(): cache}, max_new_tokens=32,
                         do_sample=False)
    answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    print(f"\n> {question}  ({suffix.shape[1]} new prompt tokens, {time.perf_counter() - t0:.1f} s)\n{answer}")

print(f"\nthe prompt cache still holds its {prompt_cache.get_seq_length()} prefix tokens")
