"""The producer that tasks publish through, against the real local broker."""

import json
import time
import weakref

import pyarrow as pa
import pytest
from confluent_kafka.admin import AdminClient

from entity_assets import kafka_io
from entity_assets.kafka_io import (BatchProducer, RecordsExpired, Spool, cluster_metadata, ensure_topics, end_offsets,
                                   produce, read_range, replay_into)
from entity_assets.publish import partition_for
from entity_assets.slices import OffsetRange


def test_producer_counts_what_the_broker_acknowledged(broker):
    config = {"bootstrap.servers": broker.bootstrap}
    ensure_topics(config, ["kafka-io-acked"], 2)
    producer = BatchProducer(config)
    for i in range(250):
        producer.send("kafka-io-acked", f"k{i}", f"v{i}", partition=i % 2)
    assert producer.close() == {"kafka-io-acked": 250}
    assert sum(end_offsets(config, ["kafka-io-acked"]).values()) == 250


def test_an_undelivered_record_fails_the_close_loudly(broker):
    """Delivery reports come only for failures: a failure must still reach close()."""
    config = {"bootstrap.servers": broker.bootstrap, "message.timeout.ms": "2000"}
    ensure_topics(config, ["kafka-io-failed"], 1)
    producer = BatchProducer(config)
    producer.send("kafka-io-failed", "k", "v", partition=7)  # the topic has one partition
    with pytest.raises(RuntimeError, match="kafka-io-failed"):
        producer.close(timeout=30)


def test_a_cluster_that_takes_nothing_fails_the_send_once_its_queue_is_full():
    """Without an answer each queued record times out in turn: minutes per 100,000 records
    before the close would say what the first failure said. No broker listens on port 9."""
    config = {"bootstrap.servers": "127.0.0.1:9", "message.timeout.ms": "1000",
              "queue.buffering.max.messages": "10"}
    producer = BatchProducer(config)
    with pytest.raises(kafka_io.DeliveryFailed, match="kafka-io-nowhere"):
        for i in range(10_000):
            producer.send("kafka-io-nowhere", f"k{i}", "v")
    assert producer.counts["kafka-io-nowhere"] < 100


def test_topics_are_created_once_the_cluster_lists_their_partitions(broker, monkeypatch):
    """A broker's metadata may lack a topic just created: the publish after it counted no
    partitions of it, a KeyError."""
    real, looks, hidden = kafka_io.cluster_metadata, [], []

    def lagging(*args, **kwargs):
        metadata = real(*args, **kwargs)
        looks.append(1)
        if "kafka-io-lagging" in metadata.topics and len(hidden) < 2:  # the first two looks that list it
            metadata.topics.pop("kafka-io-lagging")
            hidden.append(1)
        return metadata

    monkeypatch.setattr(kafka_io, "cluster_metadata", lagging)
    config = {"bootstrap.servers": broker.bootstrap}
    assert ensure_topics(config, ["kafka-io-lagging"], 2) == ["kafka-io-lagging"] and len(hidden) == 2
    assert kafka_io.partition_counts(config, ["kafka-io-lagging"]) == {"kafka-io-lagging": 2}


def test_a_cleanly_closed_producer_serves_the_next_one_and_a_failed_one_does_not(broker):
    """A handed-over producer counts and reports only its new holder's records."""
    config = {"bootstrap.servers": broker.bootstrap, "message.timeout.ms": "2000"}
    ensure_topics(config, ["kafka-io-handed-over", "kafka-io-handed-over-failing"], 1)
    first = BatchProducer(config)
    first.send("kafka-io-handed-over", "k", "v")
    first.send("kafka-io-handed-over-failing", "k", "v")  # now librdkafka knows that topic's partitions
    assert first.close() == {"kafka-io-handed-over": 1, "kafka-io-handed-over-failing": 1}
    failing = BatchProducer(config)
    assert failing._producer is first._producer
    # the topic has one partition: refused at once, and reported by close like a failed delivery
    failing.send("kafka-io-handed-over-failing", "k", "v", partition=3)
    with pytest.raises(RuntimeError, match="kafka-io-handed-over-failing"):
        failing.close(timeout=30)
    fresh = BatchProducer(config)
    assert fresh._producer is not failing._producer
    dropped = weakref.ref(failing._client)
    del first, failing  # ends the failed producer now (no reference cycle left for a garbage collection)
    assert dropped() is None
    for i in range(20):
        fresh.send("kafka-io-handed-over", f"k{i}", f"v{i}")
    assert fresh.close() == {"kafka-io-handed-over": 20}
    assert end_offsets(config, ["kafka-io-handed-over"]) == {("kafka-io-handed-over", 0): 21}


