"""Which failures a step retries (`assets.retries.transient`): blips of Kafka, the store, Spark Connect."""

import grpc
import pytest
from confluent_kafka import KafkaError, KafkaException
from deltalake.exceptions import CommitFailedError
from pyspark.errors.exceptions.connect import PythonException, SparkConnectGrpcException

from entity_assets.assets.common import OutOfOrder
from entity_assets.assets.retries import retries, transient
from entity_assets.kafka_io import DeliveryFailed, KafkaUnreachable
from resources import SettingError


def _raised_from(outer: Exception, inner: Exception) -> Exception:
    try:
        try:
            raise inner
        except Exception as exc:
            raise outer from exc
    except Exception as exc:
        return exc


def _task_failure(last_line: str) -> PythonException:
    """A Spark task's exception as the driver gets it: the worker's traceback, as text (here from
    Spark Connect; a classic session's is pyspark's captured PythonException, the same text)."""
    return PythonException(message=f"An exception was thrown from the Python worker.\nTraceback (most recent call last):\n"
                           f'  File "fold.py", line 1, in task\n{last_line}\n')


@pytest.mark.parametrize("exc", [
    KafkaException(KafkaError(KafkaError._TRANSPORT)), KafkaUnreachable("no metadata"), DeliveryFailed("undelivered"),
    OSError("AWS Error NETWORK_CONNECTION"), ConnectionResetError(), TimeoutError("stalled"),
    CommitFailedError("a concurrent commit"), _raised_from(RuntimeError("wrapped"), OSError("the store")),
    _task_failure("confluent_kafka.KafkaException: KafkaError{code=_TRANSPORT}"),
    _task_failure("OSError: When reading information for key 'lake/x.parquet': AWS Error NETWORK_CONNECTION"),
    _task_failure("TimeoutError: entity-batches[0] stalled at 10 before 20"),
    SparkConnectGrpcException(message="failed to connect to all addresses", grpc_status_code=grpc.StatusCode.UNAVAILABLE),
])
def test_blips_are_transient(exc):
    assert transient(exc)


@pytest.mark.parametrize("exc", [
    ValueError("a bug"), KeyError("x"), RuntimeError("a bug"), OutOfOrder("slice 2 before slice 1"),
    FileNotFoundError("vacuumed"), PermissionError("denied"),
    _task_failure("ValueError: Exceeds the limit (4300 digits)"),
    _task_failure("FileNotFoundError: lake/entities/x.parquet"),
    SparkConnectGrpcException(message="[TABLE_OR_VIEW_NOT_FOUND]", grpc_status_code=grpc.StatusCode.INTERNAL),
])
def test_bugs_refusals_and_missing_files_are_not(exc):
    assert not transient(exc)


def test_retries_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("ENTITY_ASSETS_STEP_RETRIES", "5")
    assert retries() == 5
    monkeypatch.setenv("ENTITY_ASSETS_STEP_RETRIES", "0")
    assert retries() == 0
    monkeypatch.setenv("ENTITY_ASSETS_STEP_RETRIES", "")
    assert retries() == 3
    monkeypatch.setenv("ENTITY_ASSETS_STEP_RETRIES", "-1")
    with pytest.raises(SettingError, match="ENTITY_ASSETS_STEP_RETRIES='-1' is not a count"):
        retries()
