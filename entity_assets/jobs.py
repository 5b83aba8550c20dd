"""The slice job: every slice-partitioned asset, one run per slice."""

from dagster import AssetSelection, define_asset_job

from entity_assets.partitions import slices_partitions

slice_job = define_asset_job(
    "slice_job",
    selection=AssetSelection.all(),
    partitions_def=slices_partitions,
    description="Materializes one slice through the whole graph, from Kafka records to device notifications.",
)
