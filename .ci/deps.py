#!/usr/bin/env python3
"""What ``.ci/install`` installs, decided in one place (issues 28 and 32).

Every version comes from ``.ci/constraints.txt`` (exact pins of the direct
dependencies and of everything they pull in, tested together by CI), except
what the machine already has and this script keeps:

* **torch** of a supported version (``torch >= 2.11``, CUDA or CPU build) is
  kept and never replaced; an older torch is an error (exit 2), not an
  upgrade. Only without torch is the pinned CPU wheel installed, first and on
  its own, so that nothing ever resolves a bare ``torch`` (a CUDA build).
* **triton** ``>= 3.6`` and **torch-geometric** ``>= 2.8`` are kept. Next to a
  CUDA torch, triton is torch's own dependency and is never changed.
* **torch-scatter / torch-cluster** are compiled from source (pinned, with
  ``--no-build-isolation``) only next to a CPU torch: with a CUDA torch, or
  with ``QSV_PYG_EXTRAS=0``, they are optional extras and are not compiled
  (``qsv_pyg.geometry`` then uses its torch kNN). ``QSV_PYG_EXTRAS=1`` compiles
  them anyway.
* The rest (numpy, tqdm, matplotlib, geoopt, pytest) is installed when
  missing; kept packages enter pip's constraints at their installed version.

When everything is present, pip is not run at all: no network call (an
offline machine, or ``PIP_NO_INDEX=1 PIP_FIND_LINKS=<wheel folder>``).

Commands::

    python3 .ci/deps.py --plan     # print what would be installed, change nothing
    python3 .ci/deps.py install    # install it (what .ci/install runs)
    python3 .ci/deps.py pins       # the pin file for this environment (.ci/update-pins)
    python3 .ci/deps.py direct     # the direct dependencies, one per line

``--pretend NAME=VERSION`` (repeatable) and ``--pretend-cuda`` replace what
is installed by exactly what they name, for ``--plan`` (tests use them).
"""
from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

HERE = Path(__file__).resolve().parent
CONSTRAINTS = HERE / "constraints.txt"

#: The lowest supported version of what is kept when present (documented in README.md).
SUPPORTED = {"torch": (2, 11), "triton": (3, 6), "torch-geometric": (2, 8)}
#: Compiled from source, needed only for the fast kNN path: optional next to a CUDA torch.
EXTRAS = ("torch-scatter", "torch-cluster")
#: Installed when missing (pure Python or wheels; torch never pulled in: it is installed first).
PLAIN = ("numpy", "tqdm", "matplotlib", "geoopt", "pytest", "torch-geometric")
EXTRAS_ENV = "QSV_PYG_EXTRAS"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def direct(linux: Optional[bool] = None) -> List[str]:
    """The direct dependencies of the package and its tests, torch first."""
    linux = sys.platform.startswith("linux") if linux is None else linux
    # Triton: the CUDA kernels, tested on CPU through its interpreter; Linux wheels only.
    return ["torch", *PLAIN, *(["triton"] if linux else []), *EXTRAS]


def release(version: str) -> Tuple[int, ...]:
    """``"2.11.0+cu130"`` -> ``(2, 11, 0)``; ``"2.8.0.post1"`` -> ``(2, 8, 0)``."""
    m = re.match(r"\d+(\.\d+)*", version.strip())
    if m is None:
        raise ValueError(f"not a version: {version!r}")
    return tuple(int(p) for p in m.group(0).split("."))


def read_pins(path: Path = CONSTRAINTS) -> Dict[str, str]:
    """``{canonical name: version}`` from a constraints file of ``name==version`` lines."""
    pins = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s;]+)", line)
        if m is None:
            raise SystemExit(f"error: {path}:{n}: expected name==version, got {line!r}")
        pins[canonical(m.group(1))] = m.group(2)
    return pins


def _fmt(v: Tuple[int, ...]) -> str:
    return ".".join(map(str, v))


class PlanError(Exception):
    """A machine this script will not change (an unsupported torch, a bad setting)."""


@dataclass
class Plan:
    """What to install. ``steps``: pip argument lists, run in order; ``notes``: one
    line per decision; ``constraints``: the pins pip gets (kept packages at their
    installed version); ``extras``: whether torch-scatter/torch-cluster are wanted."""
    steps: List[List[str]] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    constraints: Dict[str, str] = field(default_factory=dict)
    extras: bool = True


