"""JSON Schema to the nodes that `engine.json_schema_constraint` decodes under (OpenAI's
`response_format: {"type": "json_schema"}`, vLLM's `guided_json`).

Every answer the constraint admits validates against the schema; it admits a subset of what the
schema allows, written the way OpenAI's structured outputs write it:
- an object's properties come in the order the schema lists them; each required one is written,
  each optional one may be skipped; no other key is written when `properties` is given (extra
  keys are never needed to validate). Without `properties`, keys are free and their values follow
  `additionalProperties` (any JSON value when it is absent or true; `false` admits only `{}`).
- enum and const values are written as `json.dumps` writes them (objects and arrays compact).
- `oneOf` is decoded as `anyOf`: a value that matched two of its alternatives would not validate,
  which alternatives that differ by a `const` or `enum` (tagged unions, as pydantic writes them)
  never do.
- a number with bounds (minimum, maximum, exclusiveMinimum, exclusiveMaximum, a whole multipleOf) is
  written without an exponent (with a multipleOf, as an integer), and only as far as it can still end
  within them (engine.number_bounds).
- a string with a `pattern` (engine.regex_nfa) or a `format` (FORMATS: the formats as patterns that
  admit only valid values, e.g. no date past the 28th of February; UNCHECKED_FORMATS, hints, admit
  any) is written only as far as its decoded text can still match, within its length bounds.
- an array with uniqueItems whose items are scalars never repeats a value (engine.unique_items).
- an object with minProperties or maxProperties counts its keys: listed properties are skipped only
  while enough are left, and free keys (no `properties`) are kept, so that none is written twice.
- free keys follow `propertyNames` (pydantic writes it for dict[Literal[...], X], dict[SomeEnum, X] and
  keys with length bounds) and one `patternProperties` pattern (dict[constr(pattern=...), X]): each key
  is written to match the pattern, its value under the pattern's schema (so additionalProperties never
  applies), and none twice. Listed properties are checked against both: a required one propertyNames
  does not admit is refused, an optional one is never written, and one that matches the pattern too
  (its value would be under two schemas) is refused.
Keywords that would need more than this (several patternProperties, other formats, ...) are refused
with a ValueError naming the keyword and where it is, never ignored: an answer that ignored them could fail
the user's validation.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from engine.number_bounds import BOUND_WORDS, NumberRange, exact
from engine.regex_nfa import Nfa, compile_pattern
from engine.unique_items import check_distinct_keys, check_unique_items, item_leaves

ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
               "readOnly", "writeOnly", "discriminator"}
HANDLED = {"type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems", "uniqueItems",
           "minProperties", "maxProperties", "propertyNames", "patternProperties",
           "minLength", "maxLength", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions",
           "pattern", "format", *BOUND_WORDS}
TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
_PYTHON_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


@dataclass(frozen=True)
class Node:
    """One schema, compiled. `kind` is object, array, string, number, integer, literal or any_of."""

    kind: str
    keys: tuple[str, ...] = ()  # object: each property's key as written, quotes included ('"name"')
    values: tuple[int, ...] = ()  # object: each property's value node
    required: tuple[bool, ...] = ()
    extra: int | None = None  # object without properties: the node of any key's value (None: no key)
    items: int | None = None  # array: the items' node (None: no item)
    min_items: int = 0
    max_items: int | None = None
    unique: bool = False  # array: uniqueItems (engine.unique_items)
    min_length: int = 0  # string: in characters, an escape counting as one
    max_length: int | None = None
    texts: tuple[str, ...] = ()  # literal: the JSON texts it may be
    bounds: NumberRange | None = None  # number, integer: the values it may take (None: any)
    pattern: Nfa | None = field(default=None, compare=False)  # string: what its text must match (None: any)
    options: tuple[int, ...] = ()  # any_of: the alternatives' nodes
    min_properties: int = 0  # object: how many keys it has at least, and at most (None: no most)
    max_properties: int | None = None
    key_node: int | None = None  # object without properties, counted or with named keys: its keys' node (their texts are kept)

    @property
    def counted(self) -> bool:
        """An object whose keys are counted (minProperties or maxProperties) or kept (free keys under a rule)."""
        return self.kind == "object" and (self.min_properties > 0 or self.max_properties is not None
                                          or self.key_node is not None)

    def key_choices(self, first: int) -> range:
        """The properties that may come next once those before `first` are settled: the optional ones
        up to and including the first required one."""
        last = first
        while last < len(self.keys) and not self.required[last]:
            last += 1
        return range(first, min(last + 1, len(self.keys)))

    def may_close(self, first: int) -> bool:
        """An object may close once no property from `first` on is required."""
        return not any(self.required[first:])


@dataclass
class Program:
    """The compiled schema: `nodes[root]` is the answer's node. `depth[i]`: the fewest open containers
    a value of node i needs to be written whole (inf: no finite value; a decoder never starts one)."""

    nodes: list[Node] = field(default_factory=list)
    root: int = 0
    depth: list[float] = field(default_factory=list)

    def measure(self) -> None:
        """Fill `depth`, from the leaves up until nothing changes (recursion settles at its finite cases)."""
        depth = [math.inf] * len(self.nodes)
        changed = True
        while changed:
            changed = False
            for i, node in enumerate(self.nodes):
                if node.kind == "any_of":
                    value = min((depth[o] for o in node.options), default=math.inf)
                elif node.kind == "object" and node.extra is not None and not node.keys:
                    value = 1 + (depth[node.extra] if node.min_properties else 0)
                elif node.kind == "object":  # its required values, and the shallowest optional ones minProperties needs
                    optional = sorted(depth[v] for v, needed in zip(node.values, node.required) if not needed)
                    more = max(0, node.min_properties - sum(node.required))
                    value = 1 + max([depth[v] for v, needed in zip(node.values, node.required) if needed]
                                    + optional[:more], default=0)
                elif node.kind == "array":
                    value = 1 + (depth[node.items] if node.min_items else 0)
                else:
                    value = 0
                if value < depth[i]:
                    depth[i], changed = value, True
        self.depth = depth


class _Compiler:
    def __init__(self, schema: dict):
        self.document = schema
        self.program = Program()
        self.refs: dict[str, int] = {}
        self.any_node: int | None = None
        self.unique_arrays: list[tuple[int, str]] = []  # checked once every node is compiled
        self.keyed_objects: list[tuple[int, str]] = []  # so are objects whose free keys follow a rule

    def compile(self, schema, where: str) -> int:
        if schema is True or schema == {}:
            return self.any()
        if schema is False:
            raise ValueError(f"{where}: false admits no value")
        if not isinstance(schema, dict):
            raise ValueError(f"{where}: a schema is an object or a boolean, not {type(schema).__name__}")
        unknown = sorted(set(schema) - HANDLED - ANNOTATIONS)
        if unknown:
            raise ValueError(f"{where}: {unknown[0]!r} is not supported (supported: {', '.join(sorted(HANDLED))})")
        _check_shapes(schema, where)
        if "$ref" in schema:
            if set(schema) - ANNOTATIONS - {"$ref", "$defs", "definitions"}:
                raise ValueError(f"{where}: $ref beside other keywords is not supported")
            return self.ref(schema["$ref"], where)
        if "allOf" in schema:
            parts = schema["allOf"]
            rest = {k: v for k, v in schema.items() if k not in ANNOTATIONS | {"allOf", "$defs", "definitions"}}
            if not isinstance(parts, list) or len(parts) != 1 or rest:
                raise ValueError(f"{where}.allOf: only an allOf of one schema, alone, is supported")
            return self.compile(parts[0], f"{where}.allOf[0]")
        for word in ("anyOf", "oneOf"):
            if word in schema:
                return self.alternatives(schema, word, where)
        if "const" in schema or "enum" in schema:
            return self.literal(schema, where)
        types = schema.get("type")
        if types is None:
            if any(k in schema for k in ("properties", "required", "additionalProperties", "minProperties",
                                         "maxProperties", "propertyNames", "patternProperties")):
                types = "object"
            elif any(k in schema for k in ("items", "minItems", "maxItems")):
                types = "array"
            elif any(k in schema for k in ("minLength", "maxLength", "pattern", "format")):
                types = "string"
            elif any(k in schema for k in BOUND_WORDS):
                types = "number"
            else:
                return self.any()
        if isinstance(types, list):
            if not types:
                raise ValueError(f"{where}.type: an empty list admits no value")
            _check_types(types, where)  # before dict.fromkeys, which hashes them
            return self.add(Node("any_of", options=tuple(
                self.typed(schema, t, f"{where}.type") for t in dict.fromkeys(types))))
        return self.typed(schema, types, where)

    def add(self, node: Node) -> int:
        self.program.nodes.append(node)
        return len(self.program.nodes) - 1

    def any(self) -> int:
        """Any JSON value: one node, shared, its objects' values and arrays' items itself."""
        if self.any_node is None:
            index = self.any_node = self.add(Node("any_of"))
            options = (self.add(Node("object", extra=index)), self.add(Node("array", items=index)),
                       self.add(Node("string")), self.add(Node("number")), self.add(Node("literal", texts=(
                           "true", "false", "null"))))
            self.program.nodes[index] = Node("any_of", options=options)
        return self.any_node

    def ref(self, ref, where: str) -> int:
        if isinstance(ref, str) and ref in self.refs:
            return self.refs[ref]
        prefix = next((p for p in ("#/$defs/", "#/definitions/") if isinstance(ref, str) and ref.startswith(p)), None)
        if prefix is None:
            raise ValueError(f"{where}.$ref: only references into #/$defs or #/definitions are supported, not {ref!r}")
        definitions = self.document.get(prefix[2:-1], {})
        target = definitions.get(ref[len(prefix):])
        if target is None:
            raise ValueError(f"{where}.$ref: {ref!r} names no definition")
        index = self.refs[ref] = self.add(Node("any_of"))  # reserved first: a definition may refer to itself
        compiled = self.compile(target, ref)
        self.program.nodes[index] = Node("any_of", options=(compiled,))
        return index

    def alternatives(self, schema: dict, word: str, where: str) -> int:
        options = schema[word]
        rest = {k: v for k, v in schema.items() if k not in ANNOTATIONS | {word, "$defs", "definitions"}}
        if not isinstance(options, list) or not options or rest:
            raise ValueError(f"{where}.{word}: a non-empty list of schemas, alone, is supported")
        return self.add(Node("any_of", options=tuple(
            self.compile(option, f"{where}.{word}[{i}]") for i, option in enumerate(options))))

    def literal(self, schema: dict, where: str) -> int:
        values = [schema["const"]] if "const" in schema else schema["enum"]
        if not isinstance(values, list) or not values:
            raise ValueError(f"{where}.enum: a non-empty list of values")
        types = schema.get("type")
        if types is not None:
            types = types if isinstance(types, list) else [types]
            _check_types(types, where)
            values = [v for v in values if any(_is_type(v, t) for t in types)]
            if not values:
                raise ValueError(f"{where}: no value of its enum or const has its type {types}")
        if any(word in schema for word in BOUND_WORDS):  # bounds apply to the numbers among the values
            bounds = NumberRange.from_schema(schema, False, where)
            values = [v for v in values if not _is_type(v, "number") or bounds.admits(exact(v))]
            if not values:
                raise ValueError(f"{where}: no value of its enum or const lies within its bounds")
        texts = tuple(dict.fromkeys(json.dumps(v, ensure_ascii=False, separators=(",", ":")) for v in values))
        return self.add(Node("literal", texts=texts))

    def typed(self, schema: dict, kind, where: str) -> int:
        if kind not in TYPES:
            raise ValueError(f"{where}.type: {kind!r} is not a JSON Schema type ({', '.join(TYPES)})")
        if kind == "boolean":
            return self.add(Node("literal", texts=("true", "false")))
        if kind == "null":
            return self.add(Node("literal", texts=("null",)))
        if kind in ("number", "integer"):
            return self.add(Node(kind, bounds=NumberRange.from_schema(schema, kind == "integer", where)))
        if kind == "string":
            low, high = _bounds(schema, "minLength", "maxLength", where)
            pattern = _string_pattern(schema, where)
            if pattern is not None and not pattern.can_finish(pattern.initial(), 0, low, high):
                raise ValueError(f"{where}: no string of {low} to {high} characters matches its pattern")
            return self.add(Node("string", min_length=low, max_length=high, pattern=pattern))
        if kind == "array":
            low, high = _bounds(schema, "minItems", "maxItems", where)
            unique = schema.get("uniqueItems", False)
            items = schema.get("items", True)
            if items is False:
                if low:
                    raise ValueError(f"{where}: items false with minItems {low} admits no value")
                return self.add(Node("array", items=None, max_items=0))
            index = self.add(Node("array"))  # reserved before its items, which may refer back
            self.program.nodes[index] = Node("array", items=self.compile(items, f"{where}.items"),
                                             min_items=low, max_items=high, unique=unique)
            if unique:
                self.unique_arrays.append((index, where))
            return index
        return self.object(schema, where)

    def object(self, schema: dict, where: str) -> int:
        properties = schema.get("properties") or {}
        required = schema.get("required") or []
        extra = schema.get("additionalProperties", True)
        names_node = self.property_names(schema, where)
        pattern = self.key_pattern(schema, where)
        names = list(properties)
        for name in required:
            if name not in properties:
                if extra is False:
                    raise ValueError(f"{where}.required: {name!r} is required but additionalProperties is false "
                                     "and it is not among the properties")
                names.append(name)
        if names_node is not None:  # a listed key is a name too: an optional one it does not admit is not written
            for name in [n for n in names if not self.names_admit(names_node, n)]:
                if name in required:
                    raise ValueError(f"{where}.propertyNames: the required property {name!r} is not a name it admits")
                names.remove(name)
        if pattern is not None and names:
            matching = next((n for n in names if pattern[1].matches(n)), None)
            if matching is not None:
                raise ValueError(f"{where}.patternProperties: the property {matching!r} also matches {pattern[0]!r} "
                                 "(a value under both schemas is not supported)")
        low, high = _bounds(schema, "minProperties", "maxProperties", where)
        counts = {"min_properties": low, "max_properties": high}
        index = self.add(Node("object"))
        if not names and (properties or required):  # every listed name is one propertyNames does not admit
            if low:
                raise ValueError(f"{where}: minProperties {low} with no property that propertyNames admits")
            self.program.nodes[index] = Node("object", **counts)
            return index
        if not names:
            if pattern is not None:  # keys match the pattern, so their values are under its schema alone
                if isinstance(extra, dict):
                    self.compile(extra, f"{where}.additionalProperties")
                value = self.compile(pattern[2], f"{where}.patternProperties.{pattern[0]}")
                key = self.patterned_names(names_node, pattern, where)
            else:
                value = None if extra is False else self.compile(extra, f"{where}.additionalProperties")
                key = names_node
            if value is None and low:
                raise ValueError(f"{where}: minProperties {low} with additionalProperties false and no properties")
            if key is None and (low or high is not None):
                key = self.add(Node("string"))
            if key is not None:
                self.keyed_objects.append((index, where))
            self.program.nodes[index] = Node("object", extra=value, key_node=key, **counts)
            return index
        if low > len(names):
            raise ValueError(f"{where}: minProperties {low} is above its {len(names)} properties (where properties "
                             "are given, no other key is written)")
        if high is not None and high < len(set(required)):
            raise ValueError(f"{where}: maxProperties {high} is below its {len(set(required))} required properties")
        if isinstance(extra, dict):  # never written beside properties, but a malformed one is still refused
            self.compile(extra, f"{where}.additionalProperties")
        if pattern is not None:  # never applies to the listed keys (checked above), but is still compiled
            self.compile(pattern[2], f"{where}.patternProperties.{pattern[0]}")
        values = tuple(self.compile(properties[n], f"{where}.properties.{n}") if n in properties
                       else self.compile(extra, f"{where}.additionalProperties") for n in names)
        self.program.nodes[index] = Node(
            "object", keys=tuple(json.dumps(n, ensure_ascii=False) for n in names), values=values,
            required=tuple(n in required for n in names), **counts)
        return index

    def property_names(self, schema: dict, where: str) -> int | None:
        """The node of the names `propertyNames` admits: its alternatives that a name (a string) can be,
        under an any_of (none: no name); None when it admits every name."""
        rule = schema.get("propertyNames", True)
        if rule is True or rule == {}:
            return None
        if rule is False:
            return self.add(Node("any_of"))
        compiled = self.compile(rule, f"{where}.propertyNames")
        options = []
        for leaf in item_leaves(self.program.nodes, compiled):
            node = self.program.nodes[leaf]
            if node.kind == "string":
                options.append(leaf)
            elif node.kind == "literal":
                texts = tuple(t for t in node.texts if t.startswith('"'))
                if texts:
                    options.append(self.add(Node("literal", texts=texts)))
        if not options:
            raise ValueError(f"{where}.propertyNames: admits no string, and property names are strings")
        return self.add(Node("any_of", options=tuple(options)))

    def key_pattern(self, schema: dict, where: str) -> tuple[str, Nfa, object] | None:
        """`patternProperties`' one pattern: (its text, its NFA, its values' schema), or None."""
        patterns = schema.get("patternProperties") or {}
        if len(patterns) > 1:
            raise ValueError(f"{where}.patternProperties: one pattern at most is supported, not {len(patterns)}")
        for text, values in patterns.items():
            return text, compile_pattern(text, f"{where}.patternProperties"), values
        return None

    def names_admit(self, names_node: int, name: str) -> bool:
        """`name` is one of the names node `names_node` (see property_names) admits."""
        text = json.dumps(name, ensure_ascii=False, separators=(",", ":"))
        for leaf in item_leaves(self.program.nodes, names_node):
            node = self.program.nodes[leaf]
            if node.kind == "literal" and text in node.texts:
                return True
            if (node.kind == "string" and node.min_length <= len(name)
                    and (node.max_length is None or len(name) <= node.max_length)
                    and (node.pattern is None or node.pattern.matches(name))):
                return True
        return False

    def patterned_names(self, names_node: int | None, pattern: tuple[str, Nfa, object], where: str) -> int:
        """The node of the names that match the pattern and that `propertyNames` admits as well."""
        text, nfa, _ = pattern
        if names_node is None:
            if not nfa.can_finish(nfa.initial(), 0, 0, None):
                raise ValueError(f"{where}.patternProperties: no name matches {text!r}")
            return self.add(Node("string", pattern=nfa))
        options = []
        for leaf in item_leaves(self.program.nodes, names_node):
            node = self.program.nodes[leaf]
            if node.kind == "literal":
                texts = tuple(t for t in node.texts if nfa.matches(json.loads(t)))
                if texts:
                    options.append(self.add(Node("literal", texts=texts)))
            elif node.pattern is not None:
                raise ValueError(f"{where}: a propertyNames pattern or format beside patternProperties is not supported")
            elif nfa.can_finish(nfa.initial(), 0, node.min_length, node.max_length):
                options.append(self.add(Node("string", min_length=node.min_length, max_length=node.max_length,
                                             pattern=nfa)))
        if not options:
            raise ValueError(f"{where}: no name that propertyNames admits matches patternProperties' {text!r}")
        return self.add(Node("any_of", options=tuple(options)))


_DAY = "(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|02-(?:0[1-9]|1[0-9]|2[0-8]))"
_TIME = "(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\\.[0-9]{1,9})?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_OCTET = "(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_HEX = "[0-9a-f]"
_IPV4 = f"{_OCTET}(?:\\.{_OCTET}){{3}}"
_GROUP = "[0-9a-fA-F]{1,4}"
_IPV6 = "(?:" + "|".join([  # RFC 4291's text forms, "::" standing for one run of zero groups at most
    f"(?:{_GROUP}:){{7}}{_GROUP}", f"(?:{_GROUP}:){{1,7}}:", f"(?:{_GROUP}:){{1,6}}:{_GROUP}",
    *(f"(?:{_GROUP}:){{1,{6 - right}}}(?::{_GROUP}){{1,{right + 1}}}" for right in range(1, 6)),
    f":(?::{_GROUP}){{1,7}}", "::"]) + ")"
_COUNT = "[0-9]{1,6}"  # a duration's figures: the largest sum stays within what a timedelta holds
_DURATION_TIME = f"T(?:{_COUNT}H(?:{_COUNT}M(?:{_COUNT}S)?)?|{_COUNT}M(?:{_COUNT}S)?|{_COUNT}S)"
_DURATION = (f"P(?:(?:{_COUNT}D|{_COUNT}M(?:{_COUNT}D)?|{_COUNT}Y(?:{_COUNT}M(?:{_COUNT}D)?)?)(?:{_DURATION_TIME})?"
             f"|{_DURATION_TIME}|{_COUNT}W)")  # RFC 3339's appendix A, as JSON Schema reads `duration`
_LABEL = "[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_DOMAIN = f"{_LABEL}(?:\\.{_LABEL})*\\.[A-Za-z]{{2,24}}"
FORMATS = {  # each admits valid values only: no year before 1000, no 29th of February (leap or not), ...
    "date": f"^[1-9][0-9]{{3}}-{_DAY}$",
    "time": f"^{_TIME}$",
    "date-time": f"^[1-9][0-9]{{3}}-{_DAY}T{_TIME}$",
    "uuid": f"^{_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}$",
    "email": f"^[A-Za-z0-9_+-]+(?:\\.[A-Za-z0-9_+-]+)*@{_DOMAIN}$",
    "hostname": f"^{_DOMAIN}$",
    "uri": f"^https?://{_DOMAIN}(?:/[A-Za-z0-9._~-]+)*/?$",
    "ipv4": f"^{_IPV4}$",
    "ipv6": f"^{_IPV6}$",
    "ipvanyaddress": f"^(?:{_IPV4}|{_IPV6})$",  # pydantic's IPvAnyAddress
    "duration": f"^{_DURATION}$",  # pydantic's timedelta
}
UNCHECKED_FORMATS = {"password", "binary", "path"}  # hints that pydantic writes (SecretStr, bytes, Path): any string is valid


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


_COUNT_WORDS = ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties")
_SHAPES = {  # keyword -> (what its value must be, the test); a keyword a node of another type never reads is held
    # to it too: read as absent, a malformed value would loosen the schema its author sent
    **{w: ("a count", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0) for w in _COUNT_WORDS},
    **{w: ("a number", _is_number) for w in ("minimum", "maximum", "multipleOf")},
    **{w: ("a number", lambda v: _is_number(v) or isinstance(v, bool)) for w in ("exclusiveMinimum", "exclusiveMaximum")},
    "type": ("a type name or a list of them", lambda v: isinstance(v, (str, list))),
    "properties": ("an object of schemas", lambda v: isinstance(v, dict)),
    "patternProperties": ("an object of schemas", lambda v: isinstance(v, dict)),
    "required": ("a list of property names", lambda v: isinstance(v, list) and all(isinstance(n, str) for n in v)),
    **{w: ("a schema (an object or a boolean)", lambda v: isinstance(v, (dict, bool)))
       for w in ("additionalProperties", "items", "propertyNames")},
    **{w: ("a string", lambda v: isinstance(v, str)) for w in ("pattern", "format", "$ref")},
    "uniqueItems": ("true or false", lambda v: isinstance(v, bool)),
    **{w: ("an object of named schemas", lambda v: isinstance(v, dict) and all(isinstance(d, (dict, bool))
                                                                                for d in v.values()))
       for w in ("$defs", "definitions")},
}


def _check_shapes(schema: dict, where: str) -> None:
    """ValueError naming the first keyword whose value is not of the kind JSON Schema gives it."""
    for word, (kind, fits) in _SHAPES.items():
        if word in schema and not fits(schema[word]):
            raise ValueError(f"{where}.{word}: {kind}, not {schema[word]!r}")


def _check_types(types: list, where: str) -> None:
    """ValueError naming the first entry of a type list that is no JSON Schema type (a list or an object
    there would otherwise raise TypeError where it is hashed)."""
    for t in types:
        if t not in TYPES:
            raise ValueError(f"{where}.type: {t!r} is not a JSON Schema type ({', '.join(TYPES)})")


def _string_pattern(schema: dict, where: str) -> Nfa | None:
    """The NFA of a string's `pattern` or `format` (one of them at most, besides a hint), or None."""
    name = schema.get("format")
    if name is not None and not (isinstance(name, str) and (name in FORMATS or name in UNCHECKED_FORMATS)):
        raise ValueError(f"{where}.format: {name!r} is not supported (supported: {', '.join(FORMATS)}, and "
                         f"{', '.join(sorted(UNCHECKED_FORMATS))}, which admit any string)")
    if name in FORMATS:
        if "pattern" in schema:
            raise ValueError(f"{where}: a pattern beside a format is not supported (fold the format into the pattern)")
        return compile_pattern(FORMATS[name], f"{where}.format")
    if "pattern" in schema:
        return compile_pattern(schema["pattern"], f"{where}.pattern")
    return None


