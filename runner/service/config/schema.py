"""The JSON Schema of the service's configuration, for editors (docs/service-config.schema.json,
`microvm-check config schema`), generated from the same dataclasses the loader walks (settings.py), so
the two cannot disagree on a setting's kind, range or help text.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import Field, fields
from pathlib import PurePath
from typing import TYPE_CHECKING

from policy.model import PROTOCOLS
from runner.jobapi.contract import REPOSITORY  # the job API's contract: the one repository pattern
from runner.service.config.settings import (
    MAX_ALLOW_RULES,
    MAX_LIST,
    MAX_STRING,
    SIZE_NAME_PATTERN,
    SIZE_PATTERN,
    ServiceConfig,
    SettingMeta,
    SizeClass,
    setting_meta,
)

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

LISTEN_PATTERN = r"^.+:[0-9]{1,5}$"
# JSON Schema's regexes (ECMA-262) have no \Z; there `$` ends the text, as \Z does in Python.
REPOSITORY_SCHEMA_PATTERN = "^" + REPOSITORY.pattern.replace(r"\Z", "$") + "$"
JSONSchema = dict[str, object]  # a JSON Schema (sub)document, as json.dumps writes it


def json_schema() -> JSONSchema:
    """The config's JSON Schema, from the same dataclasses the loader walks (docs/service-config.schema.json).
    Null is allowed wherever the loader reads it as "the default". What spans settings (token with
    listen, default vs max timeout, allow without networking) only the loader checks (checks.py)."""
    schema = _section_schema(ServiceConfig)
    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "title": "microvm-check service config (microvm-check serve --config FILE)", **schema}


def schema_text() -> str:
    """The schema as the published file holds it (docs/service-config.schema.json), byte for byte."""
    return json.dumps(json_schema(), indent=2) + "\n"


def _section_schema(cls: type[DataclassInstance]) -> JSONSchema:
    doc = (cls.__doc__ or "").split("\n\n")[0].replace("\n", " ").strip()
    properties = {f.name: _nullable(_field_schema(f)) for f in fields(cls)}
    schema: JSONSchema = {"type": ["object", "null"], "additionalProperties": False, "properties": properties}
    if doc and not doc.startswith(cls.__name__ + "("):
        schema["description"] = doc
    return schema


def _field_schema(f: Field[object]) -> JSONSchema:
    meta = setting_meta(f)
    if meta["section"] is not None:  # kind "section"
        return {**_section_schema(meta["section"]), "description": meta["help"]}
    schema = {**_KIND_SCHEMAS[meta["kind"]](meta), "description": meta["help"]}
    default = _json_default(f.default)
    if default is not None:
        schema["default"] = default
    return schema


def _bounds(meta: SettingMeta) -> JSONSchema:
    return {key: meta[key] for key in ("minimum", "maximum") if meta[key] is not None}


def _string_schema(meta: SettingMeta) -> JSONSchema:
    schema: JSONSchema = {"type": "string", "minLength": 1, "maxLength": MAX_STRING}
    if meta["pattern"]:
        schema["pattern"] = meta["pattern"]
    return schema


_KIND_SCHEMAS: dict[str, Callable[[SettingMeta], JSONSchema]] = {  # JSON Schema of each kind
    "int": lambda meta: {"type": "integer", **_bounds(meta)},
    "number": lambda meta: {"type": "number", **_bounds(meta)},
    "size": lambda meta: {"oneOf": [{"type": "integer", **_bounds(meta)}, {"type": "string", "pattern": SIZE_PATTERN}]},
    "bool": lambda meta: {"type": "boolean"},
    "string": _string_schema,
    "path": _string_schema,
    "repository": lambda meta: {"type": "string", "pattern": REPOSITORY_SCHEMA_PATTERN},
    "strings": lambda meta: {"type": "array", "minItems": 1, "maxItems": MAX_LIST,
                             "items": {"type": "string", "minLength": 1, "maxLength": MAX_STRING}},
    "listen": lambda meta: {"type": "string", "pattern": LISTEN_PATTERN},
    "sizes": lambda meta: {"type": "object", "minProperties": 1, "maxProperties": MAX_LIST,
                           "propertyNames": {"pattern": SIZE_NAME_PATTERN},
                           "additionalProperties": _section_schema(SizeClass)},
    "allow": lambda meta: {"type": "array", "maxItems": MAX_ALLOW_RULES, "items": {
        "type": "object", "additionalProperties": False, "required": ["cidr", "ports"], "properties": {
            "cidr": {"type": "string", "description": "a network like 169.254.169.254/32"},
            "ports": {"type": "array", "minItems": 1, "maxItems": 128,
                      "items": {"type": "integer", "minimum": 1, "maximum": 65535}},
            "protocol": {"enum": sorted(PROTOCOLS), "default": "tcp"}}}},
}


def _nullable(schema: JSONSchema) -> JSONSchema:
    if isinstance(schema.get("type"), str):
        return {**schema, "type": [schema["type"], "null"]}
    if "type" in schema:
        return schema
    return {"anyOf": [{"type": "null"}, {k: v for k, v in schema.items() if k not in ("description", "default")}],
            **{k: v for k, v in schema.items() if k in ("description", "default")}}


def _json_default(value: object) -> object:
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, (bool, int, float, str)):
        return value
    return None
