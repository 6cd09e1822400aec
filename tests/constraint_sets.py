"""Constraints shared by the structured-output tests and benchmark: 20 JSON schemas, 10 regexes.

Strings and arrays are bounded, so a sampled answer always fits its token budget.
"""

NAME = {"type": "string", "minLength": 1, "maxLength": 16}

JSON_SCHEMAS: list[dict] = [
    # flat objects
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"city": NAME, "population": {"type": "integer", "minimum": 1000, "maximum": 40000000}},
     "required": ["city", "population"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"temperature": {"type": "number", "minimum": -50, "maximum": 60}},
     "required": ["temperature"]},
    {"type": "object", "properties": {"price": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000}, "currency": {"enum": ["USD", "EUR", "JPY"]}},
     "required": ["price", "currency"]},
    # enums and consts
    {"type": "object", "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"kind": {"const": "point"}, "x": {"type": "integer", "minimum": -100, "maximum": 100},
                                      "y": {"type": "integer", "minimum": -100, "maximum": 100}}, "required": ["kind", "x", "y"]},
    {"type": "object", "properties": {"level": {"enum": [1, 2, 3]}, "label": {"enum": ["low", "mid", "high"]}},
     "required": ["level", "label"]},
    # optional fields
    {"type": "object", "properties": {"title": NAME, "subtitle": NAME}, "required": ["title"]},
    {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9999}, "nickname": NAME,
                                      "verified": {"type": "boolean"}}, "required": ["id"]},
    # arrays
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 4}},
     "required": ["tags"]},
    {"type": "object", "properties": {"scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100},
                                                 "minItems": 2, "maxItems": 5}}, "required": ["scores"]},
    {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3},
    {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1}, "minItems": 1, "maxItems": 4},
    # nested objects
    {"type": "object", "properties": {"person": {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                                                 "required": ["name", "age"]}}, "required": ["person"]},
    {"type": "object", "properties": {"address": {"type": "object", "properties": {"street": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                                                  "required": ["street", "zip"]}, "name": NAME}, "required": ["address", "name"]},
    {"type": "object", "properties": {"order": {"type": "object", "properties": {
        "items": {"type": "array", "items": {"type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                                                                             "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                                             "required": ["sku", "qty"]}, "minItems": 1, "maxItems": 2}},
        "required": ["items"]}}, "required": ["order"]},
    # unions and nulls
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}]}},
     "required": ["value"]},
    {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}, "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["answer", "confidence"]},
    {"type": "object", "properties": {"date": {"type": "string", "pattern": "^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])$"},
                                      "event": NAME}, "required": ["date", "event"]},
]

REGEXES: list[str] = [
    r"[0-9]{4}",
    r"(yes|no)",
    r"[A-Z][a-z]{2,8}",
    r"\d{3}-\d{3}-\d{4}",
    r"[a-z]{1,12}@[a-z]{1,12}\.(com|org|net)",
    r"(0|[1-9][0-9]{0,2})\.[0-9]{2}",
    r"#[0-9a-f]{6}",
    r"(Mon|Tue|Wed|Thu|Fri|Sat|Sun)day",
    r"v[0-9]\.[0-9]{1,2}\.[0-9]{1,2}",
    r"[A-Z]{2}[0-9]{2} [A-Z]{3}",
]
