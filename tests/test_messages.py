"""Message models against the seed's stream catalogue (seeds/004), and the dead-letter codes."""

from __future__ import annotations

import json
import pickle
import uuid
from typing import Any

import pyarrow as pa
import pydantic_core
import pytest
from pydantic import BaseModel, TypeAdapter, ValidationError

from entity_assets.messages import (
    APP_VERSION_CHARS,
    MAX_MESSAGE_BYTES,
    TOPIC_MODELS,
    CompleteResponse,
    Connection,
    DeadLetterCode,
    ChangeByDevice,
    DeviceNotification,
    EntityBatch,
    EntityPatch,
    EntityUpdate,
    InvalidMessage,
    NotificationAck,
    PartialResponse,
    PatchOp,
    PatchSpec,
    SchemaLearningEntityType,
    SchemaPatch,
    SchemaUpdate,
    ZoneSubscription,
    parse_message,
    value_json,
)
from entity_assets.tables import SCHEMAS


# The models written back out, as a client library would: the seed's samples must survive a
# round trip. (The pipeline publishes through `encode`, whose texts
# test_whole_graph.test_every_message_published_is_a_message_of_its_streams_model parses with these models.)
_TRI_STATE = ("before", "after")


def _has_kept_nulls(model: BaseModel) -> bool:
    fields_set = model.__pydantic_fields_set__
    for name in _TRI_STATE:
        if name in fields_set and getattr(model, name, 0) is None:
            return True
    extra = model.__pydantic_extra__
    return bool(extra) and any(value is None for value in extra.values())


def to_message(model: BaseModel) -> dict[str, Any]:
    """The model as a JSON-ready dict.

    None optionals are omitted, except ``before``/``after`` explicitly set to None (and null
    extras of a PartialResponse), which are written as null: a null ``before`` tells the client
    the entity was created. ``dbid`` appears as both ``dbid`` and ``db``.
    """
    out: dict[str, Any] = model.__pydantic_serializer__.to_python(
        model, mode="json", by_alias=True, exclude_none=True
    )
    if _has_kept_nulls(model):
        fields_set = model.__pydantic_fields_set__
        for name in _TRI_STATE:
            if name in fields_set and getattr(model, name, 0) is None:
                out[name] = None
        for name, value in (model.__pydantic_extra__ or {}).items():
            if value is None:
                out[name] = None
    return out


def to_json(model: BaseModel) -> bytes:
    """``to_message`` as compact UTF-8 JSON, serialized straight from the model when possible."""
    if _has_kept_nulls(model):
        return pydantic_core.to_json(to_message(model))
    return model.__pydantic_serializer__.to_json(model, by_alias=True, exclude_none=True)


CLIENT = "c297cf20-18bd-40e2-827d-9b563ca28ccd"

# ---------------------------------------------------------------- the seed's samples, verbatim

ENTITY_BATCH = """
  {
      "db": "my-db",
      "clientid": "c297cf20-18bd-40e2-827d-9b563ca28ccd",
      "request": 2,
      "user": "jsmith",
      "begun": 1415747086227,
      "includeBefore": true,
      "includeAfter": true,
      "learning" : true,
      "patches" : [
          {
              "collection": "Contacts",
              "zone": "default",
              "entity": "400cb092-00af-4e44-bdcb-1a0c536692bf",
              "ops": [
                  {
                      "op": "add",
                      "path": "firstName",
                      "value": "Sally"
                  },
                  {
                      "op": "add",
                      "path": "lastName",
                      "value": "Anderson"
                  },
                  {
                      "op": "add",
                      "path": "phone/home",
                      "value": "1-222-555-1234"
                  }
              ]
          }
      ]
  }
"""

ENTITY_PATCH = """
  {
      "db": "my-db",
      "collection": "Contacts",
      "zone": "default",
      "entity": "400cb092-00af-4e44-bdcb-1a0c536692bf",
      "clientid": "c297cf20-18bd-40e2-827d-9b563ca28ccd",
      "request": 2,
      "user": "jsmith",
      "begun": 1415747086227,
      "part": 1,
      "parts": 1,
      "includeBefore": true,
      "includeAfter": true,
      "learning" : true,
      "ops": [
          {"op": "add", "path": "firstName", "value": "Sally"},
          {"op": "add", "path": "lastName", "value": "Anderson"},
          {"op": "add", "path": "phone/home", "value": "1-222-555-1234"}
      ]
  }
"""