def test_a_warmed_producer_serves_the_next_publish(broker):
    config = {"bootstrap.servers": broker.bootstrap, "client.id": "kafka-io-warmed"}
    ensure_topics(config, ["kafka-io-warmed"], 1)
    kafka_io.warm_producer(config)
    kafka_io.warm_producer(config)  # one is idle already: it stays the only one
    (idle,) = [c for (_, settings), clients in kafka_io._IDLE.items() if ("client.id", "kafka-io-warmed") in settings
               for c in clients]
    producer = BatchProducer(config)
    assert producer._producer is idle.producer
    producer.send("kafka-io-warmed", "k", "v")
    assert producer.close() == {"kafka-io-warmed": 1}


def test_a_forked_child_neither_takes_nor_ends_its_parents_producers(broker, monkeypatch):
    """A child has none of the librdkafka threads behind its parent's producers."""
    config = {"bootstrap.servers": broker.bootstrap, "client.id": "kafka-io-forked"}
    ensure_topics(config, ["kafka-io-forked"], 1)
    kafka_io.warm_producer(config)
    (key,) = [k for k in kafka_io._IDLE if ("client.id", "kafka-io-forked") in k[1]]
    parents = list(kafka_io._IDLE[key])
    monkeypatch.setattr(kafka_io.os, "getpid", lambda: key[0] + 1)  # as in a forked child
    child = BatchProducer(config)
    assert child._producer is not parents[0].producer
    child.send("kafka-io-forked", "k", "v")
    assert child.close() == {"kafka-io-forked": 1}
    kafka_io.release_producers()
    assert kafka_io._IDLE[key] == parents


def test_a_spool_sends_nothing_until_replayed_then_every_record_as_sent(broker, tmp_path):
    """Keys (none, empty, text), explicit partitions or by key, one-chunk and several-chunk
    columns, batches of two topics interleaved: every record in the order sent. Three partitions:
    with a power of two, murmur2's sign mask would change no key's partition."""
    config = {"bootstrap.servers": broker.bootstrap}
    topics = ["kafka-io-spooled-a", "kafka-io-spooled-b"]
    ensure_topics(config, topics, 3)
    sent = []
    spool = Spool(open(tmp_path / "spool", "wb"), topics)
    for b in range(6):
        topic, batch = topics[b % 2], [([None, "", f"k{b}-{i}"][i % 3], "v" * (i * 37 % 2500) + f"{b}-{i}", i % 2)
                                       for i in range(50)]
        keys, values = pa.array([k for k, _, _ in batch], pa.string()), [v for _, v, _ in batch]
        by_key = b == 5  # no partitions: Kafka's murmur2 of the key picks it
        spool.send_batch(topic, keys, pa.chunked_array([values[:7], values[7:]]) if b % 3 else pa.array(values),
                         None if by_key else [p for _, _, p in batch])
        sent += [(topic, k, v, None if by_key else p) for k, v, p in batch]
    spool.close()
    assert spool.count == 300 and sum(end_offsets(config, topics).values()) == 0
    producer = BatchProducer(config)
    with open(tmp_path / "spool", "rb") as source:
        replay_into(producer, source, topics)
    assert producer.close() == {topics[0]: 150, topics[1]: 150}
    ends = end_offsets(config, topics)
    received = {(topic, p): [(m.key(), m.value()) for m in read_range(config, OffsetRange(topic, p, 0, end))]
                for (topic, p), end in ends.items()}
    for topic in topics:
        for p in (0, 1):
            explicit = [(None if k is None else k.encode(), v.encode()) for t, k, v, q in sent if t == topic and q == p]
            assert [r for r in received[(topic, p)] if r in explicit] == explicit
    assert sorted((r for got in received.values() for r in got), key=repr) == sorted(
        ((None if k is None else k.encode(), v.encode()) for _, k, v, _ in sent), key=repr)
    for (topic, p), got in received.items():  # by key: where the Java client's murmur2 puts it
        keyed = {(k.encode(), v.encode()) for t, k, v, q in sent if t == topic and q is None and k is not None}
        assert all(partition_for(k.decode(), 3) == p for k, v in got if (k, v) in keyed)


