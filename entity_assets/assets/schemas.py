"""Schema learning: the entity-type schema inferred per collection from the learning stream."""

import json
from functools import partial

from dagster import (
    AssetCheckResult,
    AssetCheckSeverity,
    AssetCheckSpec,
    AssetExecutionContext,
    AssetSpec,
    MaterializeResult,
    MetadataValue,
    multi_asset,
)

from entity_assets import core, fold
from entity_assets.assets.common import (
    LAKE_KINDS, applied_version, collect_tasks, commit_state, ensure_tables, file_tasks, require_inputs, slice_of,
    state_as_of, table_metadata, task_slots,
)
from entity_assets.assets.retries import retried_when_transient
from entity_assets.learning import Summary, disagreements, entity_types, infer
from entity_assets.partitions import LAKE_POOL, slices_partitions
from entity_assets.patch import escape_token, shown
from entity_assets.storage import FileWriter
from entity_assets.tables import SCHEMAS
from resources import LakeResource, SlicingResource, SparkResource


@multi_asset(
    name="learn_schemas",
    specs=[AssetSpec("learned_schemas", deps=["schema_learning", "schemas"], group_name="schemas",
                     kinds=LAKE_KINDS,
                     description="Per database and collection, the entity-type schema learned from the learning "
                                 "stream, starting from the declared schema; evolves slice by slice.")],
    check_specs=[AssetCheckSpec("entities_match_declared_schema", asset="learned_schemas",
                                description="learned entities agree with the declared schema; a warning lists each "
                                            "collection's undeclared fields, type conflicts and required fields missing")],
    partitions_def=slices_partitions, pool=LAKE_POOL,
)
@retried_when_transient
def learn_schemas(context: AssetExecutionContext, spark: SparkResource, lake: LakeResource, slicing: SlicingResource):
    """Spark tasks summarize their rows; the driver merges summaries, never documents."""
    engine, key = lake.open(snapshot=True), slice_of(context)
    ensure_tables(engine, key, ["learned_schemas"], reads=["schema_learning", "schemas"])
    require_inputs(engine, key, ("schema_learning", "schema_updates"), "learn_schemas")  # the latter's statuses below
    apply, version, _ = state_as_of(engine, "learned_schemas", key)
    # each task summarizes the rows of its files (no shuffle); summaries merge exactly
    schemas_version = applied_version(engine, "schemas", key, "learn_schemas")  # refused before schemas has the slice
    files = engine.slice_files("schema_learning", [key])
    rows_in = sum(f.rows for f in files)
    if not rows_in and (engine.column_bounds("schema_updates", key, "status") or (0,))[0] != core.STATUS_OK:
        # no learning request and no schema update applied in the slice (status 1; schema-updates holds
        # failed ones too): nothing learned nor declared changes
        yield from _unchanged(engine, key, apply, version)
        return
    tasks = file_tasks(files, slicing.max_messages_per_task, task_slots(spark, rows_in))
    partials = collect_tasks(spark, tasks, partial(fold.learn_task, storage_options=engine.storage_options), rows_in)

    summaries: dict[tuple[str, str], Summary] = {}
    for row in engine.read("learned_schemas", version).to_pylist():
        summaries[(row["dbid"], row["collection"])] = Summary.from_json(row["summary"])
    now: dict[tuple[str, str], Summary] = {}  # what this slice learned
    for row in partials:
        now.setdefault((row["dbid"], row["collection"]), Summary()).merge(Summary.from_json(row["summary"]))
    for collection, learned in now.items():
        summaries.setdefault(collection, Summary()).merge(learned)

    declared: dict[tuple[str, str], dict] = {}
    for row in engine.read("schemas", schemas_version).to_pylist():
        if not row["deleted"] and row["document"]:
            for collection, entity_type in entity_types(json.loads(row["document"])).items():
                declared[(row["dbid"], collection)] = entity_type

    rows = []
    for dbid, collection in sorted(set(summaries) | set(declared)):
        summary = summaries.get((dbid, collection), Summary())
        decl = declared.get((dbid, collection))
        if not summary.observed and decl is None:
            continue  # a type declared once, never learned, and since removed or renamed: none now
        issues = disagreements(summary, decl) if summary.observed else []
        rows.append({"slice": key, "dbid": dbid, "collection": collection, "observed": summary.observed,
                     "declared": None if decl is None else json.dumps(decl, sort_keys=True),
                     "learned": json.dumps(infer(summary, decl), sort_keys=True), "summary": summary.to_json(),
                     "disagreements": json.dumps(issues)})
    result = {"rows": len(rows), "files": 0}
    if not apply:  # a replay recomputes the check but leaves the state as it is (its slice's version)
        result["version"] = engine.version_after("learned_schemas", key, "apply")
    else:
        writer = FileWriter("learned_schemas", engine.uri("learned_schemas"), SCHEMAS["learned_schemas"], key,
                            storage_options=engine.storage_options)
        for row in rows:
            writer.append(row)
        files = writer.close()
        result.update(files=len(files), version=commit_state(engine, "learned_schemas", key, files,
                                                            engine.files("learned_schemas", version)))
    meta = table_metadata(engine, "learned_schemas", result)
    meta.update(collections=MetadataValue.int(len(rows)),
                observed_this_slice=MetadataValue.int(sum(learned.observed for learned in now.values())),
                replayed=MetadataValue.bool(not apply))
    yield MaterializeResult(asset_key="learned_schemas", metadata=meta)
    yield _declared_schema_check({f"{escape_token(dbid)}/{escape_token(collection)}": issues
                                  for (dbid, collection), learned in sorted(now.items())
                                  if (issues := disagreements(learned, declared.get((dbid, collection))))})


