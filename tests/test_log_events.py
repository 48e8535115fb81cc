"""Every log event in the product source is a dotted name (`area.what_happened`), checked on the source with `ast`."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kafold", "daemon", "connectors", "spark_jobs")
EVENT = re.compile(r"^[a-z][a-z0-9_]*(\.[a-z0-9_]+)+$")
LEVELS = {"debug", "info", "warning", "warn", "error", "exception", "critical", "fatal", "msg"}
METHODS = LEVELS | {"a" + level for level in LEVELS}  # structlog's async variants: ainfo, awarning, ...
LOGGER_NAME = re.compile(r"(^|_)(log|logger)$", re.IGNORECASE)  # log, self.log, logger, LIBRDKAFKA_LOG; not catalog
FACTORIES = {"get", "get_logger", "getLogger", "bind", "new"}  # logs.get(...), structlog.get_logger(...), log.bind(...)


def _is_logger(node: ast.expr) -> bool:
    """Whether `node` names a logger: a name like `log`, or a logger made or bound in place."""
    if isinstance(node, ast.Call):
        func = node.func
        if not isinstance(func, ast.Attribute) or func.attr not in FACTORIES:
            return False
        return _is_logger(func.value) if func.attr in {"bind", "new"} else True
    if isinstance(node, ast.Attribute):
        return bool(LOGGER_NAME.search(node.attr))
    if isinstance(node, ast.Name):
        return bool(LOGGER_NAME.search(node.id))
    return False


def _literals(node: ast.expr) -> Iterator[str]:
    """The event names a first argument can take when written in place: a literal, each branch of `a if c else b`,
    or an f-string with each placeholder standing for a name part (`f"{kind}.started"` -> `x.started`)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node.value
    elif isinstance(node, ast.IfExp):
        yield from _literals(node.body)
        yield from _literals(node.orelse)
    elif isinstance(node, ast.JoinedStr):
        yield "".join(str(v.value) if isinstance(v, ast.Constant) else "x" for v in node.values)


def _dynamic_emitters(tree: ast.AST) -> set[str]:
    """Names bound to a logger's method picked at run time: `emit = getattr(self.log, level)`."""
    names = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Name) and node.value.func.id == "getattr"
                and node.value.args and _is_logger(node.value.args[0])):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def log_calls(source: str, filename: str) -> Iterator[tuple[int, ast.expr]]:
    """(line, first argument) of each log call in `source`."""
    tree = ast.parse(source, filename)
    emitters = _dynamic_emitters(tree)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        func = node.func
        if (isinstance(func, ast.Attribute) and func.attr in METHODS and _is_logger(func.value)) or \
                (isinstance(func, ast.Name) and func.id in emitters):
            yield node.lineno, node.args[0]


def bad_events(source: str, filename: str) -> list[str]:
    """`file:line: 'event'` for each log call in `source` whose event, written in place, is not a dotted name."""
    return [f"{filename}:{line}: {text!r}" for line, arg in sorted(log_calls(source, filename), key=lambda c: c[0])
            for text in _literals(arg) if not EVENT.match(text)]


def _sources() -> Iterator[Path]:
    for package in PACKAGES:
        yield from sorted((ROOT / package).rglob("*.py"))


def test_every_log_event_in_the_product_is_a_dotted_name() -> None:
    bad, calls = [], 0
    for path in _sources():
        source, name = path.read_text(encoding="utf-8"), str(path.relative_to(ROOT))
        calls += sum(1 for _ in log_calls(source, name))
        bad += bad_events(source, name)
    assert not bad, "log events must be dotted names like `area.what_happened`:\n" + "\n".join(bad)
    assert calls > 150, calls  # the finder still sees the product's log calls (about 190 when written)


def test_the_check_catches_sentences_in_every_form_of_log_call() -> None:
    source = '''
log.info("daemon started", x=1)
self.log.warning("runner.put_retrying")
logs.get(__name__).error("put failed; retrying")
log.bind(task=1).info("Task.Started")
LIBRDKAFKA_LOG.warning("broker down")
self.log.info("paused" if request else "runner.resumed")
self.log.error(f"stopping the {what} failed")
self.log.error(f"runner.{what}_stop_failed")
log.info(event)
catalog.info("not a logger")
def put(self):
    emit = getattr(self.log, self.level)
    emit("events received")
'''
    assert [b.split(": ", 1)[0] for b in bad_events(source, "f.py")] == [
        "f.py:2", "f.py:4", "f.py:5", "f.py:6", "f.py:7", "f.py:8", "f.py:14"]
