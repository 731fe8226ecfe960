"""`bench record`: a recording of a conversation with the page's own default panes, to play back in the app.

    python -m kvdirect_app.bench record --scenario recall --out presets/recordings/recall-smollm2-135m.json.gz

The strategies default to what the page shows before anyone changes a
setting: its default panes at budget 64, AnchorKV at the model's deepest
spacing, exact recompute, and `--rebuild step` (the recordings' mode: every
old token rebuilt at every step, the least memory; the live page defaults
to `turn`).  Everything else is `bench run`'s (`--record` there makes the
same file from any run).
"""

from __future__ import annotations

from ..app.ui.settings import REBUILDS, default_names, expand
from ..engine import validate
from ..models.loading import load_model
from .common import CliError, add_conversation_options
from .run import cmd_run

BUDGET = 64


def page_specs(model: str, dtype: str, device: str, rebuild: str, budget: int = BUDGET) -> str:
    """The page's default panes as specs (the same expansion as its sidebar), for this model's depth."""
    layers = load_model(model, dtype=dtype, device=device).config.num_hidden_layers
    return ",".join(expand(name, budget, layers, "exact", rebuild) for name in default_names())


def cmd_record(args) -> int:
    if args.rebuild not in REBUILDS:
        raise CliError(f"rebuild: {args.rebuild!r} is not allowed; allowed: {', '.join(REBUILDS)}")
    if not args.out.endswith((".json", ".json.gz")):
        raise CliError(f"--out: {args.out!r}; a recording's name ends in .json or .json.gz")
    if args.strategies is None:
        model = validate.model_name(args.model)
        device, dtype = validate.device_dtype(args.device, args.dtype)
        args.strategies = page_specs(model, dtype, device, args.rebuild)
    args.record, args.alone, args.solo, args.park, args.dry_run = args.out, False, None, False, False
    return cmd_run(args)


def register(sub):
    p = sub.add_parser("record", help="record a conversation with the page's default panes, to play back in the app")
    add_conversation_options(p)
    p.add_argument("--strategies", default=None, help="comma-separated specs (default: the page's default panes)")
    p.add_argument("--rebuild", default="step", help=f"AnchorKV's rebuild in the default panes: {', '.join(REBUILDS)}")
    p.add_argument("--out", required=True, help="the recording to write (.json or .json.gz)")
    p.add_argument("--json", help="also write bench run's results JSON here")
    # A recording is kept and replayed as the record of a run: its bytes are the allocator's.
    p.set_defaults(func=cmd_record, command="record", memory="trace")
