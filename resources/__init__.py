"""Typed Dagster resources: Spark, Kafka, the Delta lake, and the slice policy."""

from resources.kafka import KafkaResource
from resources.lake import LakeResource, default_home
from resources.slicing import SlicingResource
from resources.spark import SparkResource

__all__ = ["KafkaResource", "LakeResource", "SettingError", "SlicingResource", "SparkResource", "default_home",
           "with_settings"]


class SettingError(ValueError):
    """A setting from the environment that does not parse, named in the message: the command
    line says it on one line (status 2), and the code location's load error names it."""


def with_settings(resource, **settings):
    """A copy of a resource with some settings changed. Not `model_copy(update=...)`: Dagster
    builds a run's or a sensor's resource from the settings it was constructed with, so such an
    update reads back on the copy and is lost where it counts."""
    return type(resource)(**{**resource.model_dump(), **settings})
