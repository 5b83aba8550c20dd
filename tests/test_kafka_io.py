"""The producer that tasks publish through, against the real local broker."""

import pytest

from entity_assets.kafka_io import BatchProducer, ensure_topics, end_offsets


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