def test_offsets_a_partition_no_longer_holds_are_never_skipped_silently(broker, delete_records_before):
    """librdkafka would jump to the partition's end; a range's reader names what is gone."""
    config = {"bootstrap.servers": broker.bootstrap}
    topic = "expired-records"
    ensure_topics(config, [topic], 1)
    produce(config, topic, [(b"k", b"%d" % i) for i in range(10)])
    delete_records_before(config, {(topic, 0): 4})
    with pytest.raises(RecordsExpired, match=r"expired-records\[0\] no longer holds offsets \[0, 4\)"):
        list(read_range(config, OffsetRange(topic, 0, 0, 10)))
    gone = []
    assert [m.offset() for m in read_range(config, OffsetRange(topic, 0, 2, 10), expired=gone.append)] == [
        4, 5, 6, 7, 8, 9]
    assert [(g.start, g.stop) for g in gone] == [(2, 4)]
    gone.clear()  # past the partition's end: fewer records than when the range was planned (a topic created again)
    assert list(read_range(config, OffsetRange(topic, 0, 12, 14), expired=gone.append)) == []
    assert [(g.start, g.stop) for g in gone] == [(12, 14)]


def test_the_offsets_of_a_partition_no_longer_there_are_gone_not_a_stall(broker, monkeypatch):
    """A topic deleted (or created again with fewer partitions) after a slice closed: librdkafka
    reports nothing to a reader of the partition, which waited out its idle timeout, failing the
    run, whose retries failed alike, and every later slice was refused."""
    config = {"bootstrap.servers": broker.bootstrap}
    topic = "kafka-io-deleted"
    ensure_topics(config, [topic], 2)
    produce(config, topic, [(b"k%d" % i, b"%d" % i) for i in range(20)])
    gone = []
    assert list(read_range(config, OffsetRange(topic, 5, 0, 10), idle_timeout=600, expired=gone.append)) == []
    assert [(g.partition, g.start, g.stop) for g in gone] == [(5, 0, 10)]
    admin = AdminClient(config)  # held until its answer is in: freed, it ends its requests
    for future in admin.delete_topics([topic]).values():
        future.result()
    deadline = time.monotonic() + 30
    while topic in cluster_metadata(config).topics:
        assert time.monotonic() < deadline, f"{topic} is still listed 30 s after its deletion"
        time.sleep(0.1)
    with pytest.raises(RecordsExpired, match=r"kafka-io-deleted\[0\] no longer holds offsets \[0, 10\)"):
        list(read_range(config, OffsetRange(topic, 0, 0, 10), idle_timeout=600))
    # one "unknown topic" is not enough: a broker just restarted says so until its metadata is in
    said = iter([True, False, True, False])
    asked = []

    def absent(consumer, r):
        asked.append(time.monotonic())
        return next(said, None) if len(asked) <= 4 else real(consumer, r)

    real = kafka_io._absent
    monkeypatch.setattr(kafka_io, "_absent", absent)
    monkeypatch.setattr(kafka_io, "ABSENT_AFTER", 0.5)
    with pytest.raises(RecordsExpired):
        list(read_range(config, OffsetRange(topic, 0, 0, 10), idle_timeout=600))
    assert len(asked) >= 6 and asked[-1] - asked[4] > 0.5  # the last two no's, ABSENT_AFTER apart


