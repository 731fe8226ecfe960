"""`bench reproduce`: every claim of the two papers, measured here, in one report (kvdirect_app/claims).

python -m kvdirect_app.bench reproduce [--model NAME] [--quick] [--executor local|ray] --out DIR
python -m kvdirect_app.bench reproduce --render DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..benchmarks.executors import check_executor
from ..claims import cells, render, reproduce
from ..engine import validate
from ..models.loading import presets
from .common import THREADS, WORKERS, CliError


def cmd_reproduce(args) -> int:
    if args.render is not None:
        folder = Path(args.render)
        try:
            results = reproduce.load(folder)
        except reproduce.ResultsError as e:
            raise CliError(f"--render: {e}") from None
        paths = render.write(results, folder)
        print(render.render(results).split(render.DETAILS)[0])
        print(f"re-rendered from {folder / 'results.json'}: wrote {', '.join(str(p) for p in paths)}")
        return 0
    if validate.model_name(args.model) not in presets():
        raise CliError(f"model: unknown model {args.model!r}; allowed: the presets ({', '.join(presets())})")
    validate.device_dtype(args.device, "float32")
    check_executor(args.executor)
    if args.workers is not None:
        validate.integer("workers", args.workers, 1, 256)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise CliError(f"--out: {args.out!r} is a file; allowed: a folder (created if absent)")
    print(f"reproduce: {args.model}, {'quick' if args.quick else 'full'}, executor {args.executor}…", file=sys.stderr)
    results = cells.gather(
        args.model,
        args.quick,
        args.executor,
        device=args.device,
        workers=args.workers,
        threads=args.threads,
        say=lambda line: print(line, file=sys.stderr, flush=True),
        kept=out / cells.KEPT,
    )
    paths = render.write(results, out)
    cells.forget(out / cells.KEPT)
    print(render.render(results).split(render.DETAILS)[0])
    print(f"wrote {', '.join(str(p) for p in paths)} in {results['seconds']:.0f} s")
    return 0


def register(sub):
    p = sub.add_parser(
        "reproduce", help="every claim of the papers next to our measurement: report.md, results.json, plots"
    )
    p.add_argument("--model", default="smollm2-135m", help="preset name (the model every measured section runs on)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="shorter conversations, fewer lanes, smaller contexts and "
        "grids (minutes on a CPU; the report lists what it leaves out)",
    )
    p.add_argument(
        "--executor",
        default="local",
        help="local (a bounded process pool here) or ray (RAY_ADDRESS, or a local Ray started for the run)",
    )
    p.add_argument("--workers", type=WORKERS, default=None, help="local pool size (default: cores / threads per cell)")
    p.add_argument("--threads", type=THREADS, default=1, help="torch threads per cell")
    p.add_argument("--device", default="auto", help="device of every cell: auto, cpu, cuda")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--out",
        help="folder for report.md, results.json and the plots; each cell is kept in "
        "DIR/finished-cells as it finishes (a run that did not end resumes from them; "
        "deleted once results.json is written)",
    )
    where.add_argument(
        "--render",
        metavar="DIR",
        help="recompute every verdict from DIR/results.json's cells and "
        "rewrite its claims, DIR/report.md and the plots (runs nothing; "
        "the other options are ignored)",
    )
    p.set_defaults(func=cmd_reproduce)
