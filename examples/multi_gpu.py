"""FlexiCache on a model split across devices: nothing changes but how the model is loaded.

    .venv/bin/python examples/multi_gpu.py --split device_map                # accelerate: layers spread over GPUs
    .venv/bin/torchrun --nproc-per-node 2 examples/multi_gpu.py --split tp   # transformers tensor parallelism
    .venv/bin/python examples/multi_gpu.py --split device_map --model PATH --profile Llama-3.1-8B-Instruct --dtype bfloat16

``device_map="auto"``: one FlexiCache spans every device; each layer's pools, MinMax cache, host tier and copy
stream live on the device of that layer's key states (one step schedule per device, advanced by layer 0).
``tp_plan="auto"``: every rank builds its own FlexiCache over its block of KV heads; nothing of it crosses ranks.
Without ``--model`` a tiny random Llama is saved to a temporary folder, so both splits run anywhere (on CPU the
device map is one device and tensor parallelism uses gloo).  Greedy tokens are compared with DynamicCache + sdpa on
the same split; with the default budget (every page) they must be identical.  Rank 0 prints.
"""

import argparse
import os
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, LlamaConfig
from transformers.utils import logging

from flexicache_hf import FlexiCache, FlexiCacheConfig, HeadProfile  # registers attn_implementation="flexicache"

warnings.filterwarnings("ignore", category=FutureWarning)  # tp_plan= and past_key_values= deprecation notices
logging.disable_progress_bar()

ap = argparse.ArgumentParser()
ap.add_argument("--split", choices=["device_map", "tp"], required=True)
ap.add_argument("--model", default=None, help="local HF model folder (default: a tiny random Llama)")
ap.add_argument("--profile", default=None, help="profile name or JSON path (default: a random 25 %% profile)")
ap.add_argument("--dtype", default="float32")
ap.add_argument("--prompt-tokens", type=int, default=None, help="default: 48 (tiny model), 512 (--model)")
ap.add_argument("--new-tokens", type=int, default=24)
ap.add_argument("--budget", type=int, default=None, help="token budget (default: every page, exact attention)")
ap.add_argument("--graphs", action="store_true",
                help="let generate compile + CUDA-graph the decode step (not yet run across devices)")
args = ap.parse_args()

if args.model is None:  # every rank writes the same seeded weights to its own folder (nothing to share)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=16, max_position_embeddings=512,
                      pad_token_id=0, bos_token_id=1, eos_token_id=127, initializer_range=0.1)  # varied tokens
    folder = tempfile.TemporaryDirectory(prefix="flexicache-tiny-llama-")  # removed at exit
    path = folder.name
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
else:
    path = args.model

# The only difference between the two splits and a single device: how the model is loaded.
split = dict(device_map="auto") if args.split == "device_map" else dict(tp_plan="auto")
model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype), attn_implementation="flexicache",
                                             local_files_only=True, **split).eval()
rank = dist.get_rank() if dist.is_initialized() else 0
world = dist.get_world_size() if dist.is_initialized() else 1
say = print if rank == 0 else (lambda *a, **k: None)

if args.model is None:
    torch.manual_seed(1)
    ids, tok = torch.randint(2, 127, (1, args.prompt_tokens or 48)), None
else:
    from flexicache_hf.data import build_prompt, load_documents

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    doc = max(load_documents(), key=lambda d: (len(d.text), d.id))  # the built-in corpus (same on every rank)
    ids = build_prompt(tok, doc, "What are the key points of this document?", args.prompt_tokens or 512)
ids = ids.to(model.device)  # the embeddings' device (device_map) or this rank's
n, total = args.new_tokens, ids.shape[1] + args.new_tokens
profile = HeadProfile.random(model.config) if args.profile is None else args.profile
page = FlexiCacheConfig().page_size
config = FlexiCacheConfig(token_budget=args.budget or -(-total // page) * page)

if args.split == "device_map":
    where = getattr(model, "hf_device_map", {"": str(model.device)})
    say(f"device_map: {len(set(map(str, where.values())))} device(s): "
        + ", ".join(f"{k or 'model'} -> {v}" for k, v in where.items()))
else:
    say(f"tensor parallelism: {world} ranks (backend {dist.get_backend()}), each holds "
        f"{model.config.num_key_value_heads // world} of {model.config.num_key_value_heads} KV heads per layer")


def greedy(cache):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, past_key_values=cache, disable_compile=not args.graphs)[0, ids.shape[1]:]


cache = FlexiCache(profile, config, model_config=model.config, max_cache_len=total)
ours = greedy(cache)
model.set_attn_implementation("sdpa")  # the reference: transformers' own cache and attention, same split
theirs = greedy(DynamicCache())
same = torch.equal(ours.cpu(), theirs.cpu())

# What each device holds: the layers there, their device bytes (pages, tables, MinMax) and host tier.
report = cache.memory_report()  # first: after graph replays it brings the layers' lengths up to date
per_device = {}
for layer in cache.layers:
    row = per_device.setdefault(f"rank {rank} {layer.storage.device}", [0, 0, 0, 0])
    for i, b in enumerate((1, layer.device_bytes(), layer.host_bytes(), layer.dense_bytes())):
        row[i] += b
rows, verdicts = [per_device], [same]
if world > 1:  # rank 0 prints every rank's (each holds other heads)
    rows, verdicts = [None] * world, [None] * world
    dist.all_gather_object(rows, per_device)
    dist.all_gather_object(verdicts, same)

say(f"{cache!r}, budget {config.token_budget} tokens, {ids.shape[1]} prompt + {n} new tokens")
say("FlexiCache tokens:  ", ours.tolist() if tok is None else repr(tok.decode(ours, skip_special_tokens=True)))
say("DynamicCache tokens:", theirs.tolist() if tok is None else repr(tok.decode(theirs, skip_special_tokens=True)))
verdict = "identical" if all(verdicts) else "DIFFERENT"
say(f"greedy tokens vs DynamicCache + sdpa ({args.split}, {world} process(es)): {verdict}"
    + ("" if all(verdicts) or world == 1 else f" (ranks agreeing: {[r for r, v in enumerate(verdicts) if v]})"))
mib = 2.0 ** 20
for by_device in rows:
    for name, (layers, dev, host, dense) in by_device.items():
        say(f"  {name}: {layers} layers, device {dev / mib:.3f} MiB, host tier {host / mib:.3f} MiB "
            f"(DynamicCache: {dense / mib:.3f} MiB)")
say("memory_report (this process):", report)
if dist.is_initialized():
    dist.barrier()  # every rank done with the collectives before any tears its group down
    dist.destroy_process_group()
    # Everything is printed and the group is down: leave without the interpreter's teardown. On CPU with gloo a
    # rank now and then aborted there ("terminate called without an active exception", once in CI, after the
    # run had succeeded), and torchrun then reports the whole run failed.
    if args.model is None:
        folder.cleanup()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