def plan(present: Mapping[str, str], cuda: bool, pins: Mapping[str, str],
         extras_env: Optional[str] = None, linux: Optional[bool] = None,
         broken: Sequence[str] = ()) -> Plan:
    """Decide what to install.

    Args:
        present: installed distributions, ``{canonical name: version}`` (torch-scatter
            and torch-cluster only when importable).
        cuda: whether the installed torch is a CUDA (or ROCm) build.
        pins: the constraints file's versions.
        extras_env: the value of ``$QSV_PYG_EXTRAS`` (``"0"``, ``"1"``, unset/empty: auto).
        broken: extras that are installed but do not import (built for another torch):
            compiled again, bypassing pip's wheel cache.

    Raises:
        PlanError: an installed torch older than the supported one, or a bad
            ``QSV_PYG_EXTRAS``.
    """
    present = {canonical(k): v for k, v in present.items()}
    out = Plan(constraints=dict(pins))
    missing = [name for name in direct(linux) if name not in pins]
    if missing:
        raise PlanError(f"the pin file has no pin for {', '.join(missing)}; run "
                        "bash .ci/update-pins")

    def keep(name: str, why: str) -> None:
        out.constraints[name] = present[name]
        out.notes.append(f"{name} {present[name]}: kept ({why})")

    def install(name: str, why: str) -> None:
        out.constraints[name] = pins[name]
        out.notes.append(f"{name}=={pins[name]}: to install ({why})")

    torch = present.get("torch")
    build = "CUDA build" if cuda else "CPU build"
    low = SUPPORTED["torch"]
    if torch is None:
        install("torch", "no torch installed; the CPU wheel, on its own and first")
        out.steps.append([f"torch=={pins['torch']}"])
        cuda = False
    elif release(torch) < low:
        raise PlanError(f"torch {torch} is installed; qsv_pyg needs torch >= {_fmt(low)} (CUDA "
                        "or CPU build). .ci/install never replaces an installed torch: "
                        "upgrade it yourself, or use a fresh virtual environment")
    else:
        keep("torch", f"{build}; supported: torch >= {_fmt(low)}, never replaced")

    wanted: List[str] = []
    for name in direct(linux):
        if name == "torch" or name in EXTRAS:
            continue
        have = present.get(name)
        low = SUPPORTED.get(name)
        if name == "triton" and cuda and torch is not None:
            # A CUDA torch pins its own triton: changing it would break torch.
            if have is None:
                out.notes.append("triton: absent next to a CUDA torch, which pins its own; "
                                 "not installed (the Triton kernels are unavailable, the "
                                 "PyTorch path is used)")
            else:
                ok = release(have) >= low
                keep(name, "the CUDA torch's own" + ("" if ok else
                     f"; older than {_fmt(low)}: the Triton kernels are unsupported with it"))
            continue
        if have is None:
            install(name, "missing")
        elif low is not None and release(have) < low:
            install(name, f"{have} is older than the supported {_fmt(low)}")
        else:
            keep(name, f"supported: >= {_fmt(low)}" if low else "present")
            continue
        wanted.append(f"{name}=={pins[name]}")
    if wanted:
        out.steps.append(wanted)

    choice = (extras_env or "").strip()
    if choice not in ("", "0", "1"):
        raise PlanError(f"{EXTRAS_ENV}={extras_env!r}: expected 0 (do not compile "
                        "torch-scatter/torch-cluster), 1 (compile them) or unset (compile "
                        "them next to a CPU torch only)")
    out.extras = choice == "1" or (choice == "" and not cuda)
    absent = [name for name in EXTRAS if name not in present]
    for name in EXTRAS:
        if name in present:
            keep(name, "present")
    if absent and not out.extras:
        why = f"{EXTRAS_ENV}=0" if choice == "0" else f"CUDA torch; {EXTRAS_ENV}=1 compiles them"
        out.notes.append(f"{' and '.join(absent)}: optional extras, not compiled ({why}); kNN "
                         "graphs use qsv_pyg's torch fallback and the tests that need them skip")
    elif absent:
        for name in absent:
            again = name in broken
            install(name, ("installed but does not import (built for another torch): " if again
                           else "") + "compiled from source against the installed torch, "
                    "several minutes")
            out.steps.append(["--no-build-isolation",
                              *(["--force-reinstall", "--no-deps", "--no-cache-dir"] if again
                                else []), f"{name}=={pins[name]}"])
    if not out.steps:
        out.notes.append("nothing to install: pip is not run (no network call)")
    return out


# ============================================================================ this machine


