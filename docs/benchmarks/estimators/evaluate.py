"""Mass recall of page-score estimators on captured keys/queries.

python docs/benchmarks/estimators/evaluate.py OUT.json FILE.pt [FILE.pt ...]
For every file, layer, KV head and captured decode query position t (the last NQ of the document):
candidate pages are the pages of keys 0..t; the page holding t is always selected; K = budget // S pages.
Budgets = T/16 and T/8 of the document length T; page sizes 8 and 16.
Recall = mean over the group's query heads of the exact attention mass (softmax over keys 0..t, per query
head) on the selected pages; averaged over positions, KV heads, layers, files.
"""
import json, sys, time
import torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
import estimators as E

torch.set_num_threads(int(__import__("os").environ.get("NT", 2)))
out_path, files = sys.argv[1], sys.argv[2:]
PAGE_SIZES = (8, 16)
COMBINES = ("mass", "max")


def combine(score, how):  # score [G, NQ, P] -> [NQ, P]
    if how == "max":
        return score.amax(0)
    top = score.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    e = torch.exp(score - top)
    return (e / e.sum(-1, keepdim=True).clamp_min(1e-38)).sum(0)


def recall_of(agg, mass, pt, K):
    """agg [NQ, P] combined score (pages > pt(j) already -inf), mass [G, NQ, P]; returns recall per query [NQ]."""
    NQ, P = agg.shape
    s = agg.clone()
    s[torch.arange(NQ), pt] = float("inf")
    s = torch.nan_to_num(s, nan=float("-inf"))
    val, idx = s.topk(K, dim=-1)
    sel = torch.zeros_like(agg, dtype=torch.bool).scatter_(1, idx, val > float("-inf"))
    return (mass * sel[None]).sum(-1).mean(0)  # [NQ]


reg = getattr(E, __import__("os").environ.get("REG", "registry2"))()
acc = {}  # (model, budget_frac, S, est, combine) -> [sum, count]
t_start = time.time()
per_file = {}
for f in files:
    acc_before = {k: list(v) for k, v in acc.items()}
    d = torch.load(f)
    model, scale = d["model"], d["scaling"]
    keys, queries = d["keys"], d["queries"]
    L = len(keys)
    H, T, D = keys[0].shape
    Hq, NQ, _ = queries[0].shape
    G = Hq // H
    tq = torch.arange(T - NQ, T)
    budgets = {"1/16": T // 16, "1/8": T // 8}
    for l in range(int(__import__("os").environ.get("MAXL", L))):
        for h in range(H):
            K_ = keys[l][h].float()  # [T, D]
            q = queries[l][h * G:(h + 1) * G].float()  # [G, NQ, D]
            lg = torch.einsum("gqd,td->gqt", q, K_) * scale
            causal = torch.arange(T)[None, :] <= tq[:, None]  # [NQ, T]
            probs = torch.softmax(lg.masked_fill(~causal[None], float("-inf")), -1)  # [G, NQ, T]
            for S in PAGE_SIZES:
                P = T // S
                assert P * S == T
                mass = probs.view(G, NQ, P, S).sum(-1)  # [G, NQ, P]; page pt holds the partial page's mass
                pt = tq // S
                X = K_.view(P, S, D)
                mfull = torch.ones(P, S, dtype=torch.bool)
                Xp = X[pt]  # [NQ, S, D] partial pages
                mp = torch.arange(S)[None, :] <= (tq % S)[:, None]
                pidx = torch.arange(P)[None, :]
                valid = pidx <= pt[:, None]  # [NQ, P]
                ests = dict(reg)
                for name, (fn, mem) in ests.items():
                    sc_full = fn(q, X, mfull, scale)  # [G, NQ, P]
                    sc_part = fn(q, Xp, mp, scale)  # [G, NQ, NQ]
                    sc = sc_full.clone()
                    sc[:, torch.arange(NQ), pt] = sc_part[:, torch.arange(NQ), torch.arange(NQ)]
                    sc = sc.masked_fill(~valid[None], float("-inf"))
                    for how in COMBINES:
                        agg = combine(sc, how)
                        for bname, B in budgets.items():
                            r = recall_of(agg, mass, pt, B // S)
                            key = f"{model}|{bname}|{S}|{name}|{how}"
                            a = acc.setdefault(key, [0.0, 0])
                            a[0] += float(r.sum()); a[1] += NQ
                # the oracle: rank by the exact group mass
                for bname, B in budgets.items():
                    r = recall_of(mass.sum(0).masked_fill(~valid, float("-inf")), mass, pt, B // S)
                    key = f"{model}|{bname}|{S}|ORACLE|mass"
                    a = acc.setdefault(key, [0.0, 0]); a[0] += float(r.sum()); a[1] += NQ
        print(f, "layer", l, "done", round(time.time() - t_start, 1), flush=True)
    per_file[f] = {k: (v[0] - acc_before.get(k, [0, 0])[0]) / (v[1] - acc_before.get(k, [0, 0])[1]) for k, v in acc.items()}
    res = {k: v[0] / v[1] for k, v in acc.items()}
    json.dump({"recall": res, "mem": {n: m for n, (_, m) in reg.items()}, "files": files, "per_file": per_file}, open(out_path, "w"), indent=1)
print("wrote", out_path)
