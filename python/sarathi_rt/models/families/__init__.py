"""The built-in model families, one module each; each registers itself in
`models.registry` when imported. Importing them all here (every module in this package)
makes a new LLaMA-shaped family one new file."""
from __future__ import annotations

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