def installed(linux: Optional[bool] = None) -> Tuple[Dict[str, str], bool, List[str]]:
    """What this interpreter has: ``({canonical name: version}, torch is a CUDA build,
    extras that are installed but do not import)``."""
    present: Dict[str, str] = {}
    for name in direct(linux):
        try:
            present[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    cuda = False
    broken: List[str] = []
    if "torch" in present:
        try:
            import torch
        except Exception as exc:  # a broken torch is not replaced either
            first = (str(exc).splitlines() or [""])[0]
            raise PlanError(f"torch {present['torch']} is installed but does not import "
                            f"({type(exc).__name__}: {first}); .ci/install never replaces an "
                            "installed torch: repair it, or use a fresh virtual environment"
                            ) from None
        cuda = bool(torch.version.cuda or getattr(torch.version, "hip", None))
        for name in EXTRAS:  # compiled against some torch: present only if it imports
            if name in present:
                try:
                    __import__(name.replace("-", "_"))
                except (ImportError, OSError):
                    del present[name]
                    broken.append(name)
    return present, cuda, broken


def run_plan(p: Plan, python: str = sys.executable) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        constraints = Path(tmp, "constraints.txt")
        constraints.write_text("".join(f"{k}=={v}\n" for k, v in sorted(p.constraints.items())))
        for args in p.steps:
            cmd = [python, "-m", "pip", "install", "--disable-pip-version-check",
                   "-c", str(constraints), *args]
            say(" ".join(a for a in args))
            env = dict(os.environ)
            if "--no-build-isolation" in args:
                env.setdefault("MAX_JOBS", "2")
            subprocess.run(cmd, check=True, env=env)


def closure(roots: Sequence[str]) -> Dict[str, str]:
    """Every installed distribution that ``roots`` need (their requirements, recursively,
    markers evaluated here, no extras but those named), ``{canonical name: version}``."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # a bare venv: pip's copy
        from pip._vendor.packaging.requirements import Requirement  # type: ignore
    found: Dict[str, str] = {}
    todo = [(canonical(r), frozenset()) for r in roots]
    seen = set()
    while todo:
        name, extras = todo.pop()
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # not needed on this platform, or not installed
        found[name] = dist.version
        for text in dist.requires or []:
            req = Requirement(text)
            envs = [{"extra": e} for e in extras] or [{"extra": ""}]
            if req.marker is None or any(req.marker.evaluate(e) for e in envs):
                todo.append((canonical(req.name), frozenset(canonical(x) for x in req.extras)))
    return found


def pin_file(versions: Mapping[str, str]) -> str:
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    lines = ["# Exact versions of everything .ci/install installs (the direct dependencies",
             "# of .ci/deps.py and all they pull in), tested together by CI. Written by",
             "# `python3 .ci/deps.py pins`, which `bash .ci/update-pins` runs after the tests",
             "# passed in a fresh environment with the newest versions; not edited by hand.",
             f"# Python {py} on {sys.platform}; torch stays at 2.13.0 (the CPU wheel).",
             *(f"{name}=={version.split('+')[0]}" for name, version in sorted(versions.items()))]
    return "\n".join(lines) + "\n"


def say(message: str) -> None:
    print(f"[install] {message}", flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", nargs="?", default="install",
                    choices=("install", "pins", "direct", "pin"))
    ap.add_argument("name", nargs="?", help="for `pin`: the package whose pinned version to print")
    ap.add_argument("--plan", action="store_true", help="print the plan, install nothing")
    ap.add_argument("--constraints", type=Path, default=CONSTRAINTS,
                    help=f"the pin file (default {CONSTRAINTS})")
    ap.add_argument("--pretend", action="append", default=None, metavar="NAME=VERSION",
                    help="treat exactly these as installed (with --plan)")
    ap.add_argument("--pretend-cuda", action="store_true", help="the pretended torch is CUDA")
    args = ap.parse_args(argv)
    if args.command == "direct":
        print("\n".join(direct()))
        return 0
    if args.command == "pins":
        sys.stdout.write(pin_file(closure(direct())))
        return 0
    pins = read_pins(args.constraints)
    if args.command == "pin":
        print(pins[canonical(args.name)])
        return 0
    if args.pretend is not None:
        if not args.plan:
            ap.error("--pretend needs --plan")
        present = dict(item.split("=", 1) for item in args.pretend)
        cuda, broken = args.pretend_cuda, []
    try:
        if args.pretend is None:
            present, cuda, broken = installed()
        p = plan(present, cuda, pins, os.environ.get(EXTRAS_ENV), broken=broken)
    except PlanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for note in p.notes:
        say(note)
    if args.plan:
        for args_ in p.steps:
            say("would run: pip install -c <constraints> " + " ".join(args_))
        return 0
    try:
        run_plan(p)
    except subprocess.CalledProcessError as exc:
        print(f"error: pip failed (exit {exc.returncode}): {' '.join(exc.cmd[3:])}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
