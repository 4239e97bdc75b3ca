"""Closed objects: the one rule every JSON schema is compiled under (engine/grammar.py), for tool arguments,
response_format and gRPC's json_schema alike. An object refuses the properties its schema does not declare,
unless the schema itself says otherwise (`additionalProperties` true or a schema, or `unevaluatedProperties`), at
every nesting level. JSON Schema's own default is open, and under an open object a sampled model invents keys
until max_tokens; xgrammar's strict mode (vLLM's default backend) and OpenAI's strict function calling hold
objects closed in the same way. llguidance has no option for it, so the schema is rewritten before it compiles.

An object schema is one that declares properties (`properties` or `patternProperties`, even empty ones);
`{"type": "object"}` alone declares none and stays any object, as json_object is.

An intersection is closed as a whole, never part by part: closing each part of an allOf (or of a $ref with
sibling keywords, or the anyOf/oneOf branches beside an object's own properties) would refuse the properties its
siblings declare. The schema that holds the parts is closed over the union of the names they declare, and the
parts stay as written; a definition that is such a part is closed where it is used alone instead of where it is
defined. An intersection of which any part speaks of additional or unevaluated properties stays as written: its
author chose. `not`, `if`/`then`/`else` and `dependentSchemas` are not entered: closing inside a `not` would
widen what it refuses, and the others are parts whose siblings' names they cannot see."""
from __future__ import annotations

from dataclasses import dataclass, field

MAX_NAMES = 50_000  # property names gathered to close intersections: bounds what one schema can make this do
_SPOKEN = ("additionalProperties", "unevaluatedProperties")
_DECLARED = ("properties", "patternProperties")
_BRANCHES = ("anyOf", "oneOf")
_ONE = ("additionalProperties", "items", "prefixItems", "additionalItems", "contains")  # one schema or a list
_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def close(schema):
    """schema (parsed JSON; changed in place) with every object schema in it closed; returns it. Raises ValueError
    for a schema whose intersections gather more than MAX_NAMES names."""
    if isinstance(schema, dict):
        _Closer(schema).run()
    return schema


def _declares(node: dict) -> bool:
    return any(isinstance(node.get(k), dict) for k in _DECLARED)


def _speaks(node: dict) -> bool:
    return any(k in node for k in _SPOKEN)


def _dicts(value) -> list[dict]:
    if isinstance(value, dict):
        return [value]
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


@dataclass(slots=True)
class _Flat:
    """What a definition amounts to as a part of an intersection: the names it declares, following its own parts."""
    names: dict = field(default_factory=dict)  # properties, in order (a dict as an ordered set)
    patterns: dict = field(default_factory=dict)  # patternProperties
    declares: bool = False
    speaks: bool = False


@dataclass(frozen=True, slots=True)
class _Group:
    """A schema's parts: itself and its allOf members, inline (and, when they declare properties, their anyOf /
    oneOf branches, parts of the object then rather than objects of their own); the $ref targets among them."""
    inline: list
    targets: list
    declares: bool


