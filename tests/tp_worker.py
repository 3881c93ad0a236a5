"""One rank of tests/test_sharding.py's tensor-parallel run (``torchrun --nproc-per-node 2 tp_worker.py MODEL PROFILE OUT``).

Loads the saved tiny model with ``tp_plan="auto"`` (gloo on CPU), generates greedily with FlexiCache (the cache told
the tp size by ``model_config``, and not told: the world size then stands for it) and with DynamicCache, and writes
what this rank saw to ``OUT/rank{r}.json``.
"""

import json
import os
import sys
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore", category=FutureWarning)  # tp_plan= and past_key_values= deprecation notices

from flexicache_hf import FlexiCache, HeadProfile  # noqa: E402  (registers attn_implementation="flexicache")
from transformers import AutoModelForCausalLM, DynamicCache  # noqa: E402

FULL = dict(page_size=4, token_budget=512, rerank_interval=3)  # covers every page: exact attention


def main(model_dir: str, profile_path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto", attn_implementation="flexicache",
                                                 dtype=torch.float32).eval()
    rank = dist.get_rank()
    profile = HeadProfile.load(profile_path)
    ids = torch.tensor(json.loads(os.environ["TP_PROMPT"]))
    n = int(os.environ["TP_NEW_TOKENS"])

    def greedy(cache):
        with torch.no_grad():
            return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                  past_key_values=cache).tolist()

    told = FlexiCache(profile, model_config=model.config, **FULL)
    untold = FlexiCache(profile, **FULL)
    result = {
        "rank": rank,
        "tp_size": model._tp_size,
        "config_kv_heads": model.config.num_key_value_heads,
        "flexicache": greedy(told),
        "flexicache_untold": greedy(untold),
        "dynamic": greedy(DynamicCache()),
        "cache_tp_size": told.tp_size,
        "layers": [
            {"start": layer.shard.start, "count": layer.shard.count, "num_kv_heads": layer.storage.num_kv_heads,
             "full_heads": layer.storage.full_heads.tolist(), "slot_heads": layer.storage.slot_heads.tolist(),
             "reranker_unstable": list(layer.reranker.unstable_host)}
            for layer in told.layers
        ],
        "untold_starts": [layer.shard.start for layer in untold.layers],
        "stats_head_steps": told.stats.head_steps,
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
