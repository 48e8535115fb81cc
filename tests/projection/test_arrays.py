"""The whole-row upsert's arrays built directly (connectors/projection/arrays.py): the same bytes as psycopg's own
binary dump of the same list, and None (the general way) for every value they do not take."""

from __future__ import annotations

from typing import Any

import pytest
from psycopg.adapt import PyFormat, Transformer
from psycopg.types.numeric import Int8

from kafold import db
from kafold.config import PostgresConfig
from kafold.connectors.projection.arrays import INT8_ARRAY_OID, TEXT_ARRAY_OID, int8_array, text_array
from kafold.connectors.projection.whole_rows import Dumped


def psycopg_dump(values: list[Any]) -> tuple[bytes, int]:
    dumper = Transformer()
    data = dumper.dump_sequence([values], [PyFormat.BINARY])[0]
    assert data is not None and dumper.types is not None
    return bytes(data), dumper.types[0]


@pytest.mark.parametrize("values", [
    ["acc-1", "owner-1-2", ""],
    ["é ünïcødé", "中文", "x" * 5000, "y"],  # multi-byte, and a value past the lengths made once
    ["a", None, "b", None],
    ["solo"],
])
def test_a_text_array_is_what_psycopg_sends(values: list[str | None]) -> None:
    assert (text_array(values), TEXT_ARRAY_OID) == psycopg_dump(values)


@pytest.mark.parametrize("values", [
    [0, 1, -1, 2**63 - 1, -(2**63)],
    [7919, None, 42],
    [5],
])
def test_an_int8_array_is_what_psycopg_sends_as_bigint(values: list[int | None]) -> None:
    assert (int8_array(values), INT8_ARRAY_OID) == psycopg_dump([None if v is None else Int8(v) for v in values])


@pytest.mark.integration
def test_the_server_reads_each_back_as_it_was(pg_config: PostgresConfig) -> None:
    texts: list[list[str | None]] = [[], [None], [None, None], ["a", None, "é"], ["x" * 5000]]
    ints: list[list[int | None]] = [[], [None], [1, None, -(2**63)], [2**63 - 1]]
    with db.connect(pg_config) as conn:
        for values in texts:
            data = text_array(values)
            assert data is not None
            assert conn.execute("SELECT %b::text[]", [Dumped(data, TEXT_ARRAY_OID)]).fetchone() == (values,)
        for numbers in ints:
            data = int8_array(numbers)
            assert data is not None
            assert conn.execute("SELECT %b::bigint[]", [Dumped(data, INT8_ARRAY_OID)]).fetchone() == (numbers,)


@pytest.mark.parametrize("values", [
    ["has a \x00 NUL"],  # PostgreSQL text cannot hold it
    ["lone \ud800 surrogate"],  # not UTF-8
    ["a", 1],  # not a str
    ["a", b"bytes"],
    [{"a": 1}],
])
def test_text_values_it_does_not_take_go_the_general_way(values: list[Any]) -> None:
    assert text_array(values) is None


@pytest.mark.parametrize("values", [
    [True, 1],  # psycopg would send `true`, which a bigint column refuses
    [1.0],
    ["1"],
    [2**63],  # beyond 64 bits
    [-(2**63) - 1, None],
])
def test_int_values_it_does_not_take_go_the_general_way(values: list[Any]) -> None:
    assert int8_array(values) is None
