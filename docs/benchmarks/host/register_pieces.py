"""Does page-locking in smaller registrations shorten a first cache's prefill? (CUDA; a probe, not a product path.)

Run 32d: after a dense row warmed the process, the README call's first cache took 1.29 s to its first token at
1 x 16k against 0.57 s for later caches, waiting only 2.5 ms for the background page-locking (0.67 s on the
populating threads) and building no kernel before its token. Hypothesis: each ``cuMemHostRegister`` holds the driver
while it page-locks, and the prefill's launches queue behind it. This runs ``bench.generate`` (its arguments after
``--``) with every pinned mapping registered in pieces of at most ``--piece-mib`` (``PinSettings.piece_bytes``:
the block keeper's and the reserved host ranges'), so launches can interleave with the registrations.

    python docs/benchmarks/host/register_pieces.py --piece-mib 64 -- --model llama8b --cases 1x16384 \
        --rows dynamic,flexicache-unsized --new-tokens 32 --tag run32e
"""
import argparse
import dataclasses
import functools

from flexicache_hf import block_keeper, host_memory, vmm
from flexicache_hf.bench.generate import main as generate_main


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--piece-mib", type=int, required=True, help="0: one registration a mapping (the default)")
    ap.add_argument("rest", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    if args.piece_mib:
        pieces = args.piece_mib << 20
        block_keeper.BLOCKS.settings = dataclasses.replace(block_keeper.BLOCKS.settings, piece_bytes=pieces)
        vmm.PinSettings = functools.partial(host_memory.PinSettings, piece_bytes=pieces)
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    generate_main(rest)


if __name__ == "__main__":
    main()