def test_output_topics_are_created_with_the_configured_topic_settings(broker, monkeypatch, tmp_path):
    """From the environment to the topics a step creates on first publish: the settings of every
    output topic, and over them those of one stream (a compacted device-notifications, say)."""
    from confluent_kafka.admin import AdminClient, ConfigResource

    from entity_assets.assets.common import publishing
    from entity_assets.definitions import build_resources
    from entity_assets.storage import DeltaRsEngine

    monkeypatch.setenv("ENTITY_ASSETS_KAFKA_BOOTSTRAP", broker.bootstrap)
    monkeypatch.setenv("ENTITY_ASSETS_TOPIC_PREFIX", "kafka-io-configured.")
    monkeypatch.setenv("ENTITY_ASSETS_NEW_TOPIC_CONFIG", "retention.ms=86400000, cleanup.policy=delete")
    monkeypatch.setenv("ENTITY_ASSETS_STREAM_TOPIC_CONFIG",
                       '{"device-notifications": {"cleanup.policy": "compact", "min.compaction.lag.ms": 3600000}}')
    monkeypatch.setenv("ENTITY_ASSETS_NEW_TOPIC_REPLICATION_FACTOR", "1")
    kafka = build_resources()["kafka"]
    assert kafka.new_topic_config == {"retention.ms": "86400000", "cleanup.policy": "delete"}
    assert kafka.new_topic_replication_factor == 1
    engine = DeltaRsEngine(str(tmp_path / "lake"))
    publish_to = publishing(kafka, engine, ["entity_updates", "device_notifications"])
    assert publish_to.topics == {"entity_updates": ("kafka-io-configured.entity-updates", 4),
                                 "device_notifications": ("kafka-io-configured.device-notifications", 4)}
    assert (tmp_path / "lake" / "_outbox").is_dir()
    admin = AdminClient(kafka.config())  # held: a collected client cancels its futures
    expected = {
        "kafka-io-configured.entity-updates": {"retention.ms": "86400000", "cleanup.policy": "delete"},
        "kafka-io-configured.device-notifications": {"retention.ms": "86400000", "cleanup.policy": "compact",
                                                     "min.compaction.lag.ms": "3600000"},
    }
    for topic, settings in expected.items():
        resource = ConfigResource("topic", topic)
        described = admin.describe_configs([resource])[resource].result(30)
        assert {k: described[k].value for k in settings} == settings, topic


def test_topics_are_created_with_the_cluster_s_replicas_and_the_seed_s_durability_by_default(monkeypatch):
    """One replica would lose a topic with its broker, and a cluster of `min.insync.replicas` 2
    would refuse the idempotent producer's every write to it; the seed's derived streams are
    "time-based compacted"."""
    from entity_assets.definitions import build_resources
    from resources.kafka import DERIVED_STREAMS

    kafka = build_resources()["kafka"]
    assert kafka.new_topic_replication_factor == -1
    assert {json.dumps(kafka.new_topic_settings(s)) for s in DERIVED_STREAMS} == {
        json.dumps({"cleanup.policy": "compact", "min.compaction.lag.ms": "604800000"})}
    for wrong in ("0", "-2"):
        monkeypatch.setenv("ENTITY_ASSETS_NEW_TOPIC_REPLICATION_FACTOR", wrong)
        with pytest.raises(ValueError, match="new_topic_replication_factor: .* give 1 or more, or -1"):
            build_resources()


def test_topic_settings_name_derived_streams_by_their_seed_names(monkeypatch):
    """A stream the project does not publish, or a table's name, stops the start with the names it knows."""
    from entity_assets.definitions import build_resources

    monkeypatch.setenv("ENTITY_ASSETS_STREAM_TOPIC_CONFIG", '{"device_notifications": {"cleanup.policy": "compact"}}')
    with pytest.raises(ValueError, match="stream_topic_config: no derived stream is named device_notifications"):
        build_resources()


@pytest.mark.parametrize("name,text,says", [
    ("ENTITY_ASSETS_STREAM_TOPIC_CONFIG", '{"device-notifications": {cleanup.policy: compact}}', "is not JSON"),
    ("ENTITY_ASSETS_STREAM_TOPIC_CONFIG", '{"device-notifications": "compact"}', "must be a JSON object of objects"),
    ("ENTITY_ASSETS_INGESTION", '{"crm": "debezium"}', "must be a JSON object of objects"),
])
def test_settings_that_are_not_json_objects_stop_the_start_naming_their_variable(monkeypatch, name, text, says):
    from entity_assets.definitions import build_resources

    monkeypatch.setenv(name, text)
    with pytest.raises(ValueError, match=f"{name} {says}"):
        build_resources()


