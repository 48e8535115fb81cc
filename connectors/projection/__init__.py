"""The `postgres-projection` connector: events folded into a PostgreSQL table, exactly once."""

from kafold.connectors.projection.config import OnEvent, ProjectionConfig
from kafold.connectors.projection.connector import ProjectionConnector
from kafold.connectors.projection.task import ProjectionSinkTask

__all__ = ["OnEvent", "ProjectionConfig", "ProjectionConnector", "ProjectionSinkTask"]
