"""Typed Dagster resources: Spark, Kafka, the Delta lake, and the slice policy."""

from resources.kafka import KafkaResource
from resources.lake import LakeResource, default_home
from resources.slicing import SlicingResource
from resources.spark import SparkResource

__all__ = ["KafkaResource", "LakeResource", "SlicingResource", "SparkResource", "default_home"]