def test_the_environment_names_the_streams_to_publish(monkeypatch):
    """`ENTITY_ASSETS_PUBLISH`: true, false, or the derived streams by their seed names; a wrong name stops the start."""
    from entity_assets.definitions import build_resources

    monkeypatch.setenv("ENTITY_ASSETS_PUBLISH", "partial-responses, complete-responses")
    kafka = build_resources()["kafka"]
    assert kafka.published_streams == ["partial-responses", "complete-responses"]
    assert kafka.publishes("complete-responses") and not kafka.publishes("entity-updates")
    monkeypatch.setenv("ENTITY_ASSETS_PUBLISH", "False")
    assert not build_resources()["kafka"].publishes("complete-responses")
    monkeypatch.setenv("ENTITY_ASSETS_PUBLISH", "true")
    assert build_resources()["kafka"].publishes("device-notifications")
    monkeypatch.setenv("ENTITY_ASSETS_PUBLISH", "complete-response")
    with pytest.raises(ValueError, match="no derived stream is named complete-response .they are entity-patches"):
        build_resources()


def test_a_topic_s_limit_is_its_max_message_bytes_and_a_value_is_measured_as_the_producer_compresses_it(broker):
    """The broker holds a compressed batch to its topic's max.message.bytes: a topic it does not
    describe has no limit here (the producer's own applies), and a value's size is zstd's."""
    config = {"bootstrap.servers": broker.bootstrap}
    ensure_topics(config, ["limits.small"], 1, topic_configs={"limits.small": {"max.message.bytes": "3000"}})
    assert kafka_io.message_limits(config, ["limits.small", "limits.missing"]) == {
        "limits.small": 3000 - kafka_io.BATCH_FRAMING}
    assert kafka_io.producer_limit({}) == 4_000_000 - kafka_io.BATCH_FRAMING
    assert kafka_io.compressed_size(b"x" * 5000, {}) < 100
    assert kafka_io.compressed_size(b"x" * 5000, {"compression.type": "none"}) == 5000


def test_offsets_are_committed_to_the_slices_group_or_the_one_the_client_config_names(broker):
    from confluent_kafka import ConsumerGroupTopicPartitions
    from confluent_kafka.admin import AdminClient

    config = {"bootstrap.servers": broker.bootstrap}
    ensure_topics(config, ["commits"], partitions=2)
    produce(config, "commits", [(None, b"x")] * 6)

    def committed(group):
        admin = AdminClient(config)
        [future] = admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(group)]).values()
        return {(tp.topic, tp.partition): tp.offset for tp in future.result(10).topic_partitions if tp.topic == "commits"}

    assert kafka_io.commit_offsets(config, {("commits", 0): 2, ("commits", 1): 1}) == "entity-assets-slices"
    assert committed("entity-assets-slices") == {("commits", 0): 2, ("commits", 1): 1}
    assert kafka_io.commit_offsets({**config, "group.id": "acme.prod.entity-assets"}, {("commits", 0): 3}) \
        == "acme.prod.entity-assets"
    assert committed("acme.prod.entity-assets") == {("commits", 0): 3}


def test_a_commit_without_an_answer_says_which_group():
    with pytest.raises(kafka_io.OffsetsNotCommitted, match="group entity-assets-slices: .*"):
        kafka_io.commit_offsets({"bootstrap.servers": "127.0.0.1:1"}, {("commits", 0): 1}, timeout=1)


def test_a_message_the_producer_would_refuse_is_left_out_even_where_its_topic_takes_it():
    """A topic raised past the producer's `message.max.bytes` (16 MiB for large documents) took
    every message as fitting: librdkafka then refused one at once, after the commit, and the
    step failed at every run of its slice."""
    from entity_assets.publish import STREAMS, Publisher, Publishing

    config = {"bootstrap.servers": "127.0.0.1:1", "message.max.bytes": 10_000}
    publisher = Publisher(Publishing(config, {"entity_updates": ("entity-updates", 1)}, "/nowhere",
                                     limits={"entity_updates": 16 * 1024 * 1024}))
    texts = pa.array(["x" * 100, "y" * 20_000])
    fits = publisher._fitting("entity_updates", STREAMS["entity_updates"], pa.array(["a", "b"]), texts,
                              16 * 1024 * 1024)
    assert fits.to_pylist() == [True, False] and publisher.undeliverable == {"entity_updates": 1}


