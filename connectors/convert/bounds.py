"""Bounds on what one registry-framed record may decode to: array elements plus map entries (object members).

Why two checks. An item that takes at least one byte on the wire (a number, a string, a nested array's terminator,
a protobuf field's tag, a JSON comma) cannot outnumber the record's bytes, so a record no longer than the limit
cannot exceed it and is not counted at all; a longer one is counted after it is decoded (`excess`). Avro alone can
encode items of no bytes (null, an empty record, a zero-length fixed): a 5-byte record then declares 2^60 of them
and the decoder loops for ever, so for a schema with such arrays the record's bytes are walked before decoding
(`AvroWalk`), counting the items each block declares and stopping at the first block past the limit.
"""

from __future__ import annotations

from typing import Any

NAMED = ("record", "error", "enum", "fixed")
FIXED_WIDTH = {"boolean": 1, "float": 4, "double": 8}
VARINT = ("int", "long", "enum")
SIZED = ("bytes", "string")


class TooMany(Exception):
    """A record declares more items than its limit; `field` is the dotted path of the array or map that passed it."""

    def __init__(self, field: str, limit: int) -> None:
        super().__init__(f"field {field or '$'!r}: more than {limit} decoded items (array elements and map "
                         "entries; registry.max_decoded_items)")
        self.field = field


def excess(value: Any, limit: int) -> str | None:
    """The path of the list or dict where `value`'s items (list elements plus dict entries) pass `limit`, else
    None; stops walking there."""
    left = limit
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, dict):
            left -= len(node)
            if left < 0:
                return path or "$"
            stack.extend((f"{path}.{k}" if path else str(k), v) for k, v in node.items()
                         if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            left -= len(node)
            if left < 0:
                return path or "$"
            stack.extend((f"{path}.{i}" if path else str(i), v) for i, v in enumerate(node)
                         if isinstance(v, (dict, list)))
    return None


class _Stop(Exception):
    """The bytes end early or do not fit the schema: the decoder will say what is wrong, not the walk."""


class AvroWalk:
    """Walks Avro binary against its writer schema (JSON form), counting array and map items without building
    them. `needed` is True when the schema has an array whose items can take no bytes."""

    def __init__(self, schema: Any, referenced: tuple[Any, ...] = ()) -> None:
        """`referenced`: the schemas `schema` refers to by name (its registry references), compiled first."""
        self.names: dict[str, Any] = {}
        for named in referenced:
            self._compile(named, "")
        self.root = self._compile(schema, "")
        self.needed = self._has_empty_items(self.root, set())

    def check(self, data: bytes, limit: int) -> None:
        """TooMany when `data` declares more than `limit` items; returns quietly on bytes the decoder will refuse.
        Safe to call from several threads at once: the walk's position lives in a cursor of its own."""
        cursor = _Cursor(self, data, limit)
        try:
            cursor.skip(self.root, "")
        except (_Stop, IndexError, RecursionError):
            return

    # the schema, compiled once into nested tuples: (kind, ...) with named types by full name
    def _compile(self, t: Any, ns: str) -> Any:
        if isinstance(t, list):
            return ("union", tuple(self._compile(b, ns) for b in t))
        if isinstance(t, str):
            if t in FIXED_WIDTH or t in VARINT or t in SIZED or t == "null":
                return (t,)
            return ("ref", t if "." in t or not ns else f"{ns}.{t}", t)
        if not isinstance(t, dict):
            return ("null",)
        kind = t.get("type")
        if isinstance(kind, (dict, list)):
            return self._compile(kind, ns)
        if kind in NAMED:
            name = str(t.get("name", ""))
            ns = str(t.get("namespace", ns)) if "." not in name else name.rpartition(".")[0]
            full = name if "." in name else (f"{ns}.{name}" if ns else name)
            node: list[Any] = [kind]
            self.names[full] = node
            self.names.setdefault(name.rpartition(".")[2], node)
            if kind in ("record", "error"):
                node.append(tuple((str(f.get("name", "")), self._compile(f.get("type"), ns))
                                  for f in t.get("fields", ()) if isinstance(f, dict)))
            elif kind == "fixed":
                node.append(int(t.get("size", 0)))
            return node
        if kind == "array":
            return ("array", self._compile(t.get("items"), ns))
        if kind == "map":
            return ("map", self._compile(t.get("values"), ns))
        return self._compile(kind, ns)

    def resolve(self, t: Any) -> Any:
        while t[0] == "ref":
            t = self.names.get(t[1]) or self.names.get(t[2]) or ("null",)
        return t

    def _has_empty_items(self, t: Any, seen: set[int]) -> bool:
        t = self.resolve(t)
        if id(t) in seen:
            return False
        seen.add(id(t))
        if t[0] == "array":
            return self._empty(t[1], set()) or self._has_empty_items(t[1], seen)
        if t[0] == "map":
            return self._has_empty_items(t[1], seen)
        if t[0] == "union":
            return any(self._has_empty_items(b, seen) for b in t[1])
        if t[0] in ("record", "error"):
            return any(self._has_empty_items(ft, seen) for _, ft in t[1])
        return False

    def _empty(self, t: Any, seen: set[int]) -> bool:
        """True when a value of `t` can take no bytes."""
        t = self.resolve(t)
        if t[0] == "null":
            return True
        if t[0] == "fixed":
            return bool(t[1] == 0)
        if t[0] in ("record", "error") and id(t) not in seen:
            seen.add(id(t))
            return all(self._empty(ft, seen) for _, ft in t[1])
        return False


class _Cursor:
    """One walk of one record's bytes."""

    def __init__(self, walk: AvroWalk, data: bytes, limit: int) -> None:
        self.resolve = walk.resolve
        self.data, self.pos, self.left, self.limit = data, 0, limit, limit

    def long(self) -> int:
        data, shift, out = self.data, 0, 0
        while True:
            b = data[self.pos]
            self.pos += 1
            out |= (b & 0x7F) << shift
            if not b & 0x80:
                return (out >> 1) ^ -(out & 1)
            shift += 7
            if shift > 63:
                raise _Stop

    def skip(self, t: Any, path: str) -> None:
        t = self.resolve(t)
        kind = t[0]
        if kind == "null":
            return
        if kind in FIXED_WIDTH:
            self.pos += FIXED_WIDTH[kind]
        elif kind in VARINT:
            self.long()
        elif kind in SIZED:
            size = self.long()
            if size < 0:
                raise _Stop
            self.pos += size
        elif kind == "fixed":
            self.pos += t[1]
        elif kind in ("record", "error"):
            for name, ft in t[1]:
                self.skip(ft, f"{path}.{name}" if path else name)
        elif kind == "union":
            branch = self.long()
            if not 0 <= branch < len(t[1]):
                raise _Stop
            self.skip(t[1][branch], path)
        else:  # array or map: blocks of items, a count of 0 ends them
            while True:
                count = self.long()
                if count == 0:
                    return
                if count < 0:  # a negative count is followed by the block's size in bytes
                    count = -count
                    self.long()
                self.left -= count
                if self.left < 0:
                    raise TooMany(path, self.limit)
                for _ in range(count):
                    if kind == "map":
                        self.skip(("string",), path)
                    self.skip(t[1], path)
                    if self.pos > len(self.data):
                        raise _Stop
        if self.pos > len(self.data):
            raise _Stop
