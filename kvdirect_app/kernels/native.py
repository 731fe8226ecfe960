"""Our two C++ libraries (`ledger.cpp`, the allocator's ledger; `dots.cpp`, the fixed-order linears), compiled
with the machine's C++ compiler (``$CXX``, else ``c++``) against the headers torch ships, once per source, compiler
and torch build, and kept in a cache folder; `make install` builds both.  Loaded with ctypes: no Python extension
module, no build system."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from ..plain.paths import cache


class Unavailable(RuntimeError):
    """A library cannot be built or loaded here; the message says why."""


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "").strip() or "c++")


def library(source: Path, what: str, env: str, name: str, flags=(), libs=(), includes=()) -> Path:
    """`source` compiled into a shared library (kept under the cache folder `env` names, else
    ``~/.cache/kvdirect-studio/<name>``): the kept one where source, flags, compiler and torch build are the same, else
    built now (a few seconds).  `flags` go before the source, `libs` after it; `includes`: files the source includes
    (their text is part of what is kept apart); `what` names it in the reasons `Unavailable` gives."""
    if sys.platform not in ("linux", "darwin"):
        raise Unavailable(f"{what} is built for Linux and macOS, not {sys.platform}")
    cxx = compiler()
    if cxx is None:
        raise Unavailable(f"no C++ compiler (set CXX, or install g++) to build {what}")
    torch_dir = Path(torch.__file__).parent
    command = [
        cxx,
        "-O2",
        "-std=c++17",
        "-shared",
        "-fPIC",
        "-ffp-contract=off",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
        f"-I{torch_dir / 'include'}",
        *flags,
        str(source),
        f"-L{torch_dir / 'lib'}",
        *libs,
        f"-Wl,-rpath,{torch_dir / 'lib'}",
    ]
    texts = [source.read_text(), *(p.read_text() for p in includes)]
    key = hashlib.sha256(
        "\n".join([*texts, torch.__version__, str(torch.version.git_version), sys.platform, *command]).encode()
    ).hexdigest()[:16]
    folder = cache(env, name) or Path(tempfile.gettempdir()) / f"kvdirect-{name}"
    path = folder / key / f"lib{source.stem}.so"
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    done = subprocess.run([*command, "-o", str(tmp)], capture_output=True, text=True)
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise Unavailable(f"{what} did not compile ({Path(cxx).name}): {last}")
    os.replace(tmp, path)
    return path
