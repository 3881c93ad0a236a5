"""One figure of a throughput table made one row a call (``run33.sh``): every JSON's results together, the rows
measured at their largest batch in the figure's third panel (whole-batch tokens a second).

    python docs/benchmarks/scripts/throughput_figure.py OUT.png A.json B.json ...
"""
import json
import sys
from pathlib import Path

from flexicache_hf.bench.generate.report import figure

out, *paths = sys.argv[1:]
runs = [json.loads(Path(p).read_text()) for p in paths]
figure([r for run in runs for r in run["results"]], Path(out), device=runs[0]["meta"]["device"])