ENTITY_UPDATE = """
  {
      "db": "my-db",
      "collection": "Contacts",
      "zone": "default",
      "entity": "400cb092-00af-4e44-bdcb-1a0c536692bf",
      "clientid": "c297cf20-18bd-40e2-827d-9b563ca28ccd",
      "request": 2,
      "user": "jsmith",
      "begun": 1415747086227,
      "part": 1,
      "parts": 1,
      "ops": [
          {"op": "add", "path": "firstName", "value": "Sally"},
          {"op": "add", "path": "lastName", "value": "Anderson"},
          {"op": "add", "path": "phone/home", "value": "1-222-555-1234"}
      ],
      "status": 1,
      "before": null,
      "ended": 1415747086327,
      "after": {
          "firstName": "Sally",
          "lastName": "Anderson",
          "phone": {
              "home": "1-222-555-1234"
          }
      }
  }
"""

SCHEMA_PATCH = """
  {
      "db": "my-db",
      "clientid": "c297cf20-18bd-40e2-827d-9b563ca28ccd",
      "request": 2,
      "user": "jsmith",
      "begun": 1415747089227,
      "part": 1,
      "parts": 1,
      "includeBefore": true,
      "includeAfter": true,
      "ops": [
          {
              "op": "add",
              "path": "Contacts/fields/firstName",
              "value": {
                  "type" : "STRING",
                  "optional" : false
              }
          }
      ]
  }
"""

SCHEMA_UPDATE = """
  {
      "db": "my-db",
      "clientid": "c297cf20-18bd-40e2-827d-9b563ca28ccd",
      "request": 2,
      "user": "jsmith",
      "begun": 1415747089227,
      "part": 1,
      "parts": 1,
      "includeBefore": true,
      "includeAfter": true,
      "ops": [
          {
              "op": "add",
              "path": "Contacts/fields/homePhone",
              "value": {"type" : "STRING", "optional" : true}
          }
      ],
      "status": 1,
      "ended": 1415747089327,
      "before": {
          "Contacts" : {"fields" : {
              "firstName" : {"type" : "STRING", "optional" : false},
              "lastName" : {"type" : "STRING", "optional" : false}
          }},
          "Groups" : {"fields" : {"groupName" : {"type" : "STRING", "optional" : false}}}
      },
      "after": {
          "Contacts" : {"fields" : {
              "firstName" : {"type" : "STRING", "optional" : false},
              "lastName" : {"type" : "STRING", "optional" : false},
              "homePhone" : {"type" : "STRING", "optional" : true}
          }},
          "Groups" : {"fields" : {"groupName" : {"type" : "STRING", "optional" : false}}}
      }
  }
"""

SCHEMA_LEARNING = """
  {
      "db": "my-db",
      "clientid": "c297cf20-18bd-40e2-827d-9b563ca28ccd",
      "request": 2,
      "user": "jsmith",
      "begun": 1415747089837,
      "part": 1,
      "status": 1,
      "after": {
          "Contacts" : {"fields" : {
              "firstName" : {"type" : "STRING", "optional" : false},
              "lastName" : {"type" : "STRING", "optional" : false},
              "homePhone" : {"type" : "STRING", "optional" : true}
          }}
      }
  }
"""

# The seed's sample ends with "}\n }" instead of "]\n}" (not JSON) and lacks "ended", which its
# own table requires; COMPLETE_RESPONSE is that sample with both repaired.
COMPLETE_RESPONSE_AS_SEEDED = """
  {
      "clientid": "c297cf20-18bd-40e2-827d-9b563ca28ccd",
      "request": 2,
      "user": "jsmith",
      "begun": 1415747086227,
      "parts": 2,
      "responses": [
          {
              "db": "my-db", "collection": "Contacts", "zone": "default",
              "entity": "400cb092-00af-4e44-bdcb-1a0c536692bf",
              "clientid": "c297cf20-18bd-40e2-827d-9b563ca28ccd",
              "request": 2, "user": "jsmith", "begun": 1415747086227, "part": 1, "parts": 2,
              "ops": [
                  {"op": "add", "path": "firstName", "value": "Sally"},
                  {"op": "add", "path": "lastName", "value": "Anderson"},
                  {"op": "add", "path": "phone/home", "value": "1-222-555-1234"}
              ],
              "status": 1, "before": null, "ended": 1415747086327,
              "after": {"firstName": "Sally", "lastName": "Anderson",
                        "phone": {"home": "1-222-555-1234"}}
          },
          {
              "db": "my-db", "collection": "Contacts", "zone": "default",
              "entity": "101c3c90-e304-4279-b6a0-020363c925c6",
              "clientid": "c297cf20-18bd-40e2-827d-9b563ca28ccd",
              "request": 2, "user": "jsmith", "begun": 1415747086227, "part": 2, "parts": 2,
              "ops": [
                  {"op": "add", "path": "firstName", "value": "William"},
                  {"op": "add", "path": "lastName", "value": "Johnson"},
                  {"op": "add", "path": "homePhone", "value": "1-222-555-9876"}
              ],
              "status": 1, "ended": 1415747086328, "before": null,
              "after": {"firstName": "William", "lastName": "Johnson",
                        "homePhone": "1-222-555-9876"}
          }
     }
  }
"""
_TAIL = "\n     }\n  }"
assert COMPLETE_RESPONSE_AS_SEEDED.rstrip().endswith(_TAIL)
_repaired = json.loads(COMPLETE_RESPONSE_AS_SEEDED.rstrip()[: -len(_TAIL)] + "]}")
COMPLETE_RESPONSE = json.dumps({**_repaired, "ended": 1415747086328})

