"""The invariance probe's verdicts, kept with the loaded model they were proven for and on disk for the next start.

A verdict says which row counts of one GEMM shape give the rows of a large call bit for bit here (`Verdict`, keyed
by `linear_key` or `attention_rows_key`; `ROWS`: the counts a probe tries).  The probes themselves, which compute
them, are the kernels' (`kernels/probes.py`, its docstring says what they prove); this module only holds what they
found, so it sits below the kernels: a loaded model makes its `Store` as it is made (`LoadedModel.probes`) without
importing the kernels, and the kernels read and fill it.

GEMM verdicts are kept on disk (`Store`), one file per model, dtype and device in a folder per machine and build
(CPU model and flags, torch's version and build, `VERSION`); the file holds the verdicts of every thread count
run here (a write merges this process's into it).  The file proves nothing by itself: every start probes afresh
(every count, proven and failed, at every offset, twice, and the large call at one thread and at the run's count,
on the verdict's device), and a stored verdict is only compared with what the probe finds here.  Where they
differ (an edited file, or a machine that changed under the same name), the probe's verdict is the one used, the
file is rewritten and the run says so (`Store.notes`, in the kernels' report); a file that cannot be read, or an
entry the probe could not have written, is said too.  A re-check of the stored counts would cost what the probe
does, so the probe is the re-check.
`KVDIRECT_PROBE_CACHE` names the folder (default beside the models' cached copies:
``~/.cache/kvdirect-studio/probes``); ``off`` keeps verdicts in memory only.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
import platform
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ..plain.paths import cache

VERSION = 5  # stored verdicts of another version are not read: bump it when a kernel or the probe changes
ROWS = (16, 32, 64, 128, 256, 512)  # every probed GEMM of the invariant path has one of these row counts
HEAD_ELEMENTS = 1 << 23  # a weight this large (the output head) sees one row per lane: probed at ROWS[0] only
CACHE_ENV = "KVDIRECT_PROBE_CACHE"


@dataclass(frozen=True)
class Verdict:
    """Which row counts of one GEMM shape give the rows of a large call, bit for bit, here."""

    key: tuple
    counts: tuple[int, ...]  # proven counts, ascending
    across_threads: bool  # the large call gives the same bits at one thread and at the verdict's count
    failed: tuple[int, ...] = ()  # probed counts that differed

    @property
    def largest(self) -> int:
        return self.counts[-1] if self.counts else 0

    def pad(self, m: int) -> int:
        """The smallest proven count >= m; a call of more rows than the largest must be split first."""
        i = bisect.bisect_left(self.counts, m)
        if i == len(self.counts):
            raise ValueError(f"a GEMM of {m} rows: no proven count holds it (largest {self.largest}); split it")
        return self.counts[i]

    @property
    def threads(self) -> int:
        return self.key[-1]

    def as_dict(self) -> dict:
        return {
            "key": list(self.key),
            "proven": list(self.counts),
            "failed": list(self.failed),
            "across_threads": self.across_threads,
        }


def linear_key(weight: torch.Tensor, bias: torch.Tensor | None, threads: int) -> tuple:
    return ("linear", tuple(weight.shape), bias is not None, dtype_name(weight.dtype), str(weight.device), threads)


def attention_rows_key(head_dim: int, dtype: torch.dtype, device) -> tuple:
    return ("attention rows", head_dim, dtype_name(dtype), str(device), 1)  # the block attention runs on one thread


def candidates_of(key: tuple) -> tuple[int, ...]:
    """The row counts the probe tries for a verdict's key (ValueError: not a key it writes)."""
    if key[0] == "linear" and len(key) == 6:
        return ROWS[:1] if math.prod(key[1]) >= HEAD_ELEMENTS else ROWS
    if key[0] == "attention rows" and len(key) == 5:
        return ROWS
    raise ValueError(f"not a verdict's key: {key!r}")


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as the keys write it: "float32", "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def ranges(counts) -> str:
    """`16, 32-64` style: consecutive proven counts of ROWS joined."""
    return ", ".join(str(c) for c in counts) or "none"


