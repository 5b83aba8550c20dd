"""Typed Dagster resources: Spark, Kafka, the Delta lake, and the slice policy."""

from resources.kafka import KafkaResource
from resources.lake import LakeResource, default_home
from resources.slicing import SlicingResource
from resources.spark import SparkResource

__all__ = ["KafkaResource", "LakeResource", "SettingError", "SlicingResource", "SparkResource", "default_home"]


class SettingError(ValueError):
    """A setting from the environment that does not parse, named in the message: the command
    line says it on one line (status 2), and the code location's load error names it."""
