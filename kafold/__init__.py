"""kafold: Kafka as a practical event store for Python services."""

from kafold import moved

__version__ = "0.1.0"

moved.install()  # the tools' old module names (kafold.cli, kafold.bench…) still import: kafold/moved.py