def test_a_message_size_raised_for_the_producers_is_one_the_readers_fetch(broker):
    """A deployment raises `message.max.bytes` for large messages (docs/streams.md) in the one
    client config: librdkafka refuses a consumer whose fetch size is below it."""
    config = {"bootstrap.servers": broker.bootstrap, "message.max.bytes": "60000000"}
    ensure_topics(config, ["kafka-io-large-limit"], 1)
    assert produce(config, "kafka-io-large-limit", [(f"k{i}", f"v{i}") for i in range(3)]) == 3
    assert [m.value() for m in read_range(config, OffsetRange("kafka-io-large-limit", 0, 0, 3))] == [b"v0", b"v1", b"v2"]
    assert end_offsets(config, ["kafka-io-large-limit"]) == {("kafka-io-large-limit", 0): 3}


def test_the_size_check_measures_with_the_codec_the_producer_uses():
    """`compression.codec` is librdkafka's other name of `compression.type`: set, it is the codec."""
    text = json.dumps([{"id": i, "name": f"entity {i}", "zone": "A" * (i % 7)} for i in range(20_000)]).encode()
    assert kafka_io.compressed_size(text, {"compression.codec": "lz4"}) == kafka_io.compressed_size(
        text, {"compression.type": "lz4"}) != kafka_io.compressed_size(text, {})
    assert kafka_io.producer_settings({"compression.codec": "none"})["compression.type"] == "none"


def test_the_size_check_takes_the_codec_s_name_in_any_case_as_librdkafka_does():
    """`compression.type=ZSTD` measured the uncompressed length: a message over the topic's
    limit that fits once compressed was left off Kafka as undeliverable."""
    text = json.dumps([{"id": i, "name": f"entity {i}"} for i in range(20_000)]).encode()
    for codec in ("zstd", "gzip", "lz4", "snappy"):
        assert kafka_io.compressed_size(text, {"compression.type": codec.upper()}) == kafka_io.compressed_size(
            text, {"compression.type": codec}) < len(text) // 2


@pytest.mark.parametrize("codec, librdkafka_level", [("gzip", 6), ("zstd", 3)])
def test_the_default_compression_level_is_measured_at_librdkafka_s_level_not_arrow_s(codec, librdkafka_level):
    """`compression.level` -1 is librdkafka's default of the codec (zlib's 6, zstd's 3): Arrow's
    own (gzip 9, zstd 1) compress this text smaller than the producer does, so a message could
    pass the check and be refused by the broker."""
    text = json.dumps([{"id": i, "name": f"entity {i}", "zone": "A" * (i % 7)} for i in range(20_000)]).encode()
    sent = pa.Codec(codec, compression_level=librdkafka_level).compress(text).size
    assert pa.Codec(codec).compress(text).size < sent
    assert kafka_io.compressed_size(text, {"compression.type": codec, "compression.level": -1}) == sent
    assert kafka_io.compressed_size(text, {"compression.type": codec, "compression.level": "-1"}) == sent


def test_a_level_librdkafka_caps_is_measured_at_its_cap():
    """librdkafka takes `compression.level` up to 12 and compresses gzip at 9 at most; Arrow refuses 12."""
    text = b"entity " * 5000
    assert kafka_io.compressed_size(text, {"compression.type": "gzip", "compression.level": 12}) == pa.Codec(
        "gzip", compression_level=9).compress(text).size


def test_a_partition_the_metadata_gives_no_leader_is_not_asked_for_its_offsets(broker, monkeypatch):
    """librdkafka would wait out the whole timeout for it, a sensor's 60 s."""
    config = {"bootstrap.servers": broker.bootstrap}
    ensure_topics(config, ["kafka-io-leaderless"], 3)
    real, asked = kafka_io.cluster_metadata, []

    def leaderless(*args, **kwargs):
        metadata = real(*args, **kwargs)
        metadata.topics["kafka-io-leaderless"].partitions[1].leader = -1
        return metadata

    class Counted(kafka_io.AdminClient):
        def list_offsets(self, partitions, **kwargs):
            asked.extend(tp.partition for tp in partitions)
            return super().list_offsets(partitions, **kwargs)

    monkeypatch.setattr(kafka_io, "cluster_metadata", leaderless)
    monkeypatch.setattr(kafka_io, "AdminClient", Counted)
    unanswered: list[str] = []
    marks = kafka_io.watermarks(config, ["kafka-io-leaderless"], unanswered=unanswered)
    assert sorted(p for _, p in marks) == [0, 2] and sorted(asked) == [0, 0, 2, 2]  # first and end offsets
    assert unanswered == ["kafka-io-leaderless partition 1 (no leader)"]


