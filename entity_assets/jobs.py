"""The slice job (every slice-partitioned asset, one run per slice) and the trace of one input record."""

from dagster import AssetSelection, Config, Failure, MetadataValue, Nothing, OpExecutionContext, Out, Output, \
    define_asset_job, job, op

from entity_assets.partitions import slices_partitions
from entity_assets.trace import format_trail, parse_record, trace
from resources import KafkaResource, LakeResource

slice_job = define_asset_job(
    "slice_job",
    selection=AssetSelection.all(),
    partitions_def=slices_partitions,
    description="Materializes one slice through the whole graph, from Kafka records to device notifications.",
)


class TraceConfig(Config):
    record: str
    """TOPIC:PARTITION:OFFSET of an input record; an input stream's name stands for its topic."""


@op(out=Out(Nothing), description="One input record's rows in every table of its slice, down to the devices it notified.")
def trace_record(context: OpExecutionContext, config: TraceConfig, lake: LakeResource, kafka: KafkaResource):
    """What `entity-assets trace` prints, as the run's output metadata, so row-level lineage is a
    launch from the UI's launchpad away: it reads the lake and writes nothing. Whole rows and
    documents (a dead letter's value can be megabytes) stay out of the event log: `entity-assets
    trace --json`."""
    try:
        record = parse_record(config.record, kafka.topic)
    except ValueError as exc:
        raise Failure(str(exc)) from None
    trail = trace(lake.open(), *record)
    text = format_trail(trail)
    if trail.slice is None:
        raise Failure(text)
    context.log.info(text)
    yield Output(None, metadata={
        "slice": trail.slice, "rows": MetadataValue.json({t: len(rows) for t, rows in trail.rows.items()}),
        "devices": MetadataValue.json(trail.inboxes), "trail": MetadataValue.md(f"```\n{text}\n```"),
        "states": MetadataValue.json({t: [{k: v for k, v in r.items() if k != "document"} for r in rows]
                                      for t, rows in trail.states.items()})})


@job(description="Traces one input record (config: record = TOPIC:PARTITION:OFFSET) through the lake; writes nothing.")
def trace_job():
    trace_record()
