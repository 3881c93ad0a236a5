"""``python -m flexicache_hf.profile`` / ``flexicache-profile``: measure a model's head-stability profile.

The offline step of FlexiCache (paper §2): decode long prompts of several tasks densely, record each KV
head's per-step top-K pages, and write the profile JSON (the heads most often among the least stable)
plus figures and a metrics JSON.  Example::

    python -m flexicache_hf.profile --model smollm2 --out profiles/SmolLM2-135M-Instruct.json \\
        --figures docs/profiles --oracle

The defaults (the profiler's own, see ``profile_model``) are sized for SmolLM2-135M on a small CPU: about
four tasks x two samples x 3k-token prompts x 256 decode steps.  For 8B-class models on a GPU use longer
prompts and a larger K, as the paper does (e.g. ``--prompt-tokens 16384 --k-pages 64 --samples 8``).
"""

from __future__ import annotations

import argparse
import inspect
import sys
import time
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    from .models import HUB_NAMES
    from .stability.profiler import profile_model
    from .stability.tasks import default_tasks

    # Defaults come from profile_model's signature so the CLI and the Python API cannot drift apart.
    d = {k: p.default for k, p in inspect.signature(profile_model).parameters.items()}
    tasks = [t.name for t in default_tasks()]
    p = argparse.ArgumentParser(
        prog="flexicache-profile",
        description="Profile the temporal stability of a model's KV heads and write a FlexiCache head profile.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default="smollm2",
                   help="a local HF model directory or cached hub name (loaded with local_files_only=True), "
                        "'smollm2'/'default' for the embedded SmolLM2-135M-Instruct GGUF, or a name "
                        f"flexicache_hf.models loads ({', '.join(HUB_NAMES)})")
    p.add_argument("--gguf", default=None,
                   help="GGUF file: with a model name (smollm2, qwen2.5-coder-0.5b) the file to load instead of "
                        "the installed one; with a model directory, the GGUF file inside it")
    p.add_argument("--out", default=None, type=Path,
                   help="profile JSON to write; None: profiles/<model name>.json")
    p.add_argument("--figures", default=None, type=Path,
                   help="folder for the figures and the metrics JSON; None: write none")
    p.add_argument("--tasks", nargs="+", default=tasks, choices=tasks, metavar="TASK",
                   help=f"profiling tasks, from {tasks}")
    p.add_argument("--corpus", default=None, type=Path,
                   help="gzipped JSON-lines corpus of your own, with the built-in corpus's source labels "
                        "(the tasks pick documents by source); None: the built-in corpus, assembled from "
                        "this installation (python -m flexicache_hf.corpus)")
    p.add_argument("--samples", type=int, default=d["samples_per_task"], help="documents per task")
    p.add_argument("--prompt-tokens", type=int, default=d["prompt_tokens"], help="maximum prompt length")
    p.add_argument("--new-tokens", type=int, default=d["new_tokens"], help="decode steps recorded per sample")
    p.add_argument("--k-pages", type=int, default=d["k_pages"],
                   help="profiling top-K in pages (choose K/N ~ 0.1-0.25 of the context's pages)")
    p.add_argument("--page-size", type=int, default=d["page_size"], help="tokens per page")
    p.add_argument("--window", type=int, default=d["window"], help="W: decode steps per stability window")
    p.add_argument("--fraction", type=float, default=d["fraction"], help="share of KV heads marked unstable")
    p.add_argument("--oracle", action="store_true",
                   help="also classify from the true attention mass per page (slower) and compare")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="weights dtype; None: float32 on CPU, bfloat16 elsewhere")
    p.add_argument("--name", default=None, help="model name recorded in the profile")
    p.add_argument("--records", default=None, type=Path,
                   help="also save every sample's per-step selections (.npz) in this folder")
    p.add_argument("--figure-layer", type=int, default=None,
                   help="layer of the RCO-vs-offset figure; None: the layer whose heads differ most")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads; None: 1 on CPU (decode steps are many tiny ops, where OpenMP "
                        "synchronisation costs more than it gains: measured ~10x faster on a busy 2-core "
                        "machine), torch's choice elsewhere; 0 = torch's choice")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _load(args):
    """(model, tokenizer, model name, weights description) for --model / --gguf."""
    import torch

    import flexicache_hf  # noqa: F401  registers attn_implementation="flexicache"

    dtype = getattr(torch, args.dtype) if args.dtype else (torch.float32 if args.device == "cpu" else torch.bfloat16)
    key = _named_model(args.model)
    if key is not None:
        from .models import HUB_NAMES, load_model, model_gguf_path

        path = model_gguf_path(key, args.gguf)
        model, tok = load_model(key, gguf_path=path, dtype=dtype, device=args.device)
        return model, tok, HUB_NAMES[key], f"GGUF {path.name} (de-quantised to {args.dtype or str(dtype)[6:]})"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    extra = {"gguf_file": args.gguf} if args.gguf else {}
    tok = AutoTokenizer.from_pretrained(args.model, local_files_only=True, **extra)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation="flexicache",
                                                 local_files_only=True, **extra)
    name = getattr(model.config, "name_or_path", None) or args.model
    weights = f"{args.model}" + (f" GGUF {args.gguf}" if args.gguf else "") + f" ({str(dtype)[6:]})"
    return model.to(args.device).eval(), tok, name, weights


