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
    update reads back on the copy and is lost where it counts. The copy holds every setting as
    made (a default computed from the environment, such as `LakeResource.root`, is fixed then);
    `EnvVar` settings stay `EnvVar`s."""
    if unknown := sorted(set(settings) - set(type(resource).model_fields)):
        raise TypeError(f"{type(resource).__name__} has no setting {', '.join(unknown)}")
    return type(resource)(**{**resource.model_dump(), **settings})
