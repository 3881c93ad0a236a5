"""``bench.tier_copy`` measures the tier-copy kernel on CUDA only: without a device it stops with a clear message."""

import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_the_tier_copy_bench_needs_cuda():
    from flexicache_hf.bench.tier_copy import main

    with pytest.raises(SystemExit, match="needs a CUDA device"):
        main(["--pages", "8"])