def _named_model(name: str) -> str | None:
    """The flexicache_hf.models name of ``name`` when it is one (short names included), else None (a path)."""
    from .models import canonical_name

    try:
        return canonical_name(name)
    except ValueError:
        return None


def _stem(name: str) -> str:
    return name.rstrip("/").rsplit("/", 1)[-1] or "model"


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    threads = args.threads if args.threads is not None else (1 if args.device == "cpu" else 0)
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _run(args)
    finally:  # main() is also called in-process (tests, notebooks): leave torch as it was
        torch.set_num_threads(before)


def _run(args) -> int:
    from .stability.profiler import profile_model, write_figures

    t0 = time.perf_counter()
    model, tok, name, weights = _load(args)
    name = args.name or name
    out = args.out or Path("profiles") / f"{_stem(name)}.json"
    print(f"profiling {name}: tasks {args.tasks}, {args.samples} samples each, <= {args.prompt_tokens} prompt "
          f"tokens, {args.new_tokens} steps, K={args.k_pages} pages of {args.page_size}, W={args.window}, "
          f"oracle={args.oracle}", file=sys.stderr)
    result = profile_model(
        model, tok, tasks=args.tasks, samples_per_task=args.samples, prompt_tokens=args.prompt_tokens,
        new_tokens=args.new_tokens, k_pages=args.k_pages, page_size=args.page_size, window=args.window,
        fraction=args.fraction, oracle=args.oracle, device=args.device, progress=not args.quiet,
        model_name=name, records_dir=args.records, provenance={"weights": weights}, corpus=args.corpus,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    result.profile.save(out)
    print(f"wrote {out}: {len(result.profile.unstable)} unstable of "
          f"{result.profile.model.num_layers * result.profile.model.num_kv_heads} KV heads", file=sys.stderr)
    if args.figures is not None:
        paths = write_figures(result, args.figures, out.stem, layer=args.figure_layer)
        print("wrote " + ", ".join(str(p) for p in paths.values()), file=sys.stderr)
    est = result.estimated
    print(f"cross-task overlap (Quest estimate), mean off-diagonal {_fmt(est.mean_offdiagonal_overlap)}:",
          file=sys.stderr)
    _print_matrix(est.overlap_names, est.overlap)
    if result.oracle is not None:
        print(f"cross-task overlap (oracle attention mass), mean off-diagonal "
              f"{_fmt(result.oracle.mean_offdiagonal_overlap)}:", file=sys.stderr)
        _print_matrix(result.oracle.overlap_names, result.oracle.overlap)
        print(f"estimated vs oracle unstable sets: {result.agreement()}", file=sys.stderr)
    print(f"done in {time.perf_counter() - t0:.0f} s (profiling {result.seconds:.0f} s)", file=sys.stderr)
    return 0


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def _print_matrix(names, mat) -> None:
    width = max(len(n) for n in names)
    for n, row in zip(names, mat):
        print(f"  {n:<{width}}  " + " ".join(f"{v:.2f}" for v in row), file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