def test_every_partition_s_offsets_come_in_one_request_per_broker_and_a_failed_answer_is_named(broker, monkeypatch):
    """Asked one by one in a fixed order under one deadline, the same last partitions of a large
    cluster were out of time at every tick, and never sliced."""
    from concurrent.futures import Future

    from confluent_kafka import KafkaError, KafkaException

    config = {"bootstrap.servers": broker.bootstrap}
    topics = ["kafka-io-batched-a", "kafka-io-batched-b"]
    ensure_topics(config, topics, 3)
    produce(config, topics[1], [(f"k{i}", f"v{i}") for i in range(30)])
    requests = []

    class Failing(kafka_io.AdminClient):
        def list_offsets(self, partitions, **kwargs):
            requests.append(len(partitions))
            failed = Future()
            failed.set_exception(KafkaException(KafkaError(KafkaError.NOT_LEADER_FOR_PARTITION)))
            return {tp: failed if (tp.topic, tp.partition) == (topics[0], 2) else future
                    for tp, future in super().list_offsets(partitions, **kwargs).items()}

    monkeypatch.setattr(kafka_io, "AdminClient", Failing)
    unanswered: list[str] = []
    marks = kafka_io.watermarks(config, topics, unanswered=unanswered)
    assert requests == [6, 6]  # the one broker: its first offsets, its end offsets
    assert sorted(marks) == [(topics[0], 0), (topics[0], 1), *((topics[1], p) for p in range(3))]
    assert sum(high for _, high in marks.values()) == 30 and all(low == 0 for low, _ in marks.values())
    assert len(unanswered) == 1 and unanswered[0].startswith(f"{topics[0]} partition 2 (")
    with pytest.raises(kafka_io.KafkaUnreachable, match=f"{topics[0]} partition 2"):  # asked without `unanswered`
        kafka_io.watermarks(config, topics)


def test_a_slice_ends_at_the_last_stable_offset_unless_the_client_config_reads_uncommitted(broker):
    """A reader (read_committed) never gets past a transaction still open: a slice ending inside
    it would wait for records it cannot read."""
    from confluent_kafka import Producer

    config = {"bootstrap.servers": broker.bootstrap}
    topic = "kafka-io-open-transaction"
    ensure_topics(config, [topic], 1)
    produce(config, topic, [(f"k{i}", f"v{i}") for i in range(10)])
    producer = Producer({**config, "transactional.id": "kafka-io-open-transaction"})
    producer.init_transactions(30)
    producer.begin_transaction()
    for i in range(5):
        producer.produce(topic, b"uncommitted", b"k", 0)
    assert producer.flush(30) == 0
    try:
        assert end_offsets(config, [topic]) == {(topic, 0): 10}
        assert end_offsets({**config, "isolation.level": "read_uncommitted"}, [topic]) == {(topic, 0): 15}
        # a slice closed by a sensor that read uncommitted ends inside the transaction: its
        # records are not gone, only not readable yet by a read_committed reader, which waits
        gone = []
        with pytest.raises(TimeoutError, match=r"stalled at 10 before 15"):
            list(read_range(config, OffsetRange(topic, 0, 0, 15), idle_timeout=2, expired=gone.append))
        assert gone == []
    finally:
        producer.abort_transaction(30)


def test_a_topic_named_that_the_cluster_lacks_is_unanswered_and_raises_nothing(broker):
    """A seed input topic never created would be read never, and said nowhere."""
    config = {"bootstrap.servers": broker.bootstrap}
    ensure_topics(config, ["kafka-io-named"], 1)
    unanswered: list[str] = []
    marks = kafka_io.watermarks(config, ["kafka-io-named", "kafka-io-never-created"], unanswered=unanswered)
    assert list(marks) == [("kafka-io-named", 0)]
    assert unanswered == ["kafka-io-never-created (not in the cluster's metadata: not created, or not Describe-able)"]
    assert list(end_offsets(config, ["kafka-io-named", "kafka-io-never-created"])) == [("kafka-io-named", 0)]
    # none of them there: an empty answer says so (the sensor names a cluster without an input topic)
    assert kafka_io.watermarks(config, ["kafka-io-never-created"], unanswered=unanswered) == {}
    assert len(unanswered) == 1
    assert kafka_io.watermarks(config, lambda t: t == "kafka-io-never-created", unanswered=unanswered) == {}
    assert len(unanswered) == 1


