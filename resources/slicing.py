"""Slice sizing policy, shared by the sensor and the ingest step."""

from __future__ import annotations

from typing import Literal

from dagster import ConfigurableResource
from pydantic import Field

from entity_assets.slices import SlicePolicy
from resources.deployed import Deployed


class SlicingResource(Deployed, ConfigurableResource):
    """How offsets become slices. See docs/slices.md for how to size these."""

    min_interval_seconds: float = Field(default=900.0, ge=0, description="minimum time between two slices")
    max_messages: int = Field(default=5_000_000, gt=0, description="upper bound of messages in one slice")
    max_messages_per_task: int = Field(default=200_000, gt=0, description="Kafka records one Spark task reads")
    dedupe_window_slices: int = Field(
        default=4, ge=0, description="earlier slices searched for redelivered requests (an hour at the default interval)")
    schema_wait_slices: int = Field(
        default=4, ge=0, description="slices a Qlik data message waits for its schema's metadata message before it is "
                                     "also a dead letter (EA-SCHEMA-UNKNOWN); the slice that registers it applies it")
    parts_wait_slices: int = Field(
        default=96, ge=0, description="slices a request of several parts waits for its missing parts, counted from "
                                      "the slice of its first (a day at the default interval); then its pending parts "
                                      "are dropped and the no_request_expired check names it (0: no request "
                                      "waits past the slice of its first part)")
    offsets_went_back: Literal["report", "restart", "continue"] = Field(
        default="report", description="a partition whose offsets went below the slices' (a topic created again, "
                                      "another cluster, a log cut short): report it at every tick and hold its "
                                      "topic, read the topic again from its first offsets, or continue from the "
                                      "slices' offsets once each partition's end is past them")

    def policy(self) -> SlicePolicy:
        return SlicePolicy(self.min_interval_seconds, self.max_messages)
