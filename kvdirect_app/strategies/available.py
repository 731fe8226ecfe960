"""Imports every strategy module of this package, so that each registers itself."""

import importlib
import pkgutil
from pathlib import Path

for _info in pkgutil.iter_modules([str(Path(__file__).parent)]):
    if _info.name not in ("base", "available", "parsing"):
        importlib.import_module(f"{__package__}.{_info.name}")