CONNECTION = """
  {
      "db": "my-db",
      "clientid": "c297cf20-18bd-40e2-827d-9b563ca28ccd",
      "user": "jsmith",
      "device": "7980f77c-2529-4978-9281-c44297c0f57e",
      "appVersion": "1.1",
      "begun": 1415747103842
  }
"""

CHANGE_BY_DEVICE = """
  {
      "db": "my-db",
      "collection": "Contacts",
      "zone": "default",
      "entity": "101c3c90-e304-4279-b6a0-020363c925c6",
      "notification" : "c4b61f69-2180-4471-b00f-179be3c918c1",
      "action": "created",
      "ended": 1415747086328
  }
"""

DEVICE_NOTIFICATION = """
  {
      "db": "my-db",
      "user": "jsmith",
      "device": "7980f77c-2529-4978-9281-c44297c0f57e",
      "count": 3,
      "begun": 1415747103842,
      "ended": 1415747104012
  }
"""

SAMPLES = [
    (EntityBatch, ENTITY_BATCH),
    (EntityPatch, ENTITY_PATCH),
    (EntityUpdate, ENTITY_UPDATE),
    (SchemaPatch, SCHEMA_PATCH),
    (SchemaUpdate, SCHEMA_UPDATE),
    (SchemaLearningEntityType, SCHEMA_LEARNING),
    (EntityUpdate, ENTITY_UPDATE),  # schema-learning's entity messages are entity-updates
    (PartialResponse, ENTITY_UPDATE),  # partial-responses carry the entity-update structure
    (PartialResponse, SCHEMA_UPDATE),
    (CompleteResponse, COMPLETE_RESPONSE),
    (Connection, CONNECTION),
    (ChangeByDevice, CHANGE_BY_DEVICE),
    (DeviceNotification, DEVICE_NOTIFICATION),
]


def _expected_wire(sample: str) -> dict:
    """The sample as we publish it: db also written as dbid."""
    doc = json.loads(sample)
    if "db" in doc:
        doc["dbid"] = doc["db"]
    return doc


@pytest.mark.parametrize(("model", "sample"), SAMPLES, ids=lambda v: getattr(v, "__name__", ""))
def test_seed_sample_validates_and_round_trips(model, sample):
    msg = parse_message(model, sample.encode())
    assert isinstance(msg, model)
    if "db" in json.loads(sample):
        assert msg.dbid == "my-db"
    wire = to_message(msg)
    assert json.loads(to_json(msg)) == wire
    # defaults the sample leaves implicit (learning etc.) are written out explicitly
    assert wire == _expected_wire(sample) | _defaults_written(model, sample)


def _defaults_written(model, sample) -> dict:
    doc = json.loads(sample)
    return {
        name: False
        for name in ("learning", "includeBefore", "includeAfter")
        if name in model.model_fields and name not in doc
    }


def test_entity_update_sample_keeps_before_null():
    msg = parse_message(EntityUpdate, ENTITY_UPDATE.encode())
    assert msg.before is None and "before" in msg.model_fields_set
    assert msg.after == {"firstName": "Sally", "lastName": "Anderson", "phone": {"home": "1-222-555-1234"}}
    out = json.loads(to_json(msg))
    assert "before" in out and out["before"] is None
    assert out["db"] == out["dbid"] == "my-db"
    assert "error" not in out
    assert parse_message(EntityUpdate, to_json(msg)) == msg


def test_before_after_tri_state_on_output():
    base = json.loads(ENTITY_UPDATE)
    del base["before"], base["after"]
    msg = EntityUpdate.model_validate(base)
    out = to_message(msg)
    assert "before" not in out and "after" not in out  # not requested: absent
    deleted = EntityUpdate(**{**base, "after": None})
    assert to_message(deleted)["after"] is None and "before" not in to_message(deleted)
    built = EntityUpdate(**{**base, "before": None, "after": {"x": None}})
    assert json.loads(to_json(built))["before"] is None
    assert json.loads(to_json(built))["after"] == {"x": None}  # nulls inside documents are data


