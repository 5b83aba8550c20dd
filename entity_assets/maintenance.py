"""Lake maintenance: vacuum the files that copy-on-write, re-runs and failed publishes leave behind,
and expire old Delta log files, which the slices' commits leave to it."""

from dagster import AssetKey, AssetObservation, DefaultScheduleStatus, OpExecutionContext, ScheduleDefinition, job, op

from entity_assets.assets.common import OUTBOX_FOLDER
from entity_assets.manifests import TABLE as MANIFESTS
from entity_assets.partitions import LAKE_POOL
from entity_assets.tables import SCHEMAS
from resources import LakeResource

ASSET_TABLES = frozenset(SCHEMAS) - {"pending_responses", "device_inboxes"}
"""Tables that are assets of the graph; the others are internal state, observed by name only in the log."""


# In the lake pool, so never beside a slice run: vacuum also deletes files not yet committed,
# which a running slice's tasks are writing.
@op(out={}, pool=LAKE_POOL,
    description="Deletes files no Delta version within the retention needs, and expired log files, table by table.")
def vacuum_lake(context: OpExecutionContext, lake: LakeResource):
    """A state table rewrites the files of the keys each slice changed: the replaced files stay for time
    travel until this deletes them. Log entries go at the same age: a version whose replaced files
    are gone cannot be read, and every commit lists the whole log (docs/storage.md)."""
    engine, hours = lake.open(), lake.vacuum_retention_hours
    total = 0
    for table in [*SCHEMAS, MANIFESTS]:
        if not engine.exists(table):
            continue
        # the sensor writes manifests outside the pool: one it is committing is named by no version yet
        deleted = engine.vacuum(table, hours, full=table != MANIFESTS)
        expired = engine.expire_log(table, hours, record_done=table != MANIFESTS)
        total += len(deleted) + expired
        context.log.info(f"{table}: {len(deleted)} file(s) deleted, {expired} expired log file(s) (retention {hours} h)")
        if table in ASSET_TABLES:
            yield AssetObservation(asset_key=AssetKey(table), metadata={
                "vacuumed_files": len(deleted), "retention_hours": hours, "expired_log_files": expired})
    # spools of steps that failed between their commit and their publish (a re-run publishes again)
    stale = engine.delete_older(OUTBOX_FOLDER, hours)
    context.log.info(f"{OUTBOX_FOLDER}: {len(stale)} unpublished spool file(s) deleted (retention {hours} h)")
    context.log.info(f"vacuum: {total + len(stale)} file(s) deleted in {engine.root}")


@job(description="Vacuums every table of the lake (LakeResource.vacuum_retention_hours) and expires its old log files.")
def lake_maintenance():
    vacuum_lake()


lake_maintenance_schedule = ScheduleDefinition(
    job=lake_maintenance, cron_schedule="0 3 * * *", execution_timezone="UTC", default_status=DefaultScheduleStatus.RUNNING,
    description="Daily vacuum and log expiry, so the lake does not grow by the state's size at every slice.",
)
