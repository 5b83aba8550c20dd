"""Slice partitions: one dynamic partition per closed slice, keyed by its zero-padded sequence."""

from dagster import DynamicPartitionsDefinition

slices_partitions = DynamicPartitionsDefinition(name="slices")

LAKE_POOL = "entity-assets-lake"
"""The concurrency pool of every step that writes the lake. dagster.yaml gives it one run at a
time (run granularity), whoever launched the run: the sensor, a backfill or the UI's
Materialize. The run queue is first in, first out, so slices apply in the order requested."""
