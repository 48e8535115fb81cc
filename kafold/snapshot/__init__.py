"""Snapshots of aggregate state on a compacted topic, and restore = latest usable snapshot + tail replay."""

from kafold.snapshot.fold import Domain, Tail, folder
from kafold.snapshot.record import Marker, Snapshot
from kafold.snapshot.restore import Restored, restore
from kafold.snapshot.select import REJECTED, Identity, Selection, Selector

__all__ = ["REJECTED", "Domain", "Identity", "Marker", "Restored", "Selection", "Selector", "Snapshot", "Tail",
           "folder", "restore"]
