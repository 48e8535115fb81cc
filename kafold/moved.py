"""The tools' old module names (kafold.cli, kafold.commands…, kafold.bench…, kafold.apache_kafka,
kafold.registry_server, kafold.testing.fixtures) kept importable for scripts written against them.

Each old name, when imported, is the very module at its new home under kafold.tools (not a copy: a script that
patches `kafold.bench.aggregates` patches what `kafold bench` runs), and `python -m` runs it under either name. The
names are strings resolved at import time: nothing of the core imports the tools, and no module of kafold uses an
old name (tests/test_layers.py checks both). New code imports kafold.tools.…; see docs/architecture.md."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import CodeType, ModuleType

# old name -> new name; a name below an old one moves with it (kafold.bench.aggregates -> kafold.tools.bench...)
MOVED = {
    "kafold.cli": "kafold.tools.cli",
    "kafold.commands": "kafold.tools.commands",
    "kafold.bench": "kafold.tools.bench",
    "kafold.apache_kafka": "kafold.tools.dev.apache_kafka",
    "kafold.registry_server": "kafold.tools.dev.registry_server",
    "kafold.testing.fixtures": "kafold.tools.dev.fixtures",
}


def new_name(name: str) -> str | None:
    """Where the module of old name `name` lives now, or None when `name` did not move."""
    for old, new in MOVED.items():
        if name == old or name.startswith(old + "."):
            return new + name[len(old):]
    return None


class Redirect(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old name first (before the path finder, which would load a second copy of a module below a moved
    package) and loads it as the module of its new name."""

    def __init__(self) -> None:
        self.specs: dict[str, importlib.machinery.ModuleSpec | None] = {}

    def find_spec(self, fullname: str, path: object = None, target: object = None
                  ) -> importlib.machinery.ModuleSpec | None:
        new = new_name(fullname)
        if new is None:
            return None
        found = importlib.util.find_spec(new)
        if found is None:
            return None
        return importlib.util.spec_from_loader(fullname, self, is_package=found.submodule_search_locations is not None)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(new_name(spec.name) or spec.name)
        self.specs[spec.name] = module.__spec__  # the import system sets __spec__ to the old name's: put back
        return module

    def exec_module(self, module: ModuleType) -> None:
        # the module ran once, under its new name; give it back its own spec
        module.__spec__ = self.specs.pop(module.__spec__.name if module.__spec__ else "", module.__spec__)

    def get_code(self, fullname: str) -> CodeType | None:
        """For `python -m OLD.NAME`: the new module's code, run as __main__."""
        new = new_name(fullname) or fullname
        spec = importlib.util.find_spec(new)
        loader = spec.loader if spec is not None else None
        return loader.get_code(new) if isinstance(loader, importlib.abc.InspectLoader) else None


def install() -> None:
    """Put the redirect first among the finders, once per process."""
    if not any(isinstance(f, Redirect) for f in sys.meta_path):
        sys.meta_path.insert(0, Redirect())
