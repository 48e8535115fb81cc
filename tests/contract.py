"""The sink contract and test helpers, from kafold.testing (what a plugin's own tests use too)."""

from kafold.testing import (
    LocalContext,
    SinkTaskContract,
    committed,
    create_topic,
    make_event,
    new_producer,
    produce,
    wait_for,
)

__all__ = ["LocalContext", "SinkTaskContract", "committed", "create_topic", "make_event", "new_producer", "produce",
           "wait_for"]
