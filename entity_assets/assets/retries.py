"""Step retries on transient failures: a broker's leader election, an object store's brief outage.

A step that fails on one of these is retried inside its run (Dagster's `RetryRequested`), so it
keeps the run's place in the lake pool and the slices' order: a failed run would leave every
later slice refused (OutOfOrder) until someone re-ran it. Other failures are not retried: a
refusal (`OutOfOrder`, a layout), a bug, a denied access. Nor is a terminated run: a
`RetryPolicy` would retry the interrupt that terminating a run sends, and the run would go on.
"""

import functools
import inspect
import os
import re

from confluent_kafka import KafkaError, KafkaException
from dagster import RetryRequested

from entity_assets.kafka_io import DeliveryFailed, KafkaUnreachable
from resources import SettingError

RETRIES_VARIABLE = "ENTITY_ASSETS_STEP_RETRIES"
DEFAULT_RETRIES = 3
RETRY_DELAY_SECONDS = 30
"""The first retry's wait; each next one waits twice as long (30, 60, 120 s: 3.5 minutes in all)."""

_NOT_TRANSIENT = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)
_TRANSIENT_NAMES = re.compile(
    r"(?:[\w.]+\.)?(KafkaException|KafkaUnreachable|DeliveryFailed|TimeoutError|ConnectionError|"
    r"ConnectionResetError|ConnectionRefusedError|BrokenPipeError|OSError|CommitFailedError)$")
"""The exceptions a Spark task's traceback may end with that are transient (a task's exception
reaches the driver as text)."""
_DENIED = re.compile(r"AUTHORIZATION_FAILED|AUTHENTICATION|ACCESS_DENIED|AccessDenied|Forbidden|InvalidAccessKeyId|"
                     r"SignatureDoesNotMatch|NO_SUCH_BUCKET|NoSuchBucket|AuthorizationFailure|AuthenticationFailed|"
                     r"INVALID_REPLICATION_FACTOR|INVALID_PARTITIONS|POLICY_VIOLATION|INVALID_CONFIG|_INVALID_ARG|"
                     r"MSG_SIZE_TOO_LARGE|RECORD_LIST_TOO_LARGE|INVALID_RECORD|INVALID_MSG")
"""What Kafka and the object stores say of a setting or a right that is missing, or of a record
they will never take: no wait brings it, and each retry would publish the slice's messages again."""
_ERROR_LINE = re.compile(r"^(?!(?:org|java|scala|py4j)\.)([\w.]+)(?::|$)")


def last_error(text: str) -> str | None:
    """The exception that ends the (last) Python traceback in a Spark task failure's text: the
    one the task raised, not one it was handling (the "During handling" tracebacks before it)."""
    names = [m.group(1) for line in text.splitlines() if (m := _ERROR_LINE.match(line))]
    return names[-1] if names else None


def transient(exc: BaseException) -> bool:
    """Whether `exc`, or the exception it was raised from (`raise ... from`), is a failure that a
    later attempt may not meet: not a denied access, which reads as an outage to pyarrow and librdkafka."""
    from deltalake.exceptions import CommitFailedError
    from py4j.protocol import Py4JJavaError
    from pyspark.errors.exceptions.base import PythonException

    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if _DENIED.search(str(exc)):
            return False
        if isinstance(exc, (PythonException, Py4JJavaError)):  # a Spark task's
            return bool(_TRANSIENT_NAMES.fullmatch(last_error(str(exc)) or ""))
        if isinstance(exc, KafkaException) and exc.args and isinstance(exc.args[0], KafkaError) and exc.args[0].fatal():
            return False  # the client is unusable: a producer fenced, or a setting refused
        if isinstance(exc, (KafkaException, KafkaUnreachable, DeliveryFailed, CommitFailedError)):
            return True
        if isinstance(exc, OSError) and not isinstance(exc, _NOT_TRANSIENT):
            return True  # pyarrow's object-store errors, connections, timeouts
        exc = exc.__cause__  # not __context__: an error raised while handling a blip is a bug's
    return False


def retries() -> int:
    """Retries of a step after a transient failure: `ENTITY_ASSETS_STEP_RETRIES`, read when the
    step runs (0: none; the code location's load refuses a value that is not a count)."""
    text = os.environ.get(RETRIES_VARIABLE, "").strip() or str(DEFAULT_RETRIES)
    if not (text.strip().isascii() and text.strip().isdigit()):
        raise SettingError(f"{RETRIES_VARIABLE}={text!r} is not a count of retries (0 or more)")
    return int(text)


def retried_when_transient(fn):
    """The asset step `fn`, raising `RetryRequested` when it fails transiently (`transient`).

    A retry runs the step again from its start: a step rewrites its slice, and publishes it
    again when its commit was done (docs/slices.md, re-running a slice)."""
    if inspect.isgeneratorfunction(fn):
        @functools.wraps(fn)
        def steps(context, *args, **kwargs):
            try:
                yield from fn(context, *args, **kwargs)
            except Exception as exc:
                _retry_or_raise(context, exc)
        return steps

    @functools.wraps(fn)
    def step(context, *args, **kwargs):
        try:
            return fn(context, *args, **kwargs)
        except Exception as exc:
            _retry_or_raise(context, exc)
    return step


def _retry_or_raise(context, exc: Exception):
    if not transient(exc):
        raise exc
    attempt = context.retry_number  # 0 on the first attempt
    if attempt >= retries():
        if attempt:
            context.log.warning(f"transient failure again, after {attempt} retries: the step fails")
        raise exc
    wait = RETRY_DELAY_SECONDS * 2 ** attempt
    context.log.warning(f"transient failure ({type(exc).__name__}: {str(exc)[:300]}); "
                        f"retry {attempt + 1} of {retries()} in {wait} s")
    raise RetryRequested(max_retries=retries(), seconds_to_wait=wait) from exc
