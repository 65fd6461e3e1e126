"""50 varied JSON Schemas for the structured-output tests: nested objects, arrays, enums, required fields,
numbers with bounds, strings with patterns, formats, $ref, anyOf, nullable and constant values.

Every string and array is bounded (maxLength / maxItems / pattern / enum), so a complete answer always fits
in `MAX_TOKENS` tokens, even from a random model that never chooses to stop early.
"""

from __future__ import annotations

MAX_TOKENS = 320

_NAME = {"type": "string", "minLength": 1, "maxLength": 12}
_SHORT = {"type": "string", "maxLength": 8}

SCHEMAS: list[tuple[str, str, dict]] = [
    # (id, what to ask the model for, schema)
    ("person", "a person", {
        "type": "object",
        "properties": {"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
    }),
    ("color", "a favourite color", {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue", "yellow"]}},
        "required": ["color"],
    }),
    ("address", "a postal address", {
        "type": "object",
        "properties": {
            "street": {"type": "string", "maxLength": 20},
            "city": _NAME,
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            "country": {"enum": ["US", "DE", "FR", "CN", "JP"]},
        },
        "required": ["street", "city", "zip", "country"],
    }),
    ("tags", "three tags for a blog post about Python", {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": _SHORT, "minItems": 1, "maxItems": 3}},
        "required": ["tags"],
    }),
    ("temperature", "a temperature reading in Celsius", {
        "type": "object",
        "properties": {"celsius": {"type": "number", "minimum": -90, "maximum": 60}},
        "required": ["celsius"],
    }),
    ("phone", "a phone number", {
        "type": "object",
        "properties": {"phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{3}-[0-9]{4}$"}},
        "required": ["phone"],
    }),
    ("flags", "feature flags of an app", {
        "type": "object",
        "properties": {"dark_mode": {"type": "boolean"}, "beta": {"type": "boolean"}},
        "required": ["dark_mode", "beta"],
    }),
    ("order", "an order with line items", {
        "type": "object",
        "properties": {
            "order_id": {"type": "string", "pattern": "^ORD-[0-9]{4}$"},
            "items": {
                "type": "array",
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["sku", "qty"],
                },
            },
        },
        "required": ["order_id", "items"],
    }),
    ("version", "an API version", {
        "type": "object",
        "properties": {"api": {"const": "v1"}, "build": {"type": "integer", "minimum": 1, "maximum": 999}},
        "required": ["api", "build"],
    }),
    ("id_any", "an identifier that is a number or a short code", {
        "type": "object",
        "properties": {"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9999}, _SHORT]}},
        "required": ["id"],
    }),
    ("ref_point", "a line segment between two points", {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -100, "maximum": 100},
                    "y": {"type": "integer", "minimum": -100, "maximum": 100},
                },
                "required": ["x", "y"],
            }
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
    }),
    ("nullable", "a user whose nickname may be unknown", {
        "type": "object",
        "properties": {"user": _NAME, "nickname": {"type": ["string", "null"], "maxLength": 10}},
        "required": ["user", "nickname"],
    }),
    ("optional", "a book, with or without a subtitle", {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 24},
            "subtitle": {"type": "string", "maxLength": 24},
            "pages": {"type": "integer", "minimum": 1, "maximum": 2000},
        },
        "required": ["title", "pages"],
    }),
    ("scores", "test scores", {
        "type": "object",
        "properties": {
            "scores": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 100},
                "minItems": 2,
                "maxItems": 5,
            }
        },
        "required": ["scores"],
    }),
    ("event", "a calendar event", {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 20},
            "date": {"type": "string", "format": "date"},
        },
        "required": ["title", "date"],
    }),
    ("http_status", "an HTTP status", {
        "type": "object",
        "properties": {"code": {"enum": [200, 201, 204, 400, 404, 500]}, "ok": {"type": "boolean"}},
        "required": ["code", "ok"],
    }),
    ("oneof", "a shape: a circle or a square", {
        "type": "object",
        "properties": {
            "shape": {
                "oneOf": [
                    {
                        "type": "object",
                        "properties": {
                            "kind": {"const": "circle"},
                            "radius": {"type": "integer", "minimum": 1, "maximum": 50},
                        },
                        "required": ["kind", "radius"],
                    },
                    {
                        "type": "object",
                        "properties": {
                            "kind": {"const": "square"},
                            "side": {"type": "integer", "minimum": 1, "maximum": 50},
                        },
                        "required": ["kind", "side"],
                    },
                ]
            }
        },
        "required": ["shape"],
    }),
    ("top_array", "a list of up to four fruits", {
        "type": "array",
        "items": {"enum": ["apple", "banana", "cherry", "mango"]},
        "minItems": 1,
        "maxItems": 4,
    }),
    ("strict_obj", "a key-value setting", {
        "type": "object",
        "properties": {"key": _SHORT, "value": _SHORT},
        "required": ["key", "value"],
        "additionalProperties": False,
    }),
    ("deep", "a company with a department and its manager", {
        "type": "object",
        "properties": {
            "company": {
                "type": "object",
                "properties": {
                    "name": _NAME,
                    "department": {
                        "type": "object",
                        "properties": {
                            "name": _NAME,
                            "manager": {
                                "type": "object",
                                "properties": {
                                    "name": _NAME,
                                    "level": {"type": "integer", "minimum": 1, "maximum": 5},
                                },
                                "required": ["name", "level"],
                            },
                        },
                        "required": ["name", "manager"],
                    },
                },
                "required": ["name", "department"],
            }
        },
        "required": ["company"],
    }),
    ("http_method", "an HTTP request line", {
        "type": "object",
        "properties": {
            "method": {"type": "string", "pattern": "^(GET|POST|PUT|DELETE)$"},
            "path": {"type": "string", "pattern": "^/[a-z]{1,10}$"},
        },
        "required": ["method", "path"],
    }),
    ("email", "a contact email", {
        "type": "object",
        "properties": {"email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org|net)$"}},
        "required": ["email"],
    }),
    ("hex_color", "a color as a hex code", {
        "type": "object",
        "properties": {"hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}},
        "required": ["hex"],
    }),
    ("semver", "a package version", {
        "type": "object",
        "properties": {
            "package": _NAME,
            "version": {"type": "string", "pattern": "^[0-9]{1,2}\\.[0-9]{1,2}\\.[0-9]{1,2}$"},
        },
        "required": ["package", "version"],
    }),
    ("ratio", "a probability", {
        "type": "object",
        "properties": {"p": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["p"],
    }),
    ("exclusive", "a dice roll", {
        "type": "object",
        "properties": {"roll": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 7}},
        "required": ["roll"],
    }),
    ("matrix", "a 2x2 matrix of small integers", {
        "type": "object",
        "properties": {
            "rows": {
                "type": "array",
                "minItems": 2,
                "maxItems": 2,
                "items": {
                    "type": "array",
                    "minItems": 2,
                    "maxItems": 2,
                    "items": {"type": "integer", "minimum": -9, "maximum": 9},
                },
            }
        },
        "required": ["rows"],
    }),
    ("weekday", "a meeting day and hour", {
        "type": "object",
        "properties": {
            "day": {"enum": ["Mon", "Tue", "Wed", "Thu", "Fri"]},
            "hour": {"type": "integer", "minimum": 8, "maximum": 18},
        },
        "required": ["day", "hour"],
    }),
    ("product", "a product", {
        "type": "object",
        "properties": {
            "name": _NAME,
            "price": {"type": "number", "minimum": 0, "maximum": 10000},
            "in_stock": {"type": "boolean"},
            "category": {"enum": ["books", "toys", "food"]},
        },
        "required": ["name", "price", "in_stock", "category"],
    }),
    ("coords", "GPS coordinates of a city", {
        "type": "object",
        "properties": {
            "lat": {"type": "number", "minimum": -90, "maximum": 90},
            "lon": {"type": "number", "minimum": -180, "maximum": 180},
        },
        "required": ["lat", "lon"],
    }),
    ("language", "a programming language", {
        "type": "object",
        "properties": {
            "name": {"enum": ["Python", "Rust", "Go", "C++", "Java"]},
            "typed": {"type": "boolean"},
            "year": {"type": "integer", "minimum": 1950, "maximum": 2025},
        },
        "required": ["name", "typed", "year"],
    }),
    ("todo", "a todo list", {
        "type": "object",
        "properties": {
            "todos": {
                "type": "array",
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {"task": {"type": "string", "maxLength": 16}, "done": {"type": "boolean"}},
                    "required": ["task", "done"],
                },
            }
        },
        "required": ["todos"],
    }),
    ("nullable_num", "a measurement that may be missing", {
        "type": "object",
        "properties": {
            "value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 100}, {"type": "null"}]}
        },
        "required": ["value"],
    }),
    ("ipv4", "a server address", {
        "type": "object",
        "properties": {
            "host": {"type": "string", "pattern": "^10\\.[0-9]{1,2}\\.[0-9]{1,2}\\.[0-9]{1,2}$"},
            "port": {"type": "integer", "minimum": 1, "maximum": 65535},
        },
        "required": ["host", "port"],
    }),
    ("uuid", "a record id", {
        "type": "object",
        "properties": {"id": {"type": "string", "format": "uuid"}},
        "required": ["id"],
    }),
    ("pair", "a key and a count", {
        "type": "array",
        "prefixItems": [_SHORT, {"type": "integer", "minimum": 0, "maximum": 99}],
        "items": False,
        "minItems": 2,
    }),
    ("nested_enum", "a traffic light state", {
        "type": "object",
        "properties": {
            "light": {
                "type": "object",
                "properties": {"state": {"enum": ["red", "amber", "green"]}, "blinking": {"type": "boolean"}},
                "required": ["state", "blinking"],
            }
        },
        "required": ["light"],
    }),
    ("country_code", "a country code and its population in millions", {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{2}$"},
            "population_m": {"type": "number", "minimum": 0, "maximum": 2000},
        },
        "required": ["code", "population_m"],
    }),
    ("recipe", "a recipe", {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "ingredients": {"type": "array", "items": _NAME, "minItems": 1, "maxItems": 4},
            "minutes": {"type": "integer", "minimum": 1, "maximum": 240},
        },
        "required": ["name", "ingredients", "minutes"],
    }),
    ("time", "a time of day", {
        "type": "object",
        "properties": {"time": {"type": "string", "pattern": "^([01][0-9]|2[0-3]):[0-5][0-9]$"}},
        "required": ["time"],
    }),
    ("error", "an error response", {
        "type": "object",
        "properties": {
            "error": {
                "type": "object",
                "properties": {
                    "code": {"type": "integer", "minimum": 400, "maximum": 599},
                    "message": {"type": "string", "maxLength": 30},
                },
                "required": ["code", "message"],
            }
        },
        "required": ["error"],
    }),
    ("rgb", "a color as red, green and blue values", {
        "type": "object",
        "properties": {c: {"type": "integer", "minimum": 0, "maximum": 255} for c in ("r", "g", "b")},
        "required": ["r", "g", "b"],
    }),
    ("words", "two words that rhyme", {
        "type": "object",
        "properties": {
            "words": {
                "type": "array",
                "items": {"type": "string", "pattern": "^[a-z]{2,8}$"},
                "minItems": 2,
                "maxItems": 2,
            }
        },
        "required": ["words"],
    }),
    ("sentiment", "the sentiment of 'I love this!'", {
        "type": "object",
        "properties": {
            "label": {"enum": ["positive", "negative", "neutral"]},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["label", "confidence"],
    }),
    ("ref_list", "a playlist of songs", {
        "$defs": {
            "song": {
                "type": "object",
                "properties": {
                    "title": {"type": "string", "maxLength": 16},
                    "seconds": {"type": "integer", "minimum": 30, "maximum": 600},
                },
                "required": ["title", "seconds"],
            }
        },
        "type": "object",
        "properties": {"songs": {"type": "array", "items": {"$ref": "#/$defs/song"}, "maxItems": 3}},
        "required": ["songs"],
    }),
    ("bool_only", "whether the sky is blue", {"type": "boolean"}),
    ("int_only", "the number of legs of a spider", {"type": "integer", "minimum": 0, "maximum": 100}),
    ("string_only", "a one-word greeting", {"type": "string", "pattern": "^[A-Za-z]{2,10}$"}),
    ("mixed_array", "a tuple of a name, an age and a flag", {
        "type": "array",
        "prefixItems": [_NAME, {"type": "integer", "minimum": 0, "maximum": 120}, {"type": "boolean"}],
        "items": False,
        "minItems": 3,
    }),
    ("stats", "summary statistics of a dataset", {
        "type": "object",
        "properties": {
            "count": {"type": "integer", "minimum": 0, "maximum": 100000},
            "mean": {"type": "number", "minimum": -1000, "maximum": 1000},
            "unit": {"enum": ["cm", "kg", "s"]},
            "outliers": {
                "type": "array",
                "items": {"type": "number", "minimum": -1000, "maximum": 1000},
                "maxItems": 3,
            },
        },
        "required": ["count", "mean", "unit", "outliers"],
    }),
]  # fmt: skip

assert len(SCHEMAS) == 50, len(SCHEMAS)
assert len({name for name, _, _ in SCHEMAS}) == 50
