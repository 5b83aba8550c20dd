"""Delta Lake storage through delta-rs: task-side file writers and driver-side commits.

Spark tasks write parquet data files straight into a table's folder and hand back small
`DataFile` records; the driver commits those records as one Delta transaction. Data never
passes through the driver, and a slice's rows are replaced (never appended twice) because
every commit removes the files the slice wrote before.

Nothing here knows Dagster; `resources.lake.LakeResource` is the interface assets use.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta, timezone
from typing import NamedTuple
from urllib.parse import unquote, urlparse

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq

ROW_GROUP_ROWS = 65_536
"""Readers hold a row group's column chunks at once: bounded row groups keep them small."""

READ_BATCH_ROWS = 20_000
"""Rows per Arrow batch where a reader streams a file (`read_batches`)."""

SLICE = "slice"
"""Every table carries the slice key column; file statistics on it find a slice's files."""

NOTES_FOLDER = "_notes"
"""The lake's notes (`DeltaRsEngine.read_note`): what outlives a table deleted to be rebuilt."""

REQUESTS_IN_FLIGHT = 8
"""A task's concurrent requests to an object store (uploads of its files, reads ahead of its
folds): each costs a round trip, which a task would otherwise wait out one after the other."""

UPLOAD_BYTES = 64 << 20
"""Arrow bytes of the rows a writer's uploads in flight hold at most (`FileWriter`): a large
slice's files each hold up to `max_rows`, and 8 of them would be hundreds of MB."""


@dataclass(frozen=True)
class DataFile:
    """A parquet file a task wrote into a table's folder, not yet committed."""

    table: str
    path: str  # relative to the table root
    size: int
    rows: int
    stats: str  # Delta stats JSON (numRecords, min/max of the key columns)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class TableFile:
    """A committed file of a table snapshot, with the statistics used for pruning."""

    path: str
    uri: str
    size: int
    rows: int
    min: dict = field(default_factory=dict)
    max: dict = field(default_factory=dict)


S3_OPTIONS = {
    "aws_access_key_id": "access_key", "access_key_id": "access_key",
    "aws_secret_access_key": "secret_key", "secret_access_key": "secret_key",
    "aws_session_token": "session_token", "aws_token": "session_token", "session_token": "session_token",
    "token": "session_token",
    "aws_region": "region", "aws_default_region": "region", "region": "region",
    "aws_endpoint_url": "endpoint", "aws_endpoint_url_s3": "endpoint", "aws_endpoint": "endpoint",
    "endpoint_url": "endpoint", "endpoint": "endpoint",
    "aws_virtual_hosted_style_request": "force_virtual_addressing",
    "virtual_hosted_style_request": "force_virtual_addressing",
}
"""delta-rs's S3 storage options (object_store's names, any case) that the task-side files need
too, by the pyarrow S3FileSystem argument each sets; the others (locking, AWS_ALLOW_HTTP, which
an http:// endpoint implies) concern the Delta log only. `AWS_*` variables count as options too,
under the storage options, as they do for delta-rs."""


AZURE_SCHEMES = ("az", "azure", "abfs", "abfss", "adl")
"""delta-rs's URI schemes of Azure Blob Storage and ADLS Gen2 (`abfss://container@account.dfs.core.windows.net/…`)."""

AZURE_OPTIONS = {
    **dict.fromkeys(("azure_storage_account_name", "account_name"), "account_name"),
    **dict.fromkeys(("azure_storage_account_key", "azure_storage_access_key", "azure_storage_master_key",
                     "account_key", "access_key", "master_key"), "account_key"),
    **dict.fromkeys(("azure_storage_client_id", "azure_client_id", "client_id"), "client_id"),
    **dict.fromkeys(("azure_storage_client_secret", "azure_client_secret", "client_secret"), "client_secret"),
    **dict.fromkeys(("azure_storage_tenant_id", "azure_storage_authority_id", "azure_tenant_id",
                     "azure_authority_id", "tenant_id", "authority_id"), "tenant_id"),
    **dict.fromkeys(("azure_storage_sas_key", "azure_storage_sas_token", "sas_key", "sas_token"), "sas_token"),
    **dict.fromkeys(("azure_federated_token_file", "federated_token_file"), "federated_token_file"),
    **dict.fromkeys(("azure_storage_use_emulator", "use_emulator"), "use_emulator"),
    **dict.fromkeys(("azure_storage_endpoint", "azure_endpoint", "endpoint"), "endpoint"),
    "azurite_blob_storage_url": "azurite_url",
}
"""delta-rs's Azure storage options (object_store's names, any case) by the pyarrow
AzureFileSystem argument each sets, or by what `_azure` makes of them (`use_emulator`,
`endpoint`; `federated_token_file` picks a credential, `_azure_settings`). Unlike S3's, pyarrow
reads none of them from the environment, so `AZURE_*` variables count as options too, as they
do for delta-rs."""

AZURE_CREDENTIALS = ({"account_key"}, {"sas_token"}, {"client_id", "client_secret", "tenant_id"},
                     {"client_id", "tenant_id", "federated_token_file"})
"""The credentials `AZURE_OPTIONS` give, in delta-rs's order of preference (its AzureConfigHelper):
account key, SAS token, client secret, workload identity."""

AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
"""The Azure storage emulator's account and its published key, which `use_emulator` implies (as in object_store)."""


def filesystem(uri: str, storage_options: dict[str, str] | None) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem of a lake URI and the path in it.

    An S3 or Azure lake's data files use the credentials and endpoint of `storage_options`, as its
    Delta commits do; what the options leave out comes from the environment, as for delta-rs
    (AWS_*, AZURE_*; GOOGLE_APPLICATION_CREDENTIALS for Google Cloud Storage). A URI's path is
    read percent-decoded: delta-rs gives a table's URI encoded (`my%20lake` for a root `my lake`).
    """
    parsed = urlparse(uri, allow_fragments=False)  # a `#` or `?` of a folder's name is no fragment nor query
    if not parsed.scheme:
        return pafs.LocalFileSystem(), os.path.abspath(uri)
    path = unquote(parsed.path + (f"?{parsed.query}" if parsed.query else ""))
    if parsed.scheme == "file":
        return pafs.LocalFileSystem(), os.path.abspath(path)
    scheme = {"s3a": "s3", "s3n": "s3"}.get(parsed.scheme, parsed.scheme)
    if scheme == "s3":
        settings = _settings(storage_options, S3_OPTIONS, "AWS_")
        return _s3(parsed.netloc, tuple(sorted(settings.items()))), f"{parsed.netloc}{path}"
    if scheme in AZURE_SCHEMES:
        container, _, host = parsed.netloc.partition("@")
        settings = _azure_settings(storage_options)
        if host:  # the account named in the URI is the account
            settings["account_name"] = host.split(".")[0]
        return _azure(tuple(sorted(settings.items()))), f"{container}{path}"
    fs, path = pafs.FileSystem.from_uri(uri.replace(parsed.scheme + "://", scheme + "://", 1))
    return fs, path


def is_remote(uri: str) -> bool:
    """Whether a lake URI names an object store, whose every request is a round trip."""
    return urlparse(uri).scheme not in ("", "file")


_IO_THREAD = "lake-io"


@functools.cache
def _requests() -> ThreadPoolExecutor:
    """This process's threads for object-store requests (made on first use: a forked worker makes its own)."""
    return ThreadPoolExecutor(REQUESTS_IN_FLIGHT, thread_name_prefix=_IO_THREAD)


os.register_at_fork(after_in_child=_requests.cache_clear)  # a forked child has none of its parent's threads


