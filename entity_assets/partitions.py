"""Slice partitions: one dynamic partition per closed slice, keyed by its zero-padded sequence."""

from dagster import DynamicPartitionsDefinition

slices_partitions = DynamicPartitionsDefinition(name="slices")
