"""A run's resources against the deployment's environment."""

from __future__ import annotations

from dagster import InitResourceContext


class Deployed:
    """Refuses a run whose resource differs from what the environment sets. Dagster takes the
    environment's values as a resource's default config, and a run config (the launchpad) that
    sets one field replaces that whole default: the other fields with a fixed default fall back
    to it, so a slice run given a partition count alone would read and publish on the local
    broker, or `lake_maintenance` given a state-file size alone vacuum at a 7-day retention."""

    def setup_for_execution(self, context: InitResourceContext) -> None:
        if context.run is None:  # a sensor's tick: `entity-assets run` ticks with its own slicing
            return
        from entity_assets.definitions import drifted
        from resources import SettingError

        if differ := drifted(self):
            raise SettingError(
                "this run's config sets resource fields that the environment sets otherwise, which Dagster "
                f"does when a run config gives some of a resource's fields: {'; '.join(differ)}. Set them in the "
                "environment (docs/operations.md, Configuration), or give every field the deployment sets")
