"""Which failures a step retries (`assets.retries.transient`): blips of Kafka and the store, not
bugs, refusals or denied access."""

import pytest
from confluent_kafka import KafkaError, KafkaException
from deltalake.exceptions import CommitFailedError
from py4j.protocol import Py4JJavaError
from pyspark.errors.exceptions.connect import PythonException

from entity_assets.assets.common import OutOfOrder
from entity_assets.assets.retries import last_error, retries, transient
from entity_assets.kafka_io import DeliveryFailed, KafkaUnreachable
from resources import SettingError

WORKER = "An exception was thrown from the Python worker:\nTraceback (most recent call last):\n" \
         '  File "fold.py", line 1, in task\n    read()\n'
HANDLING = "\nDuring handling of the above exception, another exception occurred:\n\n"


def _raised_from(outer: Exception, inner: Exception, explicit: bool = True) -> Exception:
    try:
        try:
            raise inner
        except Exception as exc:
            if explicit:
                raise outer from exc
            raise outer
    except Exception as exc:
        return exc


def _task_failure(traceback_end: str) -> PythonException:
    """A Spark task's exception as the driver gets it: the worker's traceback as text (as pyspark
    4.2 gives it, `captured.PythonException` of a classic session; this one, Spark Connect's)."""
    return PythonException(message=WORKER + traceback_end + "\n")


class _JobAborted(Py4JJavaError):
    """A Java job failure around a task's Python traceback, as py4j gives other paths' failures."""

    def __init__(self, text: str):
        Exception.__init__(self, text)
        self.text = text

    def __str__(self) -> str:
        return self.text


@pytest.mark.parametrize("exc", [
    KafkaException(KafkaError(KafkaError._TRANSPORT)), KafkaUnreachable("no metadata"), DeliveryFailed("undelivered"),
    OSError("AWS Error NETWORK_CONNECTION"), ConnectionResetError(), TimeoutError("stalled"),
    CommitFailedError("a concurrent commit"), _raised_from(RuntimeError("wrapped"), OSError("the store")),
    _task_failure("confluent_kafka.KafkaException: KafkaError{code=_TRANSPORT}"),
    _task_failure("OSError: When reading information for key 'lake/x.parquet': AWS Error NETWORK_CONNECTION"),
    _task_failure("TimeoutError: entity-batches[0] stalled at 10 before 20"),
    _task_failure("ValueError: a parse" + HANDLING + "Traceback (most recent call last):\nOSError: the store"),
    _JobAborted("py4j.protocol.Py4JJavaError: An error occurred while calling o42.collect.\n"
                ": org.apache.spark.SparkException: Job aborted due to stage failure: Task 0 failed: "
                "org.apache.spark.api.python.PythonException: Traceback (most recent call last):\n"
                '  File "kafka_io.py", line 170, in read_range\nconfluent_kafka.KafkaException: _TRANSPORT\n'
                "\tat org.apache.spark.api.python.BasePythonRunner.handlePythonException(PythonRunner.scala:1)\n"
                "Driver stacktrace:\n\tat org.apache.spark.scheduler.DAGScheduler.failJobAndIndependentStages(x)\n"),
])
def test_blips_are_transient(exc):
    assert transient(exc)


@pytest.mark.parametrize("exc", [
    ValueError("a bug"), KeyError("x"), RuntimeError("a bug"), OutOfOrder("slice 2 before slice 1"),
    FileNotFoundError("vacuumed"), PermissionError("denied"),
    _raised_from(ValueError("a bug while handling a blip"), OSError("the store"), explicit=False),
    OSError("When writing 'lake/x.parquet': AWS Error ACCESS_DENIED during PutObject operation"),
    KafkaException(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED, "Topic authorization failed")),
    DeliveryFailed("producing to ['entity-updates'] failed: [KafkaError{code=TOPIC_AUTHORIZATION_FAILED}]"),
    # a record the broker or the producer will never take: a retry would publish the slice again
    DeliveryFailed("producing to ['entity-updates'] failed: [KafkaError{code=MSG_SIZE_TOO_LARGE,val=10,"
                   "str=\"Broker: Message size too large\"}]"),
    _task_failure("ValueError: Exceeds the limit (4300 digits)"),
    _task_failure("FileNotFoundError: lake/entities/x.parquet"),
    _task_failure("OSError: the store" + HANDLING + "Traceback (most recent call last):\nKeyError: 'bucket'"),
])
def test_bugs_refusals_missing_files_and_denied_access_are_not(exc):
    assert not transient(exc)


def test_the_last_error_of_a_traceback_is_the_one_raised():
    assert last_error(WORKER + "ValueError: a parse" + HANDLING + "Traceback (most recent call last):\n"
                      "entity_assets.kafka_io.DeliveryFailed: undelivered\n") == "entity_assets.kafka_io.DeliveryFailed"
    assert last_error(WORKER + "KeyboardInterrupt\n") == "KeyboardInterrupt"
    assert last_error("An error occurred") is None


def test_retries_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("ENTITY_ASSETS_STEP_RETRIES", "5")
    assert retries() == 5
    monkeypatch.setenv("ENTITY_ASSETS_STEP_RETRIES", "0")
    assert retries() == 0
    monkeypatch.setenv("ENTITY_ASSETS_STEP_RETRIES", "")
    assert retries() == 3
    for text in ("-1", "\u00b2"):
        monkeypatch.setenv("ENTITY_ASSETS_STEP_RETRIES", text)
        with pytest.raises(SettingError, match="ENTITY_ASSETS_STEP_RETRIES=.* is not a count"):
            retries()