def test_partial_response_keeps_extra_fields_and_nulls():
    msg = parse_message(PartialResponse, ENTITY_UPDATE.encode())
    assert msg.model_extra["collection"] == "Contacts"
    out = json.loads(to_json(msg))
    assert out["before"] is None and out["ops"][0]["value"] == "Sally"
    assert out == _expected_wire(ENTITY_UPDATE)


def test_complete_response_keeps_nested_nulls():
    msg = parse_message(CompleteResponse, COMPLETE_RESPONSE.encode())
    assert [r["before"] for r in msg.responses] == [None, None]
    assert json.loads(to_json(msg)) == json.loads(COMPLETE_RESPONSE)


def test_complete_response_as_seeded_is_rejected():
    with pytest.raises(InvalidMessage) as exc:
        parse_message(CompleteResponse, COMPLETE_RESPONSE_AS_SEEDED.encode())
    assert exc.value.code is DeadLetterCode.MALFORMED_JSON
    with pytest.raises(InvalidMessage) as exc:
        parse_message(CompleteResponse, json.dumps(_repaired).encode())
    assert exc.value.code is DeadLetterCode.BAD_FORMAT
    assert exc.value.reason == "ended: field required"


def test_schema_learning_accepts_part_or_parts():
    doc = json.loads(SCHEMA_LEARNING)
    assert parse_message(SchemaLearningEntityType, SCHEMA_LEARNING.encode()).part == 1
    with_parts = {**{k: v for k, v in doc.items() if k != "part"}, "parts": 4}
    assert parse_message(SchemaLearningEntityType, json.dumps(with_parts).encode()).parts == 4
    neither = {k: v for k, v in doc.items() if k != "part"}
    err = _invalid(SchemaLearningEntityType, neither)
    assert err.code is DeadLetterCode.BAD_FORMAT and err.reason.startswith("parts:")


def test_dbid_or_db_accepted():
    doc = json.loads(ENTITY_BATCH)
    doc["dbid"] = doc.pop("db")
    assert parse_message(EntityBatch, json.dumps(doc).encode()).dbid == "my-db"
    doc["db"] = "my-db"  # both, same value
    assert parse_message(EntityBatch, json.dumps(doc).encode()).dbid == "my-db"


@pytest.mark.parametrize("model, sample", [(EntityBatch, ENTITY_BATCH), (EntityPatch, ENTITY_PATCH),
                                           (SchemaPatch, SCHEMA_PATCH)])
def test_a_null_flag_reads_as_absent_and_any_other_non_boolean_is_a_dead_letter(model, sample):
    """The seed's optional booleans default to false; clients that write unset fields as null send null."""
    doc = json.loads(sample)
    flags = [name for name in ("learning", "includeBefore", "includeAfter") if name in model.model_fields]
    msg = parse_message(model, json.dumps({**doc, **dict.fromkeys(flags)}).encode())
    assert [getattr(msg, name) for name in flags] == [False] * len(flags)
    with pytest.raises(InvalidMessage) as err:
        parse_message(model, json.dumps({**doc, flags[0]: 0}).encode())
    assert err.value.code is DeadLetterCode.BAD_FORMAT and err.value.reason.startswith(f"{flags[0]}:")


def test_unknown_fields_ignored():
    doc = {**json.loads(CONNECTION), "os": "iOS 8", "nested": {"a": [1]}}
    msg = parse_message(Connection, json.dumps(doc).encode())
    assert "os" not in to_message(msg)


# ---------------------------------------------------------------- error codes


def _batch(**changes) -> dict:
    doc = json.loads(ENTITY_BATCH)
    doc.update(changes)
    return doc


def _invalid(model, payload) -> InvalidMessage:
    raw = payload if isinstance(payload, (bytes, type(None))) else json.dumps(payload).encode()
    with pytest.raises(InvalidMessage) as exc:
        parse_message(model, raw)
    return exc.value


def _with_op(op: dict) -> dict:
    doc = _batch()
    doc["patches"][0]["ops"][1] = op
    return doc