def _in_io_thread() -> bool:
    """Work asked for by one of those threads runs in line: queued behind them, it could wait forever."""
    return threading.current_thread().name.startswith(_IO_THREAD)


def prefetched(fn: Callable, items: Iterable, ahead: int) -> Iterator:
    """`fn` of each item, in order, with up to `ahead` items' calls running in threads before
    they are needed (pyarrow releases the GIL while it waits on a request); `ahead` 0: in line."""
    if ahead <= 0 or _in_io_thread():
        yield from map(fn, items)
        return
    pending: deque[Future] = deque()
    try:
        for item in items:
            pending.append(_requests().submit(fn, item))
            if len(pending) > ahead:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:  # calls not started are dropped; those running are waited for, as a caller's retry
        for future in pending:  # must see what they did (a commit still in its store's backoff)
            future.cancel()
        wait(pending)


def _arguments(options: dict[str, str] | None, names: dict[str, str]) -> dict[str, str]:
    """The filesystem arguments `names` gives `options`."""
    return {argument: value for name, value in (options or {}).items() if (argument := names.get(name.lower()))}


def _variables(*prefixes: str) -> dict[str, str]:
    return {name: value for name, value in os.environ.items() if name.startswith(prefixes)}


def _settings(storage_options: dict[str, str] | None, names: dict[str, str], *prefixes: str) -> dict[str, str]:
    """The filesystem arguments `names` gives the environment's variables of `prefixes` and,
    over them, the storage options."""
    return {**_arguments(_variables(*prefixes), names), **_arguments(storage_options, names)}


def _azure_settings(storage_options: dict[str, str] | None) -> dict[str, str]:
    """`_settings` of an Azure lake, with one credential chosen as delta-rs chooses its own: the
    first of `AZURE_CREDENTIALS` the options give whole, else one they give in part and the
    environment completes, else one the environment gives whole.

    Merged, the environment's account key and an option's SAS token, or the client and tenant ids
    that AKS workload identity sets without a secret, are arguments pyarrow refuses. Workload
    identity passes none: pyarrow's default credential chain reads its variables itself (from the
    environment only). With no credential, a client id alone names a user-assigned managed identity.
    """
    given = _arguments(storage_options, AZURE_OPTIONS)
    found = _arguments(_variables("AZURE_", "AZURITE_"), AZURE_OPTIONS)
    settings = {**found, **given}
    credential = ([kind for kind in AZURE_CREDENTIALS if kind <= given.keys()]
                  or [kind for kind in AZURE_CREDENTIALS if kind & given.keys() and kind <= settings.keys()]
                  or [kind for kind in AZURE_CREDENTIALS if kind <= found.keys()] or [{"client_id"}])[0]
    if "federated_token_file" in credential:
        credential = set()
    return {k: v for k, v in settings.items() if k in credential or not any(k in kind for kind in AZURE_CREDENTIALS)}


def _endpoint(endpoint: str) -> tuple[str, str]:
    """The scheme and host[:port] of an endpoint URL (https when it names none)."""
    url = urlparse(endpoint if "://" in endpoint else f"https://{endpoint}")
    return url.scheme, url.netloc


@functools.lru_cache(maxsize=8)
def _s3(bucket: str, options: tuple[tuple[str, str], ...]) -> pafs.S3FileSystem:
    """One S3FileSystem per bucket and set of settings (`_settings`) in a process: a task opens
    every file through it.

    Credentials that no setting gives come from pyarrow's own lookup (profiles, instance role);
    a region that none gives is the bucket's, as pyarrow's URI lookup finds it. A written file
    that fits one part goes up in one PUT (`allow_delayed_open`), not in a multipart upload of
    three requests.
    """
    settings: dict = dict(options)
    if "force_virtual_addressing" in settings:
        settings["force_virtual_addressing"] = settings["force_virtual_addressing"].lower() == "true"
    endpoint = settings.pop("endpoint", None)
    if endpoint:
        settings["scheme"], settings["endpoint_override"] = _endpoint(endpoint)
    if "region" not in settings and not endpoint:  # an S3-compatible store's endpoint needs none
        settings["region"] = pafs.FileSystem.from_uri(f"s3://{bucket}")[0].region
    return pafs.S3FileSystem(allow_delayed_open=True, **settings)


@functools.lru_cache(maxsize=8)
def _azure(options: tuple[tuple[str, str], ...]) -> pafs.AzureFileSystem:
    """One AzureFileSystem per set of settings (`_settings`) in a process.

    An endpoint on the account's own host name (`https://acct.blob.core.windows.net`) keeps
    pyarrow's virtual-host addressing; any other (an emulator's `http://127.0.0.1:10000/acct`,
    a proxy) is addressed path-style, the account first, as object_store does.
    """
    settings = dict(options)
    endpoint, emulator = settings.pop("endpoint", None), settings.pop("azurite_url", "http://127.0.0.1:10000")
    if settings.pop("use_emulator", "false").lower() == "true":
        settings.setdefault("account_name", AZURITE_ACCOUNT)
        if not {"account_key", "sas_token", "client_secret"} & settings.keys():
            settings["account_key"] = AZURITE_KEY
        endpoint = endpoint or emulator
    account = settings.get("account_name")
    if not account:
        raise ValueError("an Azure lake needs its storage account: name it in the URI (abfss://container@"
                         "account.dfs.core.windows.net/...), or set AZURE_STORAGE_ACCOUNT_NAME in "
                         "storage_options or the environment")
    if endpoint:
        scheme, authority = _endpoint(endpoint)
        if authority.startswith(f"{account}."):
            authority = authority[len(account):]  # pyarrow puts the account before an authority that starts with "."
        settings.update(blob_storage_scheme=scheme, blob_storage_authority=authority, dfs_storage_scheme=scheme,
                        dfs_storage_authority=authority.replace(".blob.", ".dfs.", 1))
    return pafs.AzureFileSystem(**settings)


