"""The slice job (every slice-partitioned asset, one run per slice), and two reads for the UI's
launchpad: the trace of one input record and the history of one entity."""

import json

from dagster import AssetSelection, Config, Failure, MetadataValue, Nothing, OpExecutionContext, Out, Output, \
    define_asset_job, job, op
from pydantic import Field

from entity_assets.assets.common import fenced, md_cell
from entity_assets.history import Diverged, as_of, entity_history
from entity_assets.trace import format_trail, parse_record, trace
from resources import KafkaResource, LakeResource

slice_job = define_asset_job(
    "slice_job",
    selection=AssetSelection.all(),
    description="Materializes one slice through the whole graph, from Kafka records to device notifications.",
)


class TraceConfig(Config):
    record: str = Field(description="TOPIC:PARTITION:OFFSET of an input record; an input stream's name stands for "
                                    "its topic (entity-batches:0:17)")


@op(out=Out(Nothing), description="One input record's rows in every table of its slice, down to the devices it notified.")
def trace_record(context: OpExecutionContext, config: TraceConfig, lake: LakeResource, kafka: KafkaResource):
    """What `entity-assets trace` prints, as the run's output metadata, so row-level lineage is a
    launch from the UI's launchpad away: it reads the lake and writes nothing. Whole rows and
    documents (a dead letter's value can be megabytes) stay out of the event log: `entity-assets
    trace --json`."""
    try:
        record = parse_record(config.record, kafka.topic_named)
    except ValueError as exc:
        raise Failure(str(exc)) from None
    trail = trace(lake.open(), *record)
    text = format_trail(trail, shown=SHOWN_ROWS)
    if trail.slice is None:
        raise Failure(text)
    context.log.info(text)
    yield Output(None, metadata={
        "slice": trail.slice, "rows": MetadataValue.json({t: len(rows) for t, rows in trail.rows.items()}),
        "devices": MetadataValue.json({"count": len(trail.inboxes), "first": [
            {**inbox, "notifications": inbox["notifications"][:SHOWN_ROWS],
             "unacknowledged": inbox["unacknowledged"][:SHOWN_ROWS]} for inbox in trail.inboxes[:SHOWN_ROWS]]}),
        "trail": MetadataValue.md(fenced(text)),
        "states": MetadataValue.json({t: [{k: v for k, v in r.items() if k != "document"} for r in rows[:SHOWN_ROWS]]
                                      for t, rows in trail.states.items()})})


SHOWN_ROWS = 50
"""Rows of each table, devices and their notification ids a trace run's output lists: its
event log is read by the UI; `entity-assets trace` lists them all."""


@job(description="Traces one input record (config: record = TOPIC:PARTITION:OFFSET) through the lake; writes nothing.")
def trace_job():
    trace_record()


class HistoryConfig(Config):
    dbid: str = Field(description="the entity's database (its dbid)")
    collection: str = Field(description="the entity's collection")
    zone: str = Field(description="the entity's zone (a CDC entity's: its source's zone, else its system)")
    entity: str = Field(description="the entity's id")
    slice: int | None = Field(default=None, description="the version current after this slice (its number); with "
                                                        "neither this nor `at`, the latest")
    at: int | None = Field(default=None, description="the version current at this time (epoch milliseconds, as "
                                                     "begun and ended)")


SHOWN_DOCUMENT_CHARS = 100_000
"""The JSON of a document a history run's metadata holds whole; a larger one (up to 16 MB) is cut."""
SHOWN_VERSIONS = 50
"""Versions listed in a history run's metadata (the newest); `entity-assets history` lists all."""


@op(out=Out(Nothing), description="An entity's versions replayed from entity_updates, and its document as of a slice or time.")
def entity_versions(context: OpExecutionContext, config: HistoryConfig, lake: LakeResource):
    """What `entity-assets history` prints, as the run's output metadata: it reads the lake and
    writes nothing."""
    key = f"{config.dbid}/{config.collection}/{config.zone}/{config.entity}"
    if config.slice is not None and config.at is not None:
        raise Failure("give slice or at, not both")
    try:
        versions = entity_history(lake.open(), config.dbid, config.collection, config.zone, config.entity)
    except Diverged as exc:
        raise Failure(str(exc)) from None
    when = (f"slice {config.slice}" if config.slice is not None else f"time {config.at}" if config.at is not None
            else "now")
    found = as_of(versions, slice=config.slice, time=config.at)
    if found is None:
        raise Failure(f"{key} did not exist as of {when}: {len(versions)} version(s) in entity_updates")
    lines = [f"| v{v['version']} | {v['slice']} | {v['valid_from']} | {v['valid_to'] or ''} | {v['action']} | "
             f"{md_cell(str(v['clientid']))}/{v['request']}/{v['part']} |" for v in versions[-SHOWN_VERSIONS:]]
    context.log.info(f"{key}: {len(versions)} version(s); as of {when}, version {found['version']}")
    metadata = {"versions": len(versions), "as_of": when, "version": found["version"], "deleted": found["deleted"],
                "history": MetadataValue.md("| version | slice | valid from | valid to | action | request |\n"
                                            "|---|---|---|---|---|---|\n" + "\n".join(lines))}
    if not found["deleted"]:
        text = json.dumps(found["document"])  # a document may be 16 MB: the UI's event log gets a part
        metadata["document"] = MetadataValue.json(found["document"]) if len(text) <= SHOWN_DOCUMENT_CHARS else \
            MetadataValue.text(f"{text[:SHOWN_DOCUMENT_CHARS]}... ({len(text)} characters: entity-assets history --json)")
    yield Output(None, metadata=metadata)


@job(description="An entity's history (config: dbid, collection, zone, entity; slice or at for a past version); writes nothing.")
def history_job():
    entity_versions()
