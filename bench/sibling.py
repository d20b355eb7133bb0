"""Loading one bench script from another: bench/ is not a package, and `build` is too common a name
to import plainly."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def load(name: str):
    path = Path(__file__).resolve().with_name(f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"diskkit_bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module
