"""python docs/benchmarks/estimators/report.py results_*.json  -> markdown table of mass recall."""
import json, sys
rec, mem = {}, {}
for f in sys.argv[1:]:
    d = json.load(open(f)); rec.update(d["recall"]); mem.update(d["mem"])
cols = []
for k in rec:
    m, b, S, n, c = k.split("|")
    if (m, b, S) not in cols: cols.append((m, b, S))
cols.sort(key=lambda x: (x[0], x[2], x[1] != "1/16"))
names = []
for k in rec:
    n, c = k.split("|")[3:]
    if (n, c) not in names: names.append((n, c))
short = {"smollm2-135m": "Smol", "qwen2.5-coder-0.5b": "Qwen"}
hdr = "| estimator | combine | mem/page [D] | " + " | ".join(f"{short.get(m,m)} B={b} S={S}" for m, b, S in cols) + " | mean |"
print(hdr); print("|" + "---|" * (hdr.count("|") - 1))
def row(n, c):
    v = [rec.get(f"{m}|{b}|{S}|{n}|{c}") for m, b, S in cols]
    return v
order = sorted(names, key=lambda nc: -sum(x for x in row(*nc) if x is not None))
for n, c in order:
    v = row(n, c)
    mm = mem.get(n); ms = "-" if n == "ORACLE" else ("all keys (S)" if mm is None else f"{mm:.2f}")
    print(f"| {n} | {c} | {ms} | " + " | ".join("" if x is None else f"{x:.3f}" for x in v) + f" | {sum(v)/len(v):.3f} |")
