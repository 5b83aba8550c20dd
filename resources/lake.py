"""The lake: every Delta table read and write goes through this resource."""

from __future__ import annotations

import os
import re
from typing import Literal

from dagster import ConfigurableResource
from pydantic import Field, field_validator

from entity_assets import shards
from entity_assets.storage import DeltaRsEngine
from resources.deployed import Deployed


def default_home() -> str:
    """Project-local state (broker data, lake, Dagster storage) unless ENTITY_ASSETS_HOME says otherwise."""
    return os.path.abspath(os.environ.get("ENTITY_ASSETS_HOME", "").strip() or ".entity-assets")  # set blank: unset


LEAST_RETENTION_HOURS = 1
"""The least `ENTITY_ASSETS_VACUUM_RETENTION_HOURS` a deployment may set: the vacuum deletes the
files no version names once they are this old, and a slice's files are named by none until its
commit, so at 0 a maintenance beside an `entity-assets run` (which the lake pool does not order)
deleted the files the run was about to commit. A test's lake, made directly, may take 0."""


class LakeResource(Deployed, ConfigurableResource):
    """Root URI and engine of the Delta lake.

    `delta-rs` commits the parquet files Spark tasks write with pyarrow. Another engine would
    have to keep this one's file and commit-info conventions, not only its methods: the assets
    rely on them (docs/storage.md, where delta-spark fits).
    """

    root: str = Field(default_factory=lambda: os.path.join(default_home(), "lake"),
                      description="local folder or object-store URI (s3://, abfss://, gs://)")
    storage_options: dict[str, str] = Field(default_factory=dict, description="delta-rs/object-store options; secrets via EnvVar")
    engine: Literal["delta-rs"] = Field(default="delta-rs", description="table engine; delta-rs is the one shipped")
    vacuum_retention_hours: int = Field(
        default=168, ge=0,
        description="lake_maintenance deletes files replaced longer ago than this, and Delta log files as old; "
                    "time travel and replays reach back as far (the environment's variable: at least "
                    f"{LEAST_RETENTION_HOURS})",
    )

    state_file_rows: int = Field(
        default=shards.FILE_ROWS, ge=1,
        description="row bound of a state file: a slice rewrites the files holding the keys it changed, "
                    "so smaller files rewrite less per small slice and make more files per table",
    )

    @field_validator("root")
    @classmethod
    def _uri_or_path(cls, root: str) -> str:
        """`s3:/bucket/lake` (one slash) would be a local folder of that name, beside the code server."""
        if not root.strip() or root != root.strip() or (re.match(r"[A-Za-z][\w+.-]+:", root) and "://" not in root):
            raise ValueError(f"root {root!r} is neither a folder nor a URI (scheme://…)")
        return root

    def open(self, *, snapshot: bool = False) -> DeltaRsEngine:
        """`snapshot`: for one step of a run, which reads each table as of its first look (see `DeltaRsEngine`)."""
        root = self.root if "://" in self.root else os.path.abspath(self.root)
        return DeltaRsEngine(root, self.storage_options, snapshot=snapshot)