# --- the verdicts kept -----------------------------------------------------------------------------------------
def environment(device) -> dict:
    """What the verdicts depend on besides the shapes: the processor, torch's build, the probe's `VERSION`."""
    model, flags = platform.machine(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == "model name" and model == platform.machine():
                model = value.strip()
            elif name.strip() in ("flags", "Features") and not flags:
                flags = " ".join(sorted(value.split()))
    except OSError:
        pass
    env = {
        "version": VERSION,
        "cpu": model,
        "cpu_flags": hashlib.sha256(flags.encode()).hexdigest()[:16],
        "capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "torch_build": torch.version.git_version,
    }
    device = torch.device(device)
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    return env


def root() -> Path | None:
    """The folder, or None when it is turned off (`paths.cache`)."""
    return cache(CACHE_ENV, "probes")


class Store:
    """The verdicts of one loaded model: probed here at every start, and compared with its file's.

    Only GEMM verdicts (`Verdict`: a linear shape's or the attention's row counts) go to the file; the block
    attention's and the norms' ((ok, why)) are probed at every start and kept in memory."""

    def __init__(self, name: str, dtype: torch.dtype, device):
        env = environment(device)
        folder = root()
        tag = hashlib.sha256(json.dumps(env, sort_keys=True).encode()).hexdigest()[:16]
        safe = "".join(c if c.isalnum() or c in "-._" else "_" for c in name)
        self.path = None if folder is None else folder / tag / f"{safe}-{dtype_name(dtype)}-{torch.device(device)}.json"
        self.environment = env
        self.verdicts: dict[tuple, object] = {}  # key -> Verdict or (ok, why)
        self.notes: list[str] = []  # what the file said that the probe here did not find (the run says so)
        self.stored: dict[tuple, object] = self._read(self.notes)  # from the file, until compared with the probe
        self.confirmed = 0  # stored verdicts the probe found again in this process

    def _read(self, notes: list | None = None) -> dict:
        """The file's verdicts for this environment, each one the probe could have written (`_stored`); a file that
        cannot be read, or an entry the probe could not have written, is noted in `notes`."""
        if self.path is None or not self.path.is_file():
            return {}
        say = notes.append if notes is not None else (lambda line: None)
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError) as e:
            say(f"probe file {self.path.name}: not readable ({type(e).__name__}): every verdict probed afresh")
            return {}
        if not isinstance(data, dict) or data.get("environment") != self.environment:
            say(f"probe file {self.path.name}: not this machine's and build's: every verdict probed afresh")
            return {}
        entries = data.get("verdicts")
        verdicts = [_stored(entry) for entry in entries] if isinstance(entries, list) else [None]
        if any(v is None for v in verdicts):
            say(
                f"probe file {self.path.name}: {sum(v is None for v in verdicts)} entry(ies) the probe could not have "
                "written (edited?): ignored"
            )
        return {v.key: v for v in verdicts if v is not None}

    def _write(self):
        """This process's verdicts, merged into the file's (those of other keys, e.g. other thread counts, stay)."""
        if self.path is None:
            return
        merged = self._read() | {k: v for k, v in self.verdicts.items() if isinstance(v, Verdict)}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.path.parent, delete=False, suffix=".tmp") as f:
                json.dump({"environment": self.environment, "verdicts": [v.as_dict() for v in merged.values()]}, f)
            os.replace(f.name, self.path)
        except OSError:
            pass  # a folder that cannot be written: the verdicts stay in memory

    def get(self, key: tuple, probe, keep: bool = False):
        """The verdict for `key`: known in this process, else `probe()` here.  `keep`: a verdict the file holds (a
        GEMM's); the file's, if any, is compared with the probe's, and where they differ the probe's is used, the
        file rewritten and a note made."""
        if key in self.verdicts:
            return self.verdicts[key]
        fresh = self.verdicts[key] = probe()
        if keep:
            stored = self.stored.pop(key, None)
            if stored == fresh:
                self.confirmed += 1
                return fresh
            if stored is not None:
                self.notes.append(
                    f"the probe file said {describe(stored)}; the probe here finds {describe(fresh)}: "
                    "the file was edited or the machine changed; the probe's verdict is used, the file "
                    "rewritten"
                )
            self._write()
        return fresh

    def clear(self):
        self.verdicts.clear()
        self.stored.clear()


def describe(v: Verdict) -> str:
    """A verdict in words: its shape or geometry, thread count, proven and failed counts, the thread equality."""
    what = (
        f"a {'x'.join(map(str, v.key[1]))} GEMM{' with bias' if v.key[2] else ''} at {v.threads} thread(s)"
        if v.key[0] == "linear"
        else f"the attention's GEMMs (head size {v.key[1]})"
    )
    return f"{what} proven at {ranges(v.counts)}, failing at {ranges(v.failed)}" + (
        f", {'the same' if v.across_threads else 'other'} bits at 1 thread" if v.key[0] == "linear" else ""
    )


def _stored(entry) -> Verdict | None:
    """A file's entry as a Verdict, or None where it is not one the probe could have written: its counts, proven
    and failed, are the probe's for its key (`candidates_of`), each once, proven ascending; across_threads a bool."""
    try:
        key, proven, failed, across = _tuple(entry["key"]), entry["proven"], entry["failed"], entry["across_threads"]
        counts = proven + failed
        hash(key)  # TypeError where a JSON object sits in it: not a key the probe writes
        if (
            isinstance(across, bool)
            and all(type(c) is int for c in counts)
            and proven == sorted(proven)
            and sorted(counts) == list(candidates_of(key))
        ):
            return Verdict(key, tuple(proven), across, tuple(failed))
    except (KeyError, TypeError, ValueError, IndexError):
        pass
    return None


def _tuple(value):
    return tuple(_tuple(v) for v in value) if isinstance(value, list) else value