@pytest.mark.parametrize(
    ("payload", "code", "reason"),
    [
        (b'{"db": "my-db", "clientid": ', DeadLetterCode.MALFORMED_JSON, "Invalid JSON"),
        (b'{"db": "my-db"} trailing', DeadLetterCode.MALFORMED_JSON, "Invalid JSON"),
        (b"\xff\xfe", DeadLetterCode.MALFORMED_JSON, "Invalid JSON"),
        (b"[1, 2]", DeadLetterCode.BAD_FORMAT, "not a JSON object"),
        (b'"text"', DeadLetterCode.BAD_FORMAT, "not a JSON object"),
        (b"null", DeadLetterCode.BAD_FORMAT, "not a JSON object"),
        (b"", DeadLetterCode.BAD_FORMAT, "empty"),
        (None, DeadLetterCode.BAD_FORMAT, "empty"),
        ({k: v for k, v in _batch().items() if k != "clientid"}, DeadLetterCode.BAD_FORMAT,
         "clientid: field required"),
        (_batch(request="2"), DeadLetterCode.BAD_FORMAT, "request: input should be a valid integer"),
        (_batch(request=2.5), DeadLetterCode.BAD_FORMAT, "request: input should be a valid integer"),
        (_batch(request=2.0), DeadLetterCode.BAD_FORMAT, "request: input should be a valid integer"),
        (_batch(request=True), DeadLetterCode.BAD_FORMAT, "request: input should be a valid integer"),
        (_batch(learning="true"), DeadLetterCode.BAD_FORMAT, "learning: input should be a valid boolean"),
        (_batch(learning=1), DeadLetterCode.BAD_FORMAT, "learning: input should be a valid boolean"),
        (_batch(clientid="not-a-uuid"), DeadLetterCode.INVALID_UUID, "clientid: not a UUID"),
        (_batch(clientid="c297cf2018bd40e2827d9b563ca28ccd"), DeadLetterCode.INVALID_UUID, "clientid"),
        (_batch(clientid=""), DeadLetterCode.INVALID_UUID, "clientid"),
        (_batch(clientid=42), DeadLetterCode.BAD_FORMAT, "clientid: input should be a valid string"),
        (_with_op({"op": "delete", "path": "x"}), DeadLetterCode.BAD_FORMAT, "patches.0.ops.1.op: input should be"),
        (_with_op({"op": "add", "path": "x"}), DeadLetterCode.BAD_FORMAT,
         "patches.0.ops.1.value: field required for op 'add'"),
        (_with_op({"op": "replace", "path": "x"}), DeadLetterCode.BAD_FORMAT, "patches.0.ops.1.value"),
        (_with_op({"op": "test", "path": "x"}), DeadLetterCode.BAD_FORMAT, "patches.0.ops.1.value"),
        (_with_op({"op": "move", "path": "x"}), DeadLetterCode.BAD_FORMAT,
         "patches.0.ops.1.from: field required for op 'move'"),
        (_with_op({"op": "copy", "path": "x", "value": 1}), DeadLetterCode.BAD_FORMAT, "patches.0.ops.1.from"),
        (_with_op({"op": "add", "value": 1}), DeadLetterCode.BAD_FORMAT, "patches.0.ops.1.path: field required"),
        (_with_op({"path": "x", "value": 1}), DeadLetterCode.BAD_FORMAT, "patches.0.ops.1.op: field required"),
        (_with_op({"op": None, "path": "x"}), DeadLetterCode.BAD_FORMAT, "patches.0.ops.1.op: input should be 'add'"),
        (_with_op({"op": "move", "path": "x", "from": 5}), DeadLetterCode.BAD_FORMAT,
         "patches.0.ops.1.from: input should be a valid string"),
        (_with_op("add"), DeadLetterCode.BAD_FORMAT, "patches.0.ops.1: input should be an object"),
        (_batch(patches=[]), DeadLetterCode.BAD_FORMAT, "patches: list should have at least 1 item"),
        (_batch(patches=[{"collection": "C", "zone": "z", "entity": "e", "ops": []}]),
         DeadLetterCode.BAD_FORMAT, "patches.0.ops: list should have at least 1 item"),
        (_batch(patches=[{"collection": "", "zone": "z", "entity": "e", "ops": [{"op": "remove", "path": "a"}]}]),
         DeadLetterCode.BAD_FORMAT, "patches.0.collection"),
        (_batch(dbid="other-db"), DeadLetterCode.BAD_FORMAT, "dbid: 'db' (my-db) and 'dbid' (other-db) differ"),
        ({k: v for k, v in _batch().items() if k != "db"}, DeadLetterCode.BAD_FORMAT, "dbid: field required"),
    ],
)
def test_error_codes(payload, code, reason):
    err = _invalid(EntityBatch, payload)
    assert err.code is code
    assert reason in err.reason
    assert str(err).startswith(code.value)


def test_a_connection_names_its_app_version():
    """The app-version counts of `devices` (the seed's reason for the stream) name each version."""
    err = _invalid(Connection, {**json.loads(CONNECTION), "appVersion": ""})
    assert err.code is DeadLetterCode.BAD_FORMAT and "appVersion" in err.reason
    # counted by value in every later devices commit: a version is short
    assert Connection.model_validate({**json.loads(CONNECTION), "appVersion": "1" * APP_VERSION_CHARS})
    err = _invalid(Connection, {**json.loads(CONNECTION), "appVersion": "1" * (APP_VERSION_CHARS + 1)})
    assert err.code is DeadLetterCode.BAD_FORMAT and "appVersion" in err.reason