def test_a_seed_input_topic_the_cluster_lacks_is_named_by_the_input_watermarks(broker):
    from entity_assets.ingest import INPUT_STREAMS
    from resources import KafkaResource

    kafka = KafkaResource(bootstrap_servers=broker.bootstrap, topic_prefix="kafka-io-seeds.")
    unanswered: list[str] = []
    assert kafka.input_watermarks(unanswered=unanswered) == {} and unanswered == []  # no input topic: the sensor says it
    ensure_topics(kafka.config(), [kafka.topic("entity-batches"), kafka.topic("connections")], 2)
    marks = kafka.input_watermarks(unanswered=unanswered)
    assert sorted(marks) == sorted((kafka.topic(s), p) for s in ("entity-batches", "connections") for p in range(2))
    assert unanswered == [f"{kafka.topic(s)} (not in the cluster's metadata: not created, or not Describe-able)"
                          for s in INPUT_STREAMS if s not in ("entity-batches", "connections")]
    assert kafka.input_watermarks() == marks  # without `unanswered`: nothing raised


def test_a_range_past_the_partition_s_end_is_reported_gone_at_its_end_not_after_a_stall(broker):
    """A topic created again and refilled to below a slice's end (or a log an unclean leader
    election cut short): the read stalled at the partition's end, failing the run, whose retries
    failed alike, and every later slice was refused."""
    config = {"bootstrap.servers": broker.bootstrap}
    topic = "kafka-io-ends-early"
    ensure_topics(config, [topic], 1)
    produce(config, topic, [(b"k", b"%d" % i) for i in range(40)])
    gone = []
    try:
        # a stall would raise after the idle timeout: the partition's end tells it first
        read = [m.offset() for m in read_range(config, OffsetRange(topic, 0, 0, 90), idle_timeout=600,
                                               expired=gone.append)]
    except TimeoutError as exc:
        pytest.fail(f"the read stalled instead of reporting the offsets gone: {exc}")
    assert read == list(range(40))
    assert [(g.topic, g.partition, g.start, g.stop) for g in gone] == [(topic, 0, 40, 90)]
    with pytest.raises(RecordsExpired, match=r"kafka-io-ends-early\[0\] no longer holds offsets \[40, 90\)"):
        list(read_range(config, OffsetRange(topic, 0, 30, 90), idle_timeout=600))


def test_a_small_slice_s_spools_are_held_in_memory_up_to_a_budget_then_written_to_files(tmp_path, monkeypatch):
    """The driver holds its tasks' spools (a small slice's) to save an object store's requests,
    but only up to `HELD_BYTES`: 1,000 patches of 100 KB documents once held 400 MB there."""
    from entity_assets import publish
    from entity_assets.kafka_io import spooled

    monkeypatch.setattr(publish, "HELD_BYTES", 3_000)  # one small spool (1.8 KB) fits
    publishing = publish.Publishing({}, {"entity_updates": ("entity-updates", 1)}, str(tmp_path),
                                    held_by=publish.process())

    def spool(values: int):
        publisher = publish.Publisher(publishing)
        publisher._spool().send_batch("entity-updates", pa.array([b"k"] * values), pa.array([b"v" * 100] * values))
        return publisher.close()["path"]

    small, large, after = spool(10), spool(50), spool(10)
    assert small in publishing.held and large not in publishing.held  # past the budget: to its file
    assert after not in publishing.held  # the budget is the driver's, its first spool spent part of it
    for path in (large, after):
        with pa.OSFile(path, "rb") as source:
            assert sum(batch.num_rows for batch in spooled(source)) == {large: 50, after: 10}[path]
    assert sum(batch.num_rows for batch in spooled(pa.BufferReader(publishing.held[small]))) == 10