class FileWriter:
    """Buffers rows of one table in a task and writes bounded parquet files.

    Memory stays bounded by `max_rows` per buffer, whatever the slice size, and by `max_bytes`:
    the sizes `append` is told (rows that hold a record's bytes: 2,200 dead letters of 1 MB
    would pass the 2 GiB an Arrow column of binary holds) and the Arrow rows' (responses that
    each carry a 1 MB document).
    """

    def __init__(
        self,
        table: str,
        table_uri: str,
        schema: pa.Schema,
        slice_key: str,
        *,
        stats_columns: Sequence[str] = (SLICE,),
        storage_options: dict[str, str] | None = None,
        max_rows: int = 250_000,
        max_bytes: int = 256 * 1024 * 1024,
        row_groups_by: str | None = None,
        whole_keys: str | None = None,
    ):
        """`whole_keys`: a column whose runs of equal values (a key's rows, appended together in
        Arrow) a file never splits: a later step that reads the files in several tasks then has
        each key's rows in one, in order (`_roll`)."""
        self.table, self.schema, self.slice_key = table, schema, slice_key
        self.stats_columns = tuple(stats_columns)
        self.row_groups_by = row_groups_by
        self.whole_keys = whole_keys
        self.max_rows, self.max_bytes = max_rows, max_bytes
        self._bytes = 0
        self._fs, self._root = filesystem(table_uri, storage_options)
        self._remote = is_remote(table_uri)
        self.struct = pa.struct(list(schema))
        self._rows: list[dict] = []
        self._tables: list[pa.Table] = []
        self._table_rows = 0
        self._files: list[DataFile | Future] = []  # uploads to an object store run in threads
        self._uploading: list[tuple[Future, int]] = []  # those not done yet, with their rows' bytes

    def append(self, row: dict, size: int = 0) -> None:
        """Buffers `row` as it is (columns by name, extra keys ignored): do not change it afterwards.
        `size`: its bytes, where they may be large."""
        self._rows.append(row)
        self._bytes += size
        if len(self._rows) + self._table_rows >= self.max_rows or self._bytes >= self.max_bytes:
            self.flush()

    def append_table(self, data: pa.Table) -> None:
        """Buffers Arrow rows (already holding the slice column): no conversion to Python objects.

        A file holds the buffered tables' rows before the dicts' (`append`).
        """
        self._tables.append(data := self._conform(data))
        self._table_rows += data.num_rows
        self._bytes += data.nbytes
        if len(self._rows) + self._table_rows >= self.max_rows or self._bytes >= self.max_bytes:
            self._roll()

    def write_table(self, data: pa.Table, rows: Sequence[dict] = (), tag: str | None = None) -> None:
        """Writes an Arrow table (already holding the slice column), then `rows`, as one file.

        `tag`: put in the file's name (a state file's shard).
        """
        data = self._conform(data)
        if rows:
            data = pa.concat_tables([data, self._from_dicts(list(rows))])
        if data.num_rows:
            self._write(data, tag)

    def _conform(self, data: pa.Table) -> pa.Table:
        return data.select(self.schema.names).cast(self.schema)

    def _from_dicts(self, rows: list[dict]) -> pa.Table:
        return pa.Table.from_batches([from_rows(rows, self.struct)])

    def flush(self) -> None:
        if self._rows:
            self._tables.append(self._from_dicts(self._rows))
        if self._tables:
            data = pa.concat_tables(self._tables)
            self._rows, self._tables, self._table_rows, self._bytes = [], [], 0, 0
            self._write(data)

    def _roll(self) -> None:
        """Writes the buffered rows as a file, but with `whole_keys` the rows of the last key,
        which the next rows may continue, stay for the next file: when one key fills the
        buffer, it grows until another key comes (a key's rows in one file, whatever their
        size: an entity's updates of a slice are published in file order). Dict rows (`append`)
        are written as they are."""
        if self.whole_keys is None or self._rows:
            self.flush()
            return
        data = pa.concat_tables(self._tables)
        keys = data.column(self.whole_keys)
        others = pc.indices_nonzero(pc.not_equal(keys, keys[-1]).combine_chunks())
        if not len(others):
            self._tables = [data]
            return
        cut = others[-1].as_py() + 1
        self._tables, self._table_rows = [data.slice(cut)], data.num_rows - cut
        self._bytes = self._tables[0].nbytes
        self._write(data.slice(0, cut))

    def close(self) -> list[DataFile]:
        """The files written, in the order written, once every upload has ended (its error raised here)."""
        self.flush()
        self._files = [f.result() if isinstance(f, Future) else f for f in self._files]
        return self._files

    def _write(self, data: pa.Table, tag: str | None = None) -> None:
        """In line on a local disk; on an object store in a thread, with at most `REQUESTS_IN_FLIGHT`
        of the writer's files and `UPLOAD_BYTES` of their rows on their way at a time."""
        name = f"part-{self.slice_key}-{tag + '-' if tag else ''}{uuid.uuid4().hex}.parquet"
        if not self._remote or _in_io_thread():
            self._files.append(self._put(data, name))
            return
        self._uploading = [(f, n) for f, n in self._uploading if not f.done()]
        while self._uploading and (len(self._uploading) >= REQUESTS_IN_FLIGHT
                                   or sum(n for _, n in self._uploading) + data.nbytes > UPLOAD_BYTES):
            self._uploading.pop(0)[0].result()
        future = _requests().submit(self._put, data, name)
        self._uploading.append((future, data.nbytes))
        self._files.append(future)

    def _put(self, data: pa.Table, name: str) -> DataFile:
        with self._fs.open_output_stream(f"{self._root}/{name}") as sink:
            if self.row_groups_by is None:
                pq.write_table(data, sink, compression="snappy", row_group_size=ROW_GROUP_ROWS)
            else:
                self._write_groups(data, sink)
            size = sink.tell()  # not a stat of the file: on an object store that is one more request
        return DataFile(self.table, name, size, data.num_rows, _stats(data, self.stats_columns))

    def _write_groups(self, data: pa.Table, sink) -> None:
        """One row group per value of `row_groups_by`: readers of one value skip the rest by its statistics."""
        runs = pc.value_counts(data.column(self.row_groups_by))
        if len(runs) > 1:  # one value (all parts 1, say) needs no sort: a copy of every column
            data = data.sort_by(self.row_groups_by)
            runs = pc.value_counts(data.column(self.row_groups_by))
        with pq.ParquetWriter(sink, data.schema, compression="snappy") as writer:
            offset = 0
            for run in runs:
                n = run["counts"].as_py()
                writer.write_table(data.slice(offset, n), row_group_size=min(n, ROW_GROUP_ROWS))
                offset += n


def from_rows(rows: list[dict], struct: pa.StructType) -> pa.RecordBatch:
    """Rows as a batch of `struct`'s fields (extra keys ignored, missing ones null).

    Converting through one struct array costs about a quarter of `from_pylist` per row.
    """
    return pa.RecordBatch.from_struct_array(pa.array(rows, type=struct))


def one_array(values: pa.Array | pa.ChunkedArray) -> pa.Array:
    """`values` as one array, not copied when it is one chunk already (`combine_chunks` copies it)."""
    if isinstance(values, pa.ChunkedArray):
        return values.chunk(0) if values.num_chunks == 1 else values.combine_chunks()
    return values


def to_rows(data: pa.RecordBatch | pa.Table) -> list[dict]:
    """A batch's rows as dicts: through a struct array, about half the cost of `to_pylist`."""
    if isinstance(data, pa.Table):
        return [row for batch in data.to_batches() for row in to_rows(batch)]
    return data.to_struct_array().to_pylist()


def key_strings(data: pa.Table, columns: Sequence[str]) -> pa.ChunkedArray:
    """One string per row for its key `columns`, equal only for equal keys (see `key_string`)."""
    parts = []
    for column in columns:
        values = pc.cast(data.column(column), pa.string())
        parts += [pc.cast(pc.utf8_length(values), pa.string()), values]
    return pc.binary_join_element_wise(*parts, ":", null_handling="replace", null_replacement="")


def key_string(key: tuple) -> str:
    """`key_strings` of one key: each part as its length, ':' and its text, so no separator is ambiguous."""
    return ":".join(part for v in key for part in (("", "") if v is None else (str(len(str(v))), str(v))))


PARQUET = ds.ParquetFileFormat()


def parquet_file(file: str | TableFile, storage_options: dict[str, str] | None = None) -> ds.ParquetFileFragment:
    """A parquet file to read, by URI or as a committed file: the size the Delta log holds spares
    an object store the request for it (a HEAD per file read, 17% of a slice's requests to S3)."""
    uri, size = (file.uri, file.size) if isinstance(file, TableFile) else (file, None)
    fs, path = filesystem(uri, storage_options)
    return PARQUET.make_fragment(path, fs, file_size=size)


def read_table(file: str | TableFile, storage_options: dict[str, str] | None = None, columns: list[str] | None = None,
               filters=None, schema: pa.Schema | None = None) -> pa.Table:
    """`filters` (pyarrow's, or an expression): row groups whose statistics exclude them are not
    even decoded. `schema`: the table's, where a file may lack a column added in place (null there)."""
    return parquet_file(file, storage_options).to_table(
        schema=schema, columns=columns, filter=None if filters is None else pq.filters_to_expression(filters))


