"""run 25e: which calls synchronise with the device in a first cache's prefill (torch's sync debug mode)."""
import sys, traceback, warnings, collections
sys.path.insert(0, "tests")
import torch
from conftest import tiny_config, twin_models
from flexicache_hf import FlexiCache
from flexicache_hf.head_profile import HeadProfile

cfg = tiny_config("llama", heads=8, kv_heads=4, layers=4, head_dim=64, max_pos=8192)
fc, _ = twin_models(cfg)
fc = fc.cuda()
prof = HeadProfile.from_unstable(cfg, [(0, 1), (2, 3)])
kw = dict(max_new_tokens=2, min_new_tokens=2, do_sample=False, pad_token_id=0, disable_compile=True)
ids = torch.randint(2, 90, (1, 2048), generator=torch.Generator().manual_seed(0)).cuda()
fc.generate(ids, past_key_values=FlexiCache(prof), **kw)  # warm: kernels built, a first storage
torch.cuda.synchronize()
seen = collections.Counter()
def show(message, category, filename, lineno, file=None, line=None):
    stack = [f for f in traceback.extract_stack() if "flexicache_hf" in f.filename]
    seen[(str(message)[:60], tuple(f"{f.filename.split('flexicache_hf/')[-1]}:{f.lineno}" for f in stack[-3:]))] += 1
warnings.showwarning = show
warnings.simplefilter("always")
ids = torch.randint(2, 90, (2, 4096), generator=torch.Generator().manual_seed(1)).cuda()
cache = FlexiCache(prof)
torch.cuda.set_sync_debug_mode("warn")
fc.generate(ids, past_key_values=cache, **{**kw, "max_new_tokens": 1, "min_new_tokens": 1})
torch.cuda.set_sync_debug_mode(0)
print("synchronising calls in a first cache's prefill (4 layers):")
for (msg, where), n in seen.most_common(30):
    print(f"  {n:4d}  {' <- '.join(reversed(where))}   [{msg}]")
