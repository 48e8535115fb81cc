"""Snapshots of aggregate state on a compacted topic, and restore = latest usable snapshot + tail replay."""

from kafold.snapshot.fold import Domain, Folder
from kafold.snapshot.record import Marker, Snapshot
from kafold.snapshot.restore import Restored, restore
from kafold.snapshot.select import REJECTED, Identity, Selection, Selector

__all__ = ["REJECTED", "Domain", "Folder", "Identity", "Marker", "Restored", "Selection", "Selector", "Snapshot",
           "restore"]
