"""The slice job: every slice-partitioned asset, one run per slice."""

from dagster import AssetSelection, define_asset_job, in_process_executor

from entity_assets.partitions import slices_partitions

PIPELINE_TAG = "entity-assets/pipeline"
"""dagster.yaml limits runs with this tag to one at a time, so slices apply in order."""

slice_job = define_asset_job(
    "slice_job",
    selection=AssetSelection.all(),
    partitions_def=slices_partitions,
    # In-process: all steps of a run share one SparkSession (one JVM start per run, not per step).
    executor_def=in_process_executor,
    tags={PIPELINE_TAG: "slices"},
    description="Materializes one slice through the whole graph, from Kafka records to device notifications.",
)
