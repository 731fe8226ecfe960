"""`bench docs`: the README's and docs/'s measured figures re-rendered from their committed results files;
`bench docs --check` lists each figure that disagrees with its file (exit 1), as CI runs it.

    python -m kvdirect_app.bench docs --check
"""

from __future__ import annotations

import argparse

from . import doc_figures as docs
from .common import CliError


def cmd_docs(args) -> int:
    try:
        if args.check:
            stale = docs.check()
            for s in stale:
                print(s.line())
            print(f"{docs.markers()} figures in {len(docs.pages())} pages; "
                  + (f"{len(stale)} disagree with their results files" if stale else "every one as its file says"))
            return 1 if stale else 0
        changed = docs.render()
    except docs.FigureError as e:
        raise CliError(str(e)) from None
    print(f"re-rendered {len(changed)} page(s): {', '.join(changed) or 'none changed'}")
    return 0


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("docs", help="the README's and docs/'s figures from their results files (--check: "
                                           "say which disagree)")
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 naming each figure that disagrees")
    p.set_defaults(func=cmd_docs)
    return p