def test_bad_uuid_wins_over_other_errors():
    err = _invalid(EntityBatch, _batch(clientid="nope", request="2"))
    assert err.code is DeadLetterCode.INVALID_UUID
    assert "request" in err.reason


def test_oversize_checked_before_parsing():
    raw = b"{" + b" " * (MAX_MESSAGE_BYTES - 1) + b"x"  # 1_000_001 bytes, not even JSON
    assert len(raw) == MAX_MESSAGE_BYTES + 1
    err = _invalid(EntityBatch, raw)
    assert err.code is DeadLetterCode.OVERSIZE and "1000001" in err.reason
    body = json.dumps(_batch()).encode()
    at_limit = body + b" " * (MAX_MESSAGE_BYTES - len(body))
    assert parse_message(EntityBatch, at_limit).request == 2


def test_reason_lists_first_three_errors():
    err = _invalid(EntityBatch, {})
    assert err.reason.count(": field required") == 3
    assert err.reason.endswith("(+3 more)")


def test_accepts_bytearray_memoryview_and_str():
    raw = ENTITY_BATCH.encode()
    for value in (bytearray(raw), memoryview(raw), ENTITY_BATCH):
        assert parse_message(EntityBatch, value).patches[0]["ops"][2]["path"] == "phone/home"


def test_invalid_message_pickles():
    err = InvalidMessage(DeadLetterCode.INVALID_UUID, "clientid: not a UUID")
    back = pickle.loads(pickle.dumps(err))
    assert (back.code, back.reason) == (err.code, err.reason)


def test_codes_are_the_seed_codes():
    assert [c.value for c in DeadLetterCode][:5] == [
        "GENERR001", "GENERR002", "GENERR007", "GENERR009", "GENERR010"
    ]
    assert f"{DeadLetterCode.BAD_FORMAT}" == "GENERR001"


def test_status_is_a_strict_int():
    doc = json.loads(ENTITY_UPDATE)
    for status in (True, 1.0, "1", 4, 0):
        err = _invalid(EntityUpdate, {**doc, "status": status})
        assert err.code is DeadLetterCode.BAD_FORMAT and err.reason.startswith("status")


# ---------------------------------------------------------------- patch ops


_OP = TypeAdapter(PatchOp)


def test_patch_op_is_its_wire_form():
    assert _OP.validate_python({"op": "add", "path": "a", "value": None}) == {"op": "add", "path": "a", "value": None}
    assert _OP.validate_python({"op": "remove", "path": "a", "value": 1}) == {"op": "remove", "path": "a"}
    moved = _OP.validate_json('{"op": "move", "path": "b", "from": "a", "extra": true}')
    assert moved == {"op": "move", "path": "b", "from": "a"}
    assert _OP.validate_python({"op": "test", "path": "b", "value": [1]}) == {"op": "test", "path": "b", "value": [1]}
    with pytest.raises(ValidationError):
        _OP.validate_python({"op": "copy", "path": "b"})


def test_null_value_survives_batch_output():
    doc = _with_op({"op": "replace", "path": "lastName", "value": None})
    out = json.loads(to_json(parse_message(EntityBatch, json.dumps(doc).encode())))
    assert out["patches"][0]["ops"][1] == {"op": "replace", "path": "lastName", "value": None}


def test_patch_spec_requires_ops():
    with pytest.raises(ValidationError):
        TypeAdapter(PatchSpec).validate_python({"collection": "C", "zone": "z", "entity": "e", "ops": []})


# ---------------------------------------------------------------- project-defined shapes

ACK = {"db": "my-db", "user": "jsmith", "device": "7980f77c-2529-4978-9281-c44297c0f57e",
       "begun": 1415747110000}


def test_notification_ack_needs_ids_or_up_to():
    by_ids = parse_message(NotificationAck, json.dumps({**ACK, "notifications": ["n1", "n2"]}).encode())
    assert by_ids.notifications == ["n1", "n2"] and by_ids.upTo is None
    up_to = parse_message(NotificationAck, json.dumps({**ACK, "upTo": 1415747104012}).encode())
    assert up_to.upTo == 1415747104012
    assert to_message(up_to) == {**{k: v for k, v in ACK.items()}, "dbid": "my-db", "upTo": 1415747104012}
    for bad in (ACK, {**ACK, "notifications": []}, {**ACK, "notifications": None}, {**ACK, "notifications": [""]}):
        err = _invalid(NotificationAck, bad)
        assert err.code is DeadLetterCode.BAD_FORMAT and "notifications" in err.reason
    assert _invalid(NotificationAck, {**ACK, "upTo": "soon"}).reason.startswith("upTo")


