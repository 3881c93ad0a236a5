"""One FlexiCache reused across turns of a conversation (transformers' convention for cache reuse).

    .venv/bin/python examples/multi_turn.py
"""

from flexicache_hf import FlexiCache
from flexicache_hf.models import load_default_model

model, tok = load_default_model()
cache = FlexiCache("SmolLM2-135M-Instruct", token_budget=512, model_config=model.config)
chat = []
for question in ("Name three Python built-in container types.", "Which of them is immutable?"):
    chat.append({"role": "user", "content": question})
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=48, do_sample=False, past_key_values=cache)
    answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    chat.append({"role": "assistant", "content": answer})
    print(f"> {question}\n{answer}\n(cache holds {cache.get_seq_length()} tokens)")