def _unchanged(engine, key: str, apply: bool, version: int | None):
    """The slice leaves every collection as the slice before did: its state commit records the
    slice and changes no file, and the check has no learned entity to find at odds, without
    reading nor inferring the summaries, which grow with every field name learned (to
    `learning.MAX_PATHS` paths a collection)."""
    stored = engine.read("learned_schemas", version, columns=["dbid"])
    result = {"rows": stored.num_rows, "files": 0,
              "version": commit_state(engine, "learned_schemas", key, [], []) if apply
              else engine.version_after("learned_schemas", key, "apply")}
    meta = table_metadata(engine, "learned_schemas", result)
    meta.update(collections=MetadataValue.int(stored.num_rows), observed_this_slice=MetadataValue.int(0),
                replayed=MetadataValue.bool(not apply))
    yield MaterializeResult(asset_key="learned_schemas", metadata=meta)
    yield _declared_schema_check({})


SHOWN = 50
"""Collections, and disagreements of each, that the check's metadata shows: a document used as a
map makes a field per key, and the event log keeps the metadata of every slice. The
learned_schemas rows keep every disagreement."""


def _declared_schema_check(report: dict[str, list[dict]]) -> AssetCheckResult:
    """A warning, not a failure: it reports what clients sent in the slice, which the pipeline
    learned all the same; the slice's alone, so that it passes again once clients conform, where
    learned_schemas' `disagreements` keep every entity learned. The counts are numbers so that
    the UI plots them slice by slice."""
    return AssetCheckResult(
        asset_key="learned_schemas", check_name="entities_match_declared_schema", passed=not report,
        severity=AssetCheckSeverity.WARN,
        metadata={"collections_disagreeing": MetadataValue.int(len(report)),
                  "disagreement_count": MetadataValue.int(sum(len(issues) for issues in report.values())),
                  # names and paths cut, as zone names are: a client's field name may be 900 KB
                  "disagreements": MetadataValue.json(_shown_report(report))})


def _shown_report(report: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """The first collections' first issues, names cut; two names alike once cut stay two entries."""
    out: dict[str, list[dict]] = {}
    for name, issues in sorted(report.items())[:SHOWN]:
        key = shown(name)
        out[key if key not in out else f"{key} #{len(out) + 1}"] = [{**issue, "path": shown(issue["path"])}
                                                                      for issue in issues[:SHOWN]]
    return out