def test_zone_subscription_defaults():
    sub = ZoneSubscription.model_validate({"subjectZone": "A", "device": "d1", "user": "jsmith"})
    assert sub.subjectCollection is None
    assert sub.actions == ["created", "updated", "deleted"]
    assert sub.covers("Contacts", "updated") and sub.covers("Groups", "deleted")
    assert ZoneSubscription.model_validate({"subjectZone": "A", "device": "d1", "user": "u", "actions": None}).actions \
        == sub.actions  # null reads as absent, as the optional flags do
    with pytest.raises(ValidationError):
        ZoneSubscription.model_validate({"subjectZone": "A", "device": "d1", "user": "u", "actions": []})
    narrow = ZoneSubscription(subjectZone="A", subjectCollection="Contacts", device="d2", user="u",
                              actions=["created", "deleted"])
    assert not narrow.covers("Contacts", "updated") and not narrow.covers("Groups", "created")
    assert to_message(narrow) == {"subjectZone": "A", "subjectCollection": "Contacts", "device": "d2",
                                  "user": "u", "actions": ["created", "deleted"]}
    for bad in ({"subjectZone": "A", "device": "d", "user": "u", "actions": []},
                {"subjectZone": "A", "device": "d", "user": "u", "actions": ["read"]},
                {"device": "d", "user": "u"}):
        with pytest.raises(ValueError):
            ZoneSubscription.model_validate(bad)


def test_topic_models():
    assert TOPIC_MODELS["entity-batches"] is EntityBatch
    assert TOPIC_MODELS["notification-acks"] is NotificationAck
    assert TOPIC_MODELS["zone-changes"] is EntityUpdate


def _integer_fields(schema: dict, defs: dict, path: str = ""):
    """(path, field schema) of every integer in a JSON schema, nested models included."""
    if "$ref" in schema:
        yield from _integer_fields(defs[schema["$ref"].rsplit("/", 1)[1]], defs, path)
        return
    for option in schema.get("anyOf", []) + schema.get("allOf", []):
        yield from _integer_fields(option, defs, path)
    if schema.get("type") == "integer":
        yield path, schema
    for name, field in schema.get("properties", {}).items():
        yield from _integer_fields(field, defs, f"{path}.{name}")
    if "items" in schema:
        yield from _integer_fields(schema["items"], defs, f"{path}[]")


@pytest.mark.parametrize("model", sorted(set(TOPIC_MODELS.values()) | {SchemaLearningEntityType}, key=str))
def test_every_integer_fits_a_delta_long(model):
    schema = model.model_json_schema()
    fields = list(_integer_fields(schema, schema.get("$defs", {})))
    assert fields
    for path, field in fields:
        assert field.get("maximum", 2**64) <= 2**63 - 1 and field.get("minimum", -(2**64)) >= -(2**63), path


@pytest.mark.parametrize("topic", sorted(t for t in TOPIC_MODELS if t.replace("-", "_") in SCHEMAS))
def test_every_integer_fits_the_column_of_its_table(topic):
    """A value the model accepts but its column cannot hold would fail the whole slice's write."""
    model, table = TOPIC_MODELS[topic], SCHEMAS[topic.replace("-", "_")]
    schema = model.model_json_schema()
    checked = 0
    for path, field in _integer_fields(schema, schema.get("$defs", {})):
        name = path.lstrip(".")
        if name in table.names and pa.types.is_integer(column := table.field(name).type):
            bits = column.bit_width
            assert field.get("maximum", 2**64) <= 2 ** (bits - 1) - 1, (path, column)
            assert field.get("minimum", -(2**64)) >= -(2 ** (bits - 1)), (path, column)
            checked += 1
    assert checked, topic


def test_a_part_past_its_parts_or_beyond_an_int_is_a_dead_letter():
    patch = json.loads(SCHEMA_PATCH)
    err = _invalid(SchemaPatch, {**patch, "parts": 2, "part": 3})
    assert err.code is DeadLetterCode.BAD_FORMAT and err.reason == "part: part 3 of a request of 2 parts"
    assert _invalid(SchemaPatch, {**patch, "parts": 2**31}).reason.startswith("parts: ")
    assert parse_message(SchemaPatch, json.dumps({**patch, "parts": 2**31 - 1})).parts == 2**31 - 1
    for field in ("part", "parts"):  # the seed's parts count from 1
        assert _invalid(SchemaPatch, {**patch, field: 0}).reason.startswith(f"{field}: ")


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_are_malformed_json(value):
    raw = ENTITY_BATCH.replace('"Sally"', value)
    assert raw != ENTITY_BATCH
    assert _invalid(EntityBatch, raw.encode()).code is DeadLetterCode.MALFORMED_JSON