class _Closer:
    def __init__(self, root: dict):
        self.root = root
        self.parts: set[int] = set()  # ids of the definitions that are parts of an intersection somewhere
        self._groups: dict[int, _Group] = {}
        self._flats: dict[int, _Flat] = {}  # by definition: shared by every use
        self._gathered = 0

    def run(self) -> None:
        nodes = self._nodes()
        for node, _ in nodes:
            g = self._group(node)
            if sum(map(_declares, g.inline)) + sum(self._flat(t).declares for t in g.targets) >= 2:
                self.parts.update(map(id, g.targets))
        # decided on the schema as written, then applied: closing one node must not change what another decides
        plans = [(node, plan) for node, whole in nodes if whole and (plan := self._plan(node)) is not None]
        for node, (own, theirs) in plans:
            self._apply(node, own, theirs)

    def _nodes(self) -> list[tuple[dict, bool]]:
        """Every schema in the document reached through a schema keyword, with whether it stands on its own (False:
        a part of an intersection, closed by the schema that holds it)."""
        out, stack = [], [(self.root, True)]
        while stack:  # no recursion: a 64 KiB schema can nest thousands deep
            node, whole = stack.pop()
            out.append((node, whole))
            stack += [(m, False) for m in _dicts(node.get("allOf"))]
            alone = not self._group(node).declares
            stack += [(m, alone) for k in _BRANCHES for m in _dicts(node.get(k))]
            stack += [(m, True) for k in _ONE for m in _dicts(node.get(k))]
            stack += [(m, True) for k in _MAPS if isinstance(node.get(k), dict) for m in _dicts(list(node[k].values()))]
        return out

    def _target(self, node: dict) -> dict | None:
        """The schema a local $ref points at (None: no $ref, a remote one, or one that names nothing, which the
        grammar library refuses in its own words)."""
        ref = node.get("$ref")
        if not isinstance(ref, str) or not ref.startswith("#"):
            return None
        at = self.root
        for step in ref[1:].split("/")[1:]:
            step = step.replace("~1", "/").replace("~0", "~")
            if isinstance(at, dict) and step in at:
                at = at[step]
            elif isinstance(at, list) and step.isdigit() and int(step) < len(at):
                at = at[int(step)]
            else:
                return None
        return at if isinstance(at, dict) else None

    def _inline(self, node: dict) -> tuple[list[dict], list[dict]]:
        """(node and its allOf members, inline and flattened; the $ref targets of any of them)."""
        inline, targets, stack = [], [], [node]
        while stack:
            n = stack.pop()
            inline.append(n)
            stack += _dicts(n.get("allOf"))
            if (t := self._target(n)) is not None:
                targets.append(t)
        return inline, targets

    def _group(self, node: dict) -> _Group:
        hit = self._groups.get(id(node))
        if hit is None:
            inline, targets = self._inline(node)
            declares = any(map(_declares, inline)) or any(self._flat(t).declares for t in targets)
            if declares:
                for m in [m for p in inline for k in _BRANCHES for m in _dicts(p.get(k))]:
                    more, more_targets = self._inline(m)
                    inline += more
                    targets += more_targets
            hit = self._groups[id(node)] = _Group(inline, targets, declares)
        return hit

    def _flat(self, target: dict) -> _Flat:
        hit = self._flats.get(id(target))
        if hit is not None:
            return hit
        flat = self._flats[id(target)] = _Flat()  # a $ref chain that loops back adds nothing more
        g = self._group(target)
        for p in g.inline:
            flat.declares |= _declares(p)
            flat.speaks |= _speaks(p)
            for key, into in (("properties", flat.names), ("patternProperties", flat.patterns)):
                if isinstance(p.get(key), dict):
                    into.update(dict.fromkeys(p[key]))
        for t in g.targets:
            more = self._flat(t)
            flat.declares |= more.declares
            flat.speaks |= more.speaks
            flat.names.update(more.names)
            flat.patterns.update(more.patterns)
        self._gather(len(flat.names) + len(flat.patterns))
        return flat

    def _gather(self, n: int) -> None:
        self._gathered += n
        if self._gathered > MAX_NAMES:
            raise ValueError(f"closing the schema's objects gathers more than {MAX_NAMES} property names across its "
                             f"allOf/$ref intersections; simplify them or say additionalProperties yourself")

    def _plan(self, node: dict) -> tuple[list[dict], list[_Flat]] | None:
        """(node's own parts that declare properties, the definitions among its parts that do), whose names node
        keeps when it closes; None: node stays as written."""
        if id(node) in self.parts:
            return None  # closed where it is used alone
        g = self._group(node)
        flats = [self._flat(t) for t in g.targets]
        if any(map(_speaks, g.inline)) or any(f.speaks for f in flats):
            return None
        own = [p for p in g.inline if _declares(p)]
        theirs = [(t, f) for t, f in zip(g.targets, flats) if f.declares]
        if not own and (not theirs or (len(theirs) == 1 and id(theirs[0][0]) not in self.parts)):
            return None  # nothing declared, or by one definition alone, closed where it is defined
        return own, [f for _, f in theirs]

    def _apply(self, node: dict, own: list[dict], theirs: list[_Flat]) -> None:
        for key in _DECLARED:
            names = dict.fromkeys(n for p in own if p is not node and isinstance(p.get(key), dict) for n in p[key])
            for f in theirs:
                names.update(f.names if key == "properties" else f.patterns)
            mine = node.get(key) if isinstance(node.get(key), dict) else {}
            new = [n for n in names if n not in mine]
            if new and isinstance(node.setdefault(key, {}), dict):
                self._gather(len(new))
                node[key].update(dict.fromkeys(new, True))  # the parts hold each name to its schema
        if theirs and "$ref" in node and isinstance(node.get("allOf", []), list):
            # the same intersection, in the form llguidance compiles when the target refers back to itself
            node["allOf"] = [{"$ref": node.pop("$ref")}, *node.get("allOf", [])]
        node["additionalProperties"] = False