def read_tables(files: Sequence[str | TableFile], storage_options: dict[str, str] | None = None,
                columns: list[str] | None = None, filters=None, schema: pa.Schema | None = None) -> Iterator[pa.Table]:
    """Each of `files` read (whole, or its rows `filters` keep), in order: at once on an object store (`files_ahead`)."""
    return prefetched(lambda f: read_table(f, storage_options, columns, filters, schema), files, files_ahead(files))


class Repeat(NamedTuple):
    """A delivery of a request seen before (`repeated_deliveries`)."""

    at: tuple  # its Kafka coordinates
    identity: tuple
    reused: bool  # its `begun` is no earlier delivery's: the id of another request, not a redelivery


STAMP = "begun"
"""The column that tells a redelivery (the same message again) from a reused request id."""


def repeated_deliveries(slice_files: Sequence[str | TableFile], prior_files: Sequence[str | TableFile],
                        identity: Sequence[str],
                        coordinates: Sequence[str], storage_options: dict[str, str] | None = None, *,
                        split_by: str | None = None, part: int = 0, parts: int = 1) -> list[Repeat]:
    """The slice's rows whose identity came before: at lower coordinates in the slice, or in the
    rows of `prior_files`. Reads only identity, coordinate and `STAMP` columns, and finds repeats
    with Arrow's hash aggregates and joins: only the (normally few) repeated rows become Python
    objects. A redelivery is the same message again, so its `STAMP` (the client's `begun`) is one
    an earlier delivery had; a repeat without it is marked `reused`.

    `parts` (a power of two) tasks share the work: each keeps the identities whose integer
    column `split_by` has `part` as its low bits, so it holds 1/parts of the slice.
    """
    identity = list(identity)
    rows = pa.concat_tables(read_tables(slice_files, storage_options, [*identity, *coordinates, STAMP]))
    if parts > 1:
        rows = rows.filter(pc.equal(pc.bit_wise_and(rows.column(split_by), parts - 1), part))
    if not rows.num_rows:
        return []
    # the window's stamps of the slice's identities. The window is read in batches of about the
    # slice's size (not split: the join keeps only this part's identities), each probed against
    # the slice's identities: the join builds its table on those, the driver's memory stays that
    # of a small batch and a task's work stays linear in the window
    keys = rows.select(identity)
    earlier: dict[tuple, set] = {}
    for batch in read_files(prior_files, storage_options, max(READ_BATCH_ROWS, rows.num_rows), columns=[*identity, STAMP]):
        seen = pa.Table.from_batches([batch]).join(keys, identity, join_type="left semi", use_threads=False)
        for row in seen.to_pylist():
            earlier.setdefault(tuple(row[c] for c in identity), set()).add(row[STAMP])
    counts = rows.group_by(identity, use_threads=False).aggregate([([], "count_all")])
    twice = counts.filter(pc.greater(counts.column("count_all"), 1)).select(identity)
    if earlier:
        twice = pa.concat_tables([twice, pa.Table.from_pylist([dict(zip(identity, k)) for k in earlier], twice.schema)])
    deliveries: dict[tuple, list[tuple]] = {}
    for row in rows.join(twice, identity, join_type="left semi", use_threads=False).to_pylist():
        deliveries.setdefault(tuple(row[c] for c in identity), []).append(
            (tuple(row[c] for c in coordinates), row[STAMP]))
    repeats = []
    for key, ats in deliveries.items():
        stamps = set(earlier.get(key, ()))
        for i, (at, stamp_of) in enumerate(sorted(ats)):  # the first in the slice is new unless the window had it
            if i or key in earlier:
                repeats.append(Repeat(at, key, stamp_of not in stamps))
            stamps.add(stamp_of)
    return repeats


def read_batches(file: str | TableFile, storage_options: dict[str, str] | None = None, batch_size: int = READ_BATCH_ROWS,
                 columns: list[str] | None = None):
    """A parquet file's rows in bounded Arrow batches.

    Without decoding threads, and on a local disk without read-ahead buffers: the reader then
    holds about half the memory (16 instead of 30 MB over a 1M-row window, measured), and a
    task's one core gains nothing from threads. On an object store the read-ahead stays: it
    fetches a row group's columns in one request instead of one per column chunk.
    """
    fs, path = filesystem(_uri(file), storage_options)
    with fs.open_input_file(path) as source:
        parquet = pq.ParquetFile(source, pre_buffer=is_remote(_uri(file)))
        yield from parquet.iter_batches(batch_size=batch_size, columns=columns, use_threads=False)


SMALL_FILE_BYTES = 4 << 20
"""On an object store, files up to this size are read whole, ahead of need (`read_files`)."""


def read_files(files: Sequence[str | TableFile], storage_options: dict[str, str] | None = None,
               batch_size: int = READ_BATCH_ROWS, columns: list[str] | None = None) -> Iterator[pa.RecordBatch]:
    """The rows of `files`, in order, in bounded batches.

    On an object store a file's read is round trips, and a small slice's files are many and
    small: those are read whole in threads ahead of need (`REQUESTS_IN_FLIGHT` of them, so at
    most that many times `SMALL_FILE_BYTES` of parquet), larger ones streamed when their turn comes.
    """
    files = list(files)
    ahead = files_ahead(files)

    def whole(file):
        return read_table(file, storage_options, columns) if ahead and _small(file) else None

    for file, data in zip(files, prefetched(whole, files, ahead)):
        if data is None:
            yield from read_batches(file, storage_options, batch_size, columns)
        else:
            yield from data.to_batches(max_chunksize=batch_size)


def _uri(file: str | TableFile) -> str:
    return file.uri if isinstance(file, TableFile) else file


def files_ahead(files: Iterable[str | TableFile]) -> int:
    """How many of `files` to read ahead: `REQUESTS_IN_FLIGHT` on an object store, none (one after the other) locally."""
    return REQUESTS_IN_FLIGHT if any(is_remote(_uri(f)) for f in files) else 0


def _small(file: str | TableFile) -> bool:
    return isinstance(file, TableFile) and file.size <= SMALL_FILE_BYTES


class RowGroups:
    """Files written with `row_groups_by=column`, whose rows of one `column` value are read at a
    time (`read`).

    A fold task reads its buckets one after the other from the same files: each file's footer is
    read once per task, not once per bucket, which on an object store saves a round trip per
    file and bucket.
    """

    def __init__(self, files: Iterable[str | TableFile], column: str, storage_options: dict[str, str] | None = None):
        def footer(file):
            fragment = parquet_file(file, storage_options)
            fragment.ensure_complete_metadata()  # reads the footer; row group subsets keep it
            return fragment, fragment.physical_schema.get_field_index(column)

        files = list(files)
        self.column, self._ahead = column, files_ahead(files)
        self._files = list(prefetched(footer, files, self._ahead))

    def read(self, value) -> pa.Table:
        """The rows whose `column` is `value`, from the row groups whose statistics admit it."""
        subsets = []
        for fragment, index in self._files:
            metadata = fragment.metadata
            groups = [g for g in range(metadata.num_row_groups)
                      if (st := metadata.row_group(g).column(index).statistics) is None
                      or not st.has_min_max or st.min <= value <= st.max]  # no bounds (a long value): read it
            if groups:
                subsets.append(fragment.subset(row_group_ids=groups))
        pieces = list(prefetched(lambda subset: subset.to_table(use_threads=False), subsets, self._ahead))
        if not pieces:
            return pa.table({})
        data = pa.concat_tables(pieces)
        return data.filter(pc.equal(data.column(self.column), value))


