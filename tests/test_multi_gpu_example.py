"""examples/multi_gpu.py on CPU, both splits: accelerate's device_map (one device here) and transformers' tensor
parallelism over 2 gloo ranks; the example must report FlexiCache's greedy tokens identical to DynamicCache + sdpa."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "multi_gpu.py"
VERDICT = re.compile(r"^greedy tokens vs DynamicCache \+ sdpa \((\w+), (\d+) process\(es\)\): (identical|DIFFERENT)",
                     re.M)
MEMORY = re.compile(r"^  rank (\d+) (\S+): (\d+) layers, device [\d.]+ MiB, host tier [\d.]+ MiB", re.M)


def run_example(*args: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=150, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return done.stdout


def verdict(out: str) -> tuple[str, int, str]:
    found = VERDICT.findall(out)
    assert len(found) == 1, f"expected one verdict line, got {found}:\n{out}"
    split, procs, word = found[0]
    return split, int(procs), word


def test_device_map_split_gives_dynamic_cache_tokens():
    pytest.importorskip("accelerate", reason="device_map='auto' needs accelerate")
    out = run_example(str(EXAMPLE), "--split", "device_map")
    assert verdict(out) == ("device_map", 1, "identical"), out
    assert "device_map: 1 device(s): model -> cpu" in out, out
    assert MEMORY.findall(out) == [("0", "cpu", "4")], out


def test_device_map_split_reports_a_difference_when_the_budget_drops_pages():
    # the comparison is not vacuous: 2 of the 5 pages attended changes the tiny model's greedy tokens
    pytest.importorskip("accelerate", reason="device_map='auto' needs accelerate")
    out = run_example(str(EXAMPLE), "--split", "device_map", "--budget", "32")
    assert verdict(out) == ("device_map", 1, "DIFFERENT"), out


@pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                    reason="tensor parallelism on CPU needs torch.distributed with the gloo backend")
def test_tp_split_two_ranks_gives_dynamic_cache_tokens():
    out = run_example("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(EXAMPLE),
                      "--split", "tp")
    assert verdict(out) == ("tp", 2, "identical"), out  # every rank's tokens equal its DynamicCache's
    assert "tensor parallelism: 2 ranks (backend gloo), each holds 2 of 4 KV heads per layer" in out, out
    assert MEMORY.findall(out) == [("0", "cpu", "4"), ("1", "cpu", "4")], out  # rank 0 prints both ranks' caches