def _bounds(schema: dict, low_word: str, high_word: str, where: str) -> tuple[int, int | None]:
    low, high = schema.get(low_word, 0), schema.get(high_word)  # counts, as _check_shapes found them
    if high is not None and high < low:
        raise ValueError(f"{where}: {high_word} {high} is below {low_word} {low}")
    return low, high


def _is_type(value, kind: str) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _PYTHON_TYPES.get(kind, ()))


def compile_schema(schema) -> Program:
    """The schema compiled; ValueError naming the keyword and its place when it cannot be decoded under.
    The answer's root must be an object or an array, whose end the grammar can see (as OpenAI's)."""
    compiler = _Compiler(schema if isinstance(schema, dict) else {})
    program = compiler.program
    program.root = compiler.compile(schema, "schema")
    for index, where in compiler.unique_arrays:
        check_unique_items(program.nodes, index, where)
    for index, where in compiler.keyed_objects:
        check_distinct_keys(program.nodes, index, where)
    program.measure()
    if program.depth[program.root] == math.inf:
        raise ValueError("schema: admits no finite value (a required property or item that contains itself "
                         "without end)")
    roots, seen = [program.root], set()
    while roots:  # the root's alternatives, through any_of and $ref
        node = program.nodes[roots.pop()]
        if node.kind == "any_of":
            roots.extend(o for o in node.options if o not in seen)
            seen.update(node.options)
        elif node.kind not in ("object", "array"):
            raise ValueError(f"schema: the answer must be an object or an array (wrap a {node.kind} in an "
                             "object's property)")
    return program


def schema_key(schema) -> str:
    """The text a schema is kept under: its JSON, keys in their order (the order of properties counts)."""
    return json.dumps(schema, ensure_ascii=False)
