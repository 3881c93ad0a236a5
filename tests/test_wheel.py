"""The wheel works outside the checkout: it carries the shipped profiles, and an installed copy finds each by name.

``test_installed_wheel_finds_every_shipped_profile`` builds the wheel from a copy of the files the build reads
(``pip wheel --no-deps --no-build-isolation``: the test environment's setuptools, no download, nothing written into
the checkout), installs it with ``pip install --no-deps --no-index`` into a fresh virtual environment (this
interpreter's, seeing the test environment's packages through a ``.pth`` line, so torch and transformers need no
install; ``.pth`` files in that folder, the editable install's finder among them, are not run), and loads every
profile of the repository's ``profiles/`` by name from a process whose working folder is outside the checkout.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from importlib import resources
from pathlib import Path

import flexicache_hf
from flexicache_hf.head_profile import HeadProfile, available_profiles, shipped_profiles_dir

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = sorted(p.stem for p in (ROOT / "profiles").glob("*.json"))
# What the build reads (setup.cfg names the README, the license files and the packages; the profiles come in through
# the link flexicache_hf/profiles -> ../profiles).
BUILD_INPUTS = ("pyproject.toml", "setup.cfg", "README.md", "LICENSE", "NOTICE", "profiles", "flexicache_hf")

CHECK = r"""
import importlib.metadata, json, sys
from pathlib import Path
import flexicache_hf
from flexicache_hf.head_profile import available_profiles, shipped_profiles_dir
names = json.loads(sys.argv[1])
print(json.dumps({
    "prefix": sys.prefix,
    "file": flexicache_hf.__file__,
    "version": flexicache_hf.__version__,
    "dist_version": importlib.metadata.version("flexicache_hf"),
    "dir": str(shipped_profiles_dir()),
    "paths": {k: str(v) for k, v in available_profiles().items()},
    "profiles": {n: flexicache_hf.resolve_profile(n).to_dict() for n in names},
}))
"""


def _env() -> dict:
    """The environment of this process without what would put the checkout on another one's path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_", "VIRTUAL_ENV"))}
    env.update(PYTHONNOUSERSITE="1", PYTHONDONTWRITEBYTECODE="1", PIP_DISABLE_PIP_VERSION_CHECK="1",
               PIP_CONFIG_FILE=os.devnull)  # no pip configuration of this machine (indexes, constraints)
    return env


def _run(cmd: list, cwd: Path) -> str:
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{cmd} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def _inside(path, folder) -> bool:
    return Path(path).resolve().is_relative_to(Path(folder).resolve())


def test_checkout_finds_the_profiles_through_the_package():
    # The link flexicache_hf/profiles -> ../profiles is what the wheel's package_data reads; it must stay a link
    # to the top-level folder (the source), not a second copy.
    link = ROOT / "flexicache_hf" / "profiles"
    assert link.is_symlink() and link.resolve() == (ROOT / "profiles").resolve()
    assert shipped_profiles_dir() == resources.files("flexicache_hf") / "profiles"
    assert sorted(available_profiles()) == SHIPPED and len(SHIPPED) >= 6


def test_notice_credits_every_published_profile():
    notice = (ROOT / "NOTICE").read_text()
    published = {n: HeadProfile.load(ROOT / "profiles" / f"{n}.json").provenance for n in SHIPPED}
    published = {n: p for n, p in published.items() if p.get("kind") == "published"}
    assert published, "the paper's head lists ship as profiles of kind 'published'"
    for name, prov in published.items():
        assert f"profiles/{name}.json" in notice and f'"{prov["list"]}"' in notice, name
        repo, _, rest = prov["source"].partition(", ")
        assert repo in notice and rest.split(" @ ")[0] in notice and rest.split(" @ ")[1] in notice, name
    assert "https://arxiv.org/abs/2511.00868" in notice
    assert "Apache License" in (ROOT / "LICENSE").read_text()[:200]


def test_installed_wheel_finds_every_shipped_profile(tmp_path):
    src, dist, env_dir, elsewhere = (tmp_path / d for d in ("src", "dist", "venv", "elsewhere"))
    src.mkdir()
    elsewhere.mkdir()
    for name in BUILD_INPUTS:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, src / name)

    # 1. The wheel, as `pip wheel . --no-deps` builds it.
    _run([sys.executable, "-m", "pip", "wheel", src, "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", dist], cwd=tmp_path)
    (wheel,) = dist.glob("flexicache_hf-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    for stem in SHIPPED:
        assert f"flexicache_hf/profiles/{stem}.json" in names, f"{stem} is not in the wheel"
    assert not any(n.startswith("profiles/") for n in names), "the profiles belong inside the package"
    licenses = {Path(n).name for n in names if ".dist-info/" in n}
    assert {"LICENSE", "NOTICE"} <= licenses

    # 2. A fresh environment that sees the test environment's packages (torch, transformers, ...), not its
    #    flexicache_hf: the editable install's finder runs from a .pth file there, which a .pth line does not run.
    venv.EnvBuilder(with_pip=False, symlinks=os.name != "nt").create(env_dir)
    python = env_dir / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=elsewhere).strip())
    ours = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (site / "test-environment.pth").write_text("".join(f"{p}\n" for p in ours))
    _run([python, "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed", "-q", wheel], cwd=elsewhere)

    # 3. Every shipped profile by name, from outside the checkout.
    out = json.loads(_run([python, "-c", CHECK, json.dumps(SHIPPED)], cwd=elsewhere).strip().splitlines()[-1])
    assert _inside(out["prefix"], env_dir)
    assert _inside(out["file"], site) and not _inside(out["file"], ROOT), out["file"]
    assert _inside(out["dir"], site) and not Path(out["dir"]).is_symlink()
    assert sorted(out["paths"]) == SHIPPED and all(_inside(p, site) for p in out["paths"].values())
    for stem in SHIPPED:
        assert out["profiles"][stem] == HeadProfile.load(ROOT / "profiles" / f"{stem}.json").to_dict(), stem
    assert out["version"] == out["dist_version"] == flexicache_hf.__version__