def read_row_groups(files: Iterable[str | TableFile], column: str, value,
                    storage_options: dict[str, str] | None = None) -> pa.Table:
    """The rows of files written with `row_groups_by=column` whose `column` is `value`."""
    return RowGroups(files, column, storage_options).read(value)


def _stats(data: pa.Table, columns: Iterable[str]) -> str:
    mins, maxs, nulls = {}, {}, {}
    for name in columns:
        col = data.column(name)
        bounds = pc.min_max(col)
        mins[name], maxs[name] = bounds["min"].as_py(), bounds["max"].as_py()
        nulls[name] = col.null_count
    return json.dumps({"numRecords": data.num_rows, "minValues": mins, "maxValues": maxs, "nullCount": nulls})


CHECKPOINT_SETTING = "delta.checkpointInterval"
CHECKPOINT_INTERVAL = 10
"""Commits between the Delta checkpoints delta-rs writes. Opening a table reads its log from the
last checkpoint: at Delta's default of 100, up to 99 commit files, which a step pays per table it
opens (measured at 65 commits: 35 ms, and 134 requests to an S3 endpoint; at 10: 12 ms and 25
requests). A checkpoint of a 20,000-file table took 0.09 s to write."""
LOG_RETENTION_SETTING = "delta.logRetentionDuration"
DELETED_FILE_RETENTION_SETTING = "delta.deletedFileRetentionDuration"
"""How long a checkpoint keeps the record of a file a commit removed: past it (Delta's default, 7
days), a full vacuum takes the file for one no version names, and deletes it by its age."""
COMMIT_PREFIX = "entity_assets."
"""Of the names of the commit info a commit records (`DeltaRsEngine.commit`)."""
MADE_PROPERTY = "entity_assets.madeInSlice"
"""Table property: the slice whose run made the table. A table with no slice before its run's
is new there, or rebuilt from there, unless a run of an earlier slice made it and failed before
its first commit (`require_published`)."""

DONE_PROPERTY = "entity_assets.slicesDone."
"""Table property per operation: the slices whose commits `expire_log` may delete, as ranges
("1-40,42-97"), so that `reached` still knows them (a gap is a slice that never succeeded)."""


def _replay_base(history: list[dict]) -> dict | None:
    """Of a table's slice commits (`history` entries), the older of the last slice's commit (not
    always the newest slice commit, as a re-run of an older slice comes after it) and the commit
    of the slice before it, whose state a replay of the last slice reads."""
    def by_slice(entry: dict) -> tuple:
        return entry["entity_assets.slice"], entry["version"]

    last = max(history, default=None, key=by_slice)
    before_last = last and max((e for e in history if e["entity_assets.slice"] < last["entity_assets.slice"]),
                               default=None, key=by_slice)
    return min((e for e in (last, before_last) if e), default=None, key=lambda e: e["version"])


def _parse_ranges(text: str) -> list[tuple[int, int]]:
    return [(int(low), int(high or low)) for low, _, high in (part.partition("-") for part in text.split(",") if part)]


def _format_ranges(ranges: Iterable[tuple[int, int]]) -> str:
    merged: list[list[int]] = []
    for low, high in sorted(ranges):
        if merged and low <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], high)
        else:
            merged.append([low, high])
    return ",".join(str(low) if low == high else f"{low}-{high}" for low, high in merged)


def _post_commit():
    """What delta-rs does after each of the engine's commits: the checkpoint every
    `CHECKPOINT_INTERVAL` commits, but not the deletion of expired log files, which lists the
    table's whole log at every commit (a log of 3,300 files, 30 days of 15-minute slices: 35 ms
    a commit locally, a request per 1,000 files on an object store) to delete nothing until its
    oldest files are 30 days old (Delta's default). `lake_maintenance` does it once a day
    (`expire_log`), at the vacuum's retention."""
    from deltalake import PostCommitHookProperties

    return PostCommitHookProperties(create_checkpoint=True, cleanup_expired_logs=False)


class LayoutError(RuntimeError):
    """A table's layout is not the code's: older (a column it needs is missing), or another
    engine's (a stream table's slices merged into shared files)."""