def test_the_words_nan_and_infinity_inside_strings_are_text():
    batch = parse_message(EntityBatch, ENTITY_BATCH.replace('"Sally"', '"NaN Infinity"').encode())
    assert "NaN Infinity" in value_json(batch.patches)


def test_a_number_beyond_a_double_is_no_value_for_the_lake():
    """pydantic-core reads 1e400 as Infinity: valid JSON in, no JSON out."""
    batch = parse_message(EntityBatch, ENTITY_BATCH.replace('"Sally"', "1e400").encode())
    with pytest.raises(InvalidMessage) as caught:
        value_json(batch.patches)
    assert caught.value.code is DeadLetterCode.BAD_FORMAT and "beyond the range of a double" in caught.value.reason
    assert value_json([1e308, -1.5]) == "[1e+308,-1.5]"


def test_an_integer_beyond_a_long_is_a_dead_letter():
    err = _invalid(EntityBatch, _batch(request=2**63))
    assert err.code is DeadLetterCode.BAD_FORMAT and err.reason.startswith("request: ")
    assert parse_message(EntityBatch, json.dumps(_batch(request=2**63 - 1))).request == 2**63 - 1
    ack = {"device": "d1", "user": "u", "db": "my-db", "begun": 1, "upTo": -(2**63) - 1}
    assert _invalid(NotificationAck, ack).reason.startswith("upTo: ")


def test_json_nested_past_the_parser_s_limit_is_a_bad_format_not_malformed_json():
    """Well-formed JSON past a document's depth: GENERR001, as a patch of 150 levels fails for its depth."""
    from entity_assets import adapters

    value = "[" * 199 + "]" * 199
    raw = (f'{{"dbid": "d", "clientid": "{uuid.uuid4()}", "request": 1, "user": "u", "begun": 1, "patches": '
           f'[{{"collection": "C", "zone": "z", "entity": "e", "ops": [{{"op": "add", "path": "a", "value": {value}}}]}}]}}')
    with pytest.raises(InvalidMessage) as caught:
        parse_message(TOPIC_MODELS["entity-batches"], raw.encode())
    assert caught.value.code is DeadLetterCode.BAD_FORMAT and "nested deeper" in caught.value.reason
    with pytest.raises(InvalidMessage) as caught:
        adapters._json(b'{"a": ' + b"[" * 250 + b"]" * 250 + b"}", "value")
    assert caught.value.code is DeadLetterCode.BAD_FORMAT
    with pytest.raises(InvalidMessage) as caught:
        adapters._json(b'{"a": ', "value")
    assert caught.value.code is DeadLetterCode.MALFORMED_JSON


@pytest.mark.parametrize("model, value", [
    (EntityBatch, {"clientid": str(uuid.uuid4()), "request": 1, "user": "u", "dbid": "d", "begun": 1, "parts": 1,
                   "patches": [{}] * 200_000}),
    (EntityBatch, {"clientid": str(uuid.uuid4()), "request": 1, "user": "u", "dbid": "d", "begun": 1, "parts": 1,
                   "patches": [{"collection": "C", "zone": "z", "entity": "e", "ops": [{}] * 200_000}]}),
    (NotificationAck, {"dbid": "d", "user": "u", "device": "x", "begun": 1, "notifications": [1] * 200_000}),
])
def test_a_list_of_bad_items_stops_at_its_first(model, value):
    """Every bad item was an error object: a 1 MB message of empty patches took 8 s and 1.3 GB of
    memory in its task before it became a dead letter with three reasons."""
    with pytest.raises(InvalidMessage) as caught:
        parse_message(model, json.dumps(value).encode())
    assert caught.value.code is DeadLetterCode.BAD_FORMAT and "more)" not in caught.value.reason.replace("+1 more)", "")


@pytest.mark.parametrize("model, raw, name", [
    (EntityBatch, ENTITY_BATCH.replace('"op": "add"', '"op": "add", "op": "remove"', 1), "op"),
    (EntityBatch, ENTITY_BATCH.replace('"user": "jsmith"', '"user": "jsmith", "user": "admin"'), "user"),
    (SchemaPatch, SCHEMA_PATCH.replace('"optional" : false', '"optional" : false, "optional": true'), "optional"),
])
def test_a_name_repeated_in_one_object_is_a_dead_letter(model, raw, name):
    """A validator keeps the last value: the add below would have been a remove."""
    assert raw.count(f'"{name}"') > 1
    err = _invalid(model, raw.encode())
    assert err.code is DeadLetterCode.BAD_FORMAT and f'Detected duplicate key "{name}"' in err.reason, err.reason
    assert parse_message(model, raw.replace(f', "{name}": "remove"', "").replace(', "user": "admin"', "")
                         .replace(', "optional": true', "").encode())