class DeltaRsEngine:
    """Commits and reads Delta tables with delta-rs (the default engine where Spark lacks the Delta jars).

    An engine lives for one step (`LakeResource.open`) and is used by one thread.

    `snapshot`: each table is read as of the engine's first look at it, plus the engine's own
    commits, as one step of a run needs it: the slices' order makes the run the lake's only
    writer of the tables it writes, and a commit still checks for conflicting commits of
    others (delta-rs's conflict checker). It spares a request for new commits at each look,
    a round trip on an object store. A sensor tick reads the manifests so too: of two ticks
    closing the same slice, the conflict check refuses the later commit. Without it (the CLI,
    lake maintenance, tests), each look at the latest version sees other writers' commits.
    """

    def __init__(self, root: str, storage_options: dict[str, str] | None = None, *, snapshot: bool = False):
        self.root = root.rstrip("/")
        self.storage_options = storage_options or None
        self.snapshot = snapshot
        self._handles: dict[tuple[str, int | None], object] = {}
        self._existing: set[str] = set()
        self._written: set[str] = set()  # tables this engine committed to since it last brought them up to date

    def uri(self, table: str) -> str:
        return f"{self.root}/{table}"

    def each(self, fn: Callable, tables: Iterable[str]) -> list:
        """`fn(table)` for each table, in order; at once on an object store, where each is round
        trips of its own (a commit ~8), and delta-rs waits on them without the GIL."""
        tables = list(tables)
        return list(prefetched(fn, tables, len(tables) if is_remote(self.root) else 0))

    def _open(self, table: str, version: int | None = None):
        """One handle per table and version for the engine's life: opening reads the Delta log
        since its last checkpoint (`CHECKPOINT_INTERVAL`), and a step asks for the same tables
        many times. The latest is brought up to date from the log's new commits at each look
        (~2 ms locally when there are none, a round trip on an object store), unless `snapshot`
        and the engine made none of them. A past version never changes; the one the latest handle
        is at (a state a step just committed, then checks) is read from that handle, as callers
        use a handle at once.
        """
        from deltalake import DeltaTable

        dt = self._handles.get((table, version))
        if dt is None and version is not None:
            latest = self._handles.get((table, None))
            if latest is not None and latest.version() == version:
                return latest  # a version just committed or read as the latest: no second open of the log
        if dt is None:
            dt = self._handles[(table, version)] = DeltaTable(self.uri(table), version=version,
                                                              storage_options=self.storage_options)
        elif version is None and (not self.snapshot or table in self._written):
            dt.update_incremental()
            self._written.discard(table)
        return dt

    def exists(self, table: str) -> bool:
        """A table once found stays: later asks of the step make no request (`ensure` asks for each
        table it writes). Found by opening it: its callers read it next."""
        from deltalake.exceptions import TableNotFoundError

        if table not in self._existing:
            try:
                self._open(table)
            except TableNotFoundError:
                return False
            self._existing.add(table)
        return True

    def ensure(self, table: str, schema: pa.Schema, added_in_place: Iterable[str] = (),
               slice_key: str | None = None) -> None:
        """Creates the table if missing, noting the slice whose run made it (`made_in`); gives a
        table of an older lake the `CHECKPOINT_INTERVAL` and the columns of `schema` named in
        `added_in_place` that it lacks (a commit each, once)."""
        from deltalake import DeltaTable, Field

        if not self.exists(table):
            DeltaTable.create(self.uri(table), schema, mode="ignore",
                              configuration={CHECKPOINT_SETTING: str(CHECKPOINT_INTERVAL)},
                              storage_options=self.storage_options, post_commithook_properties=_post_commit())
            if slice_key is not None:  # Delta's create takes none of its own properties
                self._set_properties(table, {MADE_PROPERTY: slice_key})
            return
        self._set_properties(table, {CHECKPOINT_SETTING: str(CHECKPOINT_INTERVAL)})
        dt = self._open(table)
        present = set(pa.schema(dt.schema().to_arrow()).names)
        if missing := [schema.field(n) for n in added_in_place if n not in present]:
            dt.alter.add_columns([Field.from_arrow(f) for f in missing], post_commithook_properties=_post_commit())
            self._written.add(table)

    def made_in(self, table: str) -> str | None:
        """The slice whose run made `table` (None: made by a release before the note, or outside a run)."""
        return self._open(table).metadata().configuration.get(MADE_PROPERTY)

    def _set_properties(self, table: str, properties: dict[str, str]) -> None:
        """Sets table properties on the step's handle of the table, in one commit only when one changes."""
        dt = self._open(table)
        configuration = dt.metadata().configuration
        if changed := {name: value for name, value in properties.items() if configuration.get(name) != value}:
            dt.alter.set_table_properties(changed, raise_if_not_exists=False,  # DONE_PROPERTY is none of Delta's
                                          post_commithook_properties=_post_commit())
            self._written.add(table)

    def _check_layout(self, table: str, dt, schema: pa.Schema) -> None:
        """Refuses a table written by an older release that lacks a column the code writes."""
        present = set(pa.schema(dt.schema().to_arrow()).names)
        missing = [n for n in schema.names if n not in present]
        if missing:
            raise LayoutError(
                f"table {table} at {self.uri(table)} was written by an older release (it lacks {', '.join(missing)}). "
                f"Rebuild it: delete that folder and materialize its asset again from the first slice (a backfill); "
                f"see docs/operations.md, Upgrading.")

    def version(self, table: str) -> int:
        return self._open(table).version()

    def applied(self, table: str, app_id: str, version: int | None = None) -> int | None:
        """The last slice sequence number committed to `table` by `app_id` (as of `version`)."""
        return self._open(table, version).transaction_version(app_id)

    def file_stats(self, table: str) -> pa.Table:
        """One row per file of the current snapshot: `path`, `num_records` and the `min.<column>`
        and `max.<column>` statistics of the log (no data file is read)."""
        return self._actions(table)[0]

    def row_count(self, table: str, version: int | None = None) -> int:
        """Rows of the table at `version`, from its log's add actions (no data file is read)."""
        return pc.sum(self._actions(table, version)[0]["num_records"]).as_py() or 0

    def files(self, table: str, version: int | None = None, layout: pa.Schema | None = None) -> list[TableFile]:
        """`layout`: the columns the caller needs, checked on the snapshot it opens (see `_check_layout`)."""
        return self._table_files(*self._actions(table, version, layout))

    def slice_files(self, table: str, slice_keys: Iterable[str], version: int | None = None) -> list[TableFile]:
        """The files holding only rows of `slice_keys`, picked in Arrow: a stream table gains files
        at every slice, and making a Python record of each costs ~0.1 ms."""
        actions, dt = self._actions(table, version)
        if f"min.{SLICE}" not in actions.column_names:
            return []
        low, high = actions[f"min.{SLICE}"], actions[f"max.{SLICE}"]
        if spanning := pc.sum(pc.not_equal(low, high)).as_py():
            raise LayoutError(f"table {table}: {spanning} file(s) hold rows of several slices, which this engine writes "
                               "a file per slice and finds by their files (a compaction by another engine, such as "
                               "OPTIMIZE?): a re-run would keep their rows and add its own, and a step would read "
                               "no rows of their slices. Restore the table's version before the compaction "
                               "(docs/storage.md)")
        keys = pa.array(sorted(set(slice_keys)), low.type)
        return self._table_files(actions.filter(pc.is_in(low, value_set=keys)), dt)

    def slice_finder(self, table: str) -> Callable[[str], list[TableFile]]:
        """`slice_files` of one slice at a time, for many calls on one snapshot (a history walking
        an entity's slices): its files are listed and indexed by slice once, not at each call."""
        actions, dt = self._actions(table)
        if f"min.{SLICE}" not in actions.column_names:
            return lambda slice_key: []
        low, high = actions[f"min.{SLICE}"], actions[f"max.{SLICE}"]
        single = actions.filter(pc.equal(low, high))
        rows: dict[str, list[int]] = {}
        for i, key in enumerate(single[f"min.{SLICE}"].to_pylist()):
            rows.setdefault(key, []).append(i)
        return lambda slice_key: self._table_files(single.take(pa.array(rows.get(slice_key, []), pa.int64())), dt)

    def _actions(self, table: str, version: int | None = None, layout: pa.Schema | None = None):
        """The snapshot's add actions with the statistics some file has (most columns have none),
        and the snapshot's handle."""
        dt = self._open(table, version)
        if layout is not None:
            self._check_layout(table, dt, layout)
        actions = pa.table(dt.get_add_actions(flatten=True))
        stats = [c for c in actions.column_names
                 if c.startswith(("min.", "max.")) and actions[c].null_count < actions.num_rows]
        return actions.select(["path", "size_bytes", "num_records", *stats]), dt

    @staticmethod
    def _table_files(actions: pa.Table, dt) -> list[TableFile]:
        base, out = dt.table_uri.rstrip("/"), []
        for a in actions.to_pylist():
            mins = {k[4:]: v for k, v in a.items() if k.startswith("min.")}
            maxs = {k[4:]: v for k, v in a.items() if k.startswith("max.")}
            out.append(TableFile(a["path"], f"{base}/{a['path']}", a["size_bytes"], a["num_records"] or 0, mins, maxs))
        return out

    def column_bounds(self, table: str, slice_key: str, column: str) -> tuple | None:
        """(min, max) of a column over a slice's files, from their parquet footers (no data read)."""
        lows, highs = [], []
        for f in self.slice_files(table, [slice_key]):
            fragment = parquet_file(f, self.storage_options)
            fragment.ensure_complete_metadata()
            meta = fragment.metadata
            index = meta.schema.to_arrow_schema().get_field_index(column)
            for g in range(meta.num_row_groups):
                st = meta.row_group(g).column(index).statistics
                if st is not None and st.has_min_max:
                    lows.append(st.min)
                    highs.append(st.max)
        return (min(lows), max(highs)) if lows else None

    def commit(
        self,
        table: str,
        schema: pa.Schema,
        *,
        add: Sequence[DataFile],
        remove: Sequence[TableFile] = (),
        operation: str,
        slice_key: str,
        app_txn: tuple[str, int] | None = None,
        metadata: dict[str, str] | None = None,
    ) -> int:
        """One Delta transaction: remove `remove`, add `add`, record the slice and app transaction.

        `metadata`: more commit info (names without the "entity_assets." prefix), see `commit_after`.
        """
        from deltalake.transaction import AddAction, CommitProperties, RemoveAction, Transaction

        now = int(time.time() * 1000)
        actions = [RemoveAction(f.path, True, now, size=f.size) for f in remove]
        actions += [AddAction(f.path, f.size, {}, now, True, f.stats) for f in add]
        props = CommitProperties(
            custom_metadata={"entity_assets.operation": operation, "entity_assets.slice": slice_key,
                             **{f"{COMMIT_PREFIX}{k}": v for k, v in (metadata or {}).items()}},
            app_transactions=[Transaction(*app_txn)] if app_txn else None,
        )
        dt = self._open(table)
        self._check_layout(table, dt, schema)  # on the table this commit opens anyway: no extra read of the log
        dt.create_write_transaction(actions, "append", schema, commit_properties=props,
                                    post_commithook_properties=_post_commit())
        self._written.add(table)
        return self.version(table)

    def replace_slice(self, table: str, schema: pa.Schema, files: Sequence[DataFile], slice_key: str,
                      published: bool = True, metadata: dict[str, str] | None = None) -> int:
        """Replaces every row of `slice_key` with `files`: a re-run rewrites, never duplicates.

        Its commit says that a publish commit follows it once the slice's messages are out
        (`assets.common.require_published`), which commits of older releases do not; nor do those
        of a table whose stream a later step publishes (not `published`), so that the release
        before, which published it from this table's step, still runs after this one.
        `metadata`: more commit info, see `commit`."""
        self.ensure(table, schema)
        return self.commit(table, schema, add=files, remove=self.slice_files(table, [slice_key]),
                           operation="replace_slice", slice_key=slice_key,
                           metadata={**({"publish_recorded": "1"} if published else {}), **(metadata or {})})

    def version_after(self, table: str, slice_key: str, operation: str) -> int | None:
        """The table version whose commit did `operation` for `slice_key` (newest first; None if never)."""
        entry = self.commit_after(table, slice_key, operation)
        return None if entry is None else entry["version"]

    def commit_after(self, table: str, slice_key: str, operation: str) -> dict | None:
        """The commit info of `version_after`'s commit (as `commits` gives it)."""
        return next((c for c in self.commits(table, operation) if c["slice"] == slice_key), None)

    def commits(self, table: str, operation: str) -> Iterator[dict]:
        """The commit infos of `operation`'s slice commits that the log holds, newest first: `version`,
        `timestamp` (ms), and the metadata as `commit` took it (names without their "entity_assets." prefix: `slice`,
        `operation` and the rest)."""
        for entry in self._history(table):
            if entry.get("entity_assets.operation") == operation and "entity_assets.slice" in entry:
                yield {"version": entry["version"], "timestamp": entry.get("timestamp"),
                       **{name[len(COMMIT_PREFIX):]: value for name, value in entry.items()
                          if name.startswith(COMMIT_PREFIX)}}

    def reached(self, table: str, slice_key: str, operation: str) -> bool:
        """Whether `operation` was done for `slice_key`: the log holds its commit, or the slices
        `expire_log` recorded before it deleted older commits hold it. A whole log is checked as
        it is: a later slice's commit there does not make an earlier one (ingest takes slices in
        any order, so a slice that failed may sit between two that did not)."""
        recorded = self._open(table).metadata().configuration.get(DONE_PROPERTY + operation)
        if recorded is not None and any(low <= int(slice_key) <= high for low, high in _parse_ranges(recorded)):
            return True  # without a walk through the log, which an old slice's re-run would make whole
        later, first_version = False, 0
        for entry in self._history(table):
            first_version = entry["version"]
            if entry.get("entity_assets.operation") == operation and "entity_assets.slice" in entry:
                if entry["entity_assets.slice"] == slice_key:
                    return True
                later = later or entry["entity_assets.slice"] > slice_key
        # a log that an older release trimmed, recording nothing: a later slice's commit stands for it
        return first_version > 0 and recorded is None and later

    def slices_done(self, table: str, operation: str) -> Iterator[str]:
        """The slice keys of the commits of `operation` that the log holds, newest first."""
        return (c["slice"] for c in self.commits(table, operation))

    def _history(self, table: str) -> Iterator[dict]:
        """Commit infos newest first, read in growing pages: the commits a step asks for are
        recent, and a table's whole history grows with its age (~70 ms at 1,000 commits)."""
        dt, limit, seen = self._open(table), 16, 0
        while True:
            entries = dt.history(limit)
            yield from entries[seen:]
            if len(entries) < limit:
                return
            seen, limit = len(entries), limit * 4

    def state_rows(self, table: str, key_columns: Sequence[str], keys: set[tuple], buckets: Iterable[int]) -> list[dict]:
        """The current rows of `keys` in a bucketed state table, whose `buckets` the caller knows:
        only the files whose `bucket` range holds one of them are read, filtered by the key's last column."""
        if not keys or not self.exists(table):
            return []
        buckets = set(buckets)
        files = [f for f in self.files(table) if any(f.min.get("bucket", b) <= b <= f.max.get("bucket", b) for b in buckets)]
        last = key_columns[-1]
        return [r for t in read_tables(files, self.storage_options, None, [(last, "in", sorted({k[-1] for k in keys}))])
                for r in t.to_pylist() if tuple(r[c] for c in key_columns) in keys]

    def read(self, table: str, version: int | None = None, columns: list[str] | None = None,
             where: dict | None = None) -> pa.Table:
        """Reads a small table on the driver (manifests, summaries), pruning files by stats.

        `where` holds column equalities; files whose min/max exclude them are skipped.
        """
        actions, dt = self._actions(table, version)
        for k, v in (where or {}).items():  # in Arrow, as in slice_files: slice_manifests gains a file per slice
            if f"min.{k}" in actions.column_names:
                low, high = actions[f"min.{k}"], actions[f"max.{k}"]
                actions = actions.filter(pc.or_kleene(pc.is_null(low), pc.and_(pc.less_equal(low, v), pc.greater_equal(high, v))))
        files = self._table_files(actions, dt)
        schema = whole = pa.schema(dt.schema().to_arrow())
        if columns:
            schema = pa.schema([schema.field(c) for c in columns])
        parts = list(read_tables(files, self.storage_options, columns, schema=whole))  # null where added in place
        data = pa.concat_tables([p.cast(schema) for p in parts]) if parts else schema.empty_table()
        for k, v in (where or {}).items():
            data = data.filter(pc.equal(data[k], v))
        return data

    def changes(self, table: str, since: str | None, version: int | None = None,
                columns: list[str] | None = None) -> Iterator[pa.Table]:
        """The rows of a state table that the slices after `since` changed (every row for None), as
        of `version`: each key once, as it is now, a deletion as its row with `deleted` set.

        Each state row keeps the slice that last changed it, so this is `slice > since`, and only
        the files a later slice wrote are read (their max slice). Not Delta's Change Data Feed: a
        slice rewrites whole state files, and delta-rs cannot commit the change files that would
        tell their changed rows from the rest (docs/storage.md)."""
        actions, dt = self._actions(table, version)
        if since is not None and f"max.{SLICE}" in actions.column_names:
            high = actions[f"max.{SLICE}"]
            actions = actions.filter(pc.or_kleene(pc.is_null(high), pc.greater(high, since)))
        yield from read_tables(self._table_files(actions, dt), self.storage_options, columns,
                               None if since is None else [(SLICE, ">", since)])

    def missing(self, table: str, files: Iterable[TableFile]) -> list[TableFile]:
        """The files of a snapshot of `table` that are gone (an old version whose files a vacuum deleted)."""
        files = list(files)
        if not files:
            return []
        fs, root = filesystem(self.uri(table), self.storage_options)  # one filesystem, not one per file
        infos = fs.get_file_info([f"{root}/{f.path}" for f in files])
        return [f for f, info in zip(files, infos) if info.type == pafs.FileType.NotFound]

    def vacuum(self, table: str, retention_hours: int, full: bool = True) -> list[str]:
        """Deletes the files no version newer than `retention_hours` needs, and (`full`) files of
        that age no version names (a failed run's, never committed); returns their paths.

        Copy-on-write leaves every replaced file behind, so without this a lake grows by its
        state's size at each slice. Time travel (and so a slice's replay) reaches back
        `retention_hours`: the table's checkpoints keep the records of removed files as long
        (`DELETED_FILE_RETENTION_SETTING`, one commit when it changes), or a retention past
        Delta's 7 days would lose files that versions it reaches still name.
        """
        self._set_properties(table, {DELETED_FILE_RETENTION_SETTING: f"interval {retention_hours} hours"})
        dt = self._open(table)
        # the files a replay of the last slice reads stay, however long the lake was idle
        kept = _replay_base([e for e in dt.history() if "entity_assets.slice" in e])
        # listed, then deleted here: delta-rs's vacuum commits, and that commit's hook expires the
        # log at the table's retention whatever `_post_commit` says, past `expire_log`'s guard of
        # the commits a replay of the last slice needs
        listed = dt.vacuum(retention_hours=retention_hours, dry_run=True, enforce_retention_duration=False, full=full,
                           keep_versions=[kept["version"]] if kept else None)
        fs, root = filesystem(self.uri(table), self.storage_options)
        ahead = REQUESTS_IN_FLIGHT if is_remote(self.uri(table)) else 0  # a request a file: several at once

        def delete(path: str) -> bool:
            # the log's records of removed files name those an earlier vacuum deleted too (an
            # object store's delete of a missing key succeeds): only those still there count
            if fs.get_file_info(f"{root}/{path}").type == pafs.FileType.NotFound:
                return False
            try:
                fs.delete_file(f"{root}/{path}")
            except FileNotFoundError:  # deleted meanwhile
                return False
            return True

        return [path for path, deleted in zip(listed, prefetched(delete, listed, ahead)) if deleted]

    def expire_log(self, table: str, retention_hours: int, record_done: bool = True) -> int:
        """Deletes the Delta log files older than `retention_hours` that precede a checkpoint, as
        delta-rs would at each commit (see `_post_commit`); returns how many. Versions they held
        can no longer be opened.

        The retention becomes the table's `delta.logRetentionDuration` (one commit, when it
        changes), so any Delta engine that cleans the log keeps the same versions. The log keeps
        the commits of the table's last slice, which the next slice looks for (`commit_after`),
        and of the slice before it, whose state a replay of the last one reads: while the older
        of them is old and a checkpoint follows it (maintenance commits of an idle lake),
        nothing is deleted. `record_done=False`: a table no step asks what it `reached` (the
        manifests, which the sensor commits to outside the lake pool: no daily property commit
        that its commits would meet).
        """
        entries = self._open(table).history()
        history = [e for e in entries if "entity_assets.slice" in e]
        # the slices done, by operation, as `reached` needs them once their commits are deleted
        done: dict[str, list[tuple[int, int]]] = {}
        for entry in history:
            done.setdefault(entry.get("entity_assets.operation", ""), []).append((int(entry["entity_assets.slice"]),) * 2)
        configuration = self._open(table).metadata().configuration
        recorded = {name[len(DONE_PROPERTY):]: value for name, value in configuration.items()
                    if name.startswith(DONE_PROPERTY)}
        for op, value in recorded.items():
            done.setdefault(op, []).extend(_parse_ranges(value))
        if not recorded and min((e["version"] for e in entries), default=0) > 0:
            # a log an older release trimmed: what it deleted, the slices before its oldest commit of
            # each operation (where the trim cut; a re-run of an older slice may come later), is
            # taken as done, as that release did
            for op in done:
                oldest = min((e for e in history if e.get("entity_assets.operation", "") == op),
                             key=lambda e: e["version"])
                if int(oldest["entity_assets.slice"]) > 1:
                    done[op].append((1, int(oldest["entity_assets.slice"]) - 1))
        self._set_properties(table, {LOG_RETENTION_SETTING: f"interval {retention_hours} hours",
                                     **{DONE_PROPERTY + op: _format_ranges(ranges)
                                        for op, ranges in done.items() if op and record_done}})
        fs, path = filesystem(f"{self.uri(table)}/_delta_log", self.storage_options)
        before = fs.get_file_info(pafs.FileSelector(path))  # after that commit, whose hook may checkpoint
        kept = _replay_base(history)
        dt = self._open(table)
        checkpoints = [int(info.base_name[:20]) for info in before if ".checkpoint." in info.base_name]
        cutoff_ms = (time.time() - retention_hours * 3600) * 1000
        if kept and checkpoints and kept["version"] < max(checkpoints) and kept["timestamp"] < cutoff_ms:
            return 0
        dt.cleanup_metadata()
        return len({info.path for info in before} - {info.path for info in fs.get_file_info(pafs.FileSelector(path))})

    def read_note(self, name: str) -> str | None:
        """The text of the lake's note `name` (a file of `_notes/`, outside every table: it outlives
        a table deleted to be rebuilt), None if none."""
        fs, path = filesystem(self.uri(f"{NOTES_FOLDER}/{name}"), self.storage_options)
        try:
            with fs.open_input_stream(path) as source:
                return source.read().decode()
        except FileNotFoundError:
            return None

    def write_note(self, name: str, text: str) -> None:
        """Replaces note `name` whole: an object store's put does; a local file is renamed into place."""
        fs, path = filesystem(self.uri(f"{NOTES_FOLDER}/{name}"), self.storage_options)
        if not isinstance(fs, pafs.LocalFileSystem):
            with fs.open_output_stream(path) as sink:
                sink.write(text.encode())
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        partial = f"{path}.{uuid.uuid4().hex}"
        with open(partial, "w") as sink:
            sink.write(text)
        os.replace(partial, path)

    def delete_older(self, folder: str, hours: float) -> list[str]:
        """Deletes the files of a lake folder (not a table: e.g. the steps' outbox) last written
        more than `hours` ago; returns their paths."""
        fs, path = filesystem(self.uri(folder), self.storage_options)
        if fs.get_file_info(path).type == pafs.FileType.NotFound:
            return []
        cutoff = datetime.now(timezone.utc) - timedelta(hours=hours)
        old = [info.path for info in fs.get_file_info(pafs.FileSelector(path, recursive=True))
               if info.type == pafs.FileType.File and info.mtime is not None and info.mtime < cutoff]
        for p in old:
            fs.delete_file(p)
        return old

    def history(self, table: str, limit: int | None = None) -> list[dict]:
        return self._open(table).history(limit)

    def append_small(self, table: str, data: pa.Table, *, slice_key: str, app_txn: tuple[str, int] | None = None) -> int:
        """Driver-side append of a tiny table (slice manifests), idempotent through the app transaction."""
        from deltalake import write_deltalake
        from deltalake.transaction import CommitProperties, Transaction

        if app_txn and (self.applied(table, app_txn[0]) or -1) >= app_txn[1]:
            return self.version(table)
        dt = self._open(table)
        write_deltalake(  # through the handle, which advances to the new version: no second open of the log
            dt, data, mode="append",
            commit_properties=CommitProperties(
                custom_metadata={"entity_assets.operation": "append", "entity_assets.slice": slice_key},
                app_transactions=[Transaction(*app_txn)] if app_txn else None,
            ),
            post_commithook_properties=_post_commit(),
        )
        return dt.version()

