"""Required and forbidden effects: JSON checks over the final database, and the grader.

Required effect kinds (each a dict with a `description`):
- `field_equals`   {collection, id, field, value}: the record exists and `record[field] == value`.
- `field_contains` {collection, id, field, value}: a list field holds `value`, or a text field contains it
  (case-insensitive).
- `absent`         {collection, id}: the record is gone.
- `created`        {collection, where: {field: value}, contains: {field: [text, ...]}, superset: {field: [...]}}:
  a record that was not in the initial state has those exact values, those texts in those fields
  (case-insensitive) and at least those list items.
Forbidden effect kind:
- `unchanged`      {collection, id}: violated when the record differs from the initial state (or is gone).

`grade_state(task, initial, final)`: `effects_fraction` = satisfied required effects / required effects (from the
state only, never the answer text); `all_effects_pass` = every required effect holds and no forbidden one fired;
`details` lists each check with `ok`.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence


def check_effect(effect: Mapping, initial: Mapping, final: Mapping) -> bool:
    """Whether one required effect holds in `final` (`initial` is the world before the episode)."""
    kind, records = effect["kind"], final[effect["collection"]]
    if kind == "absent":
        return effect["id"] not in records
    if kind in ("field_equals", "field_contains"):
        record = records.get(effect["id"])
        if record is None:
            return False
        value = record.get(effect["field"])
        if kind == "field_equals":
            return value == effect["value"]
        return _contains(value, effect["value"])
    if kind == "created":
        new = [r for rid, r in records.items() if rid not in initial[effect["collection"]]]
        return any(_created_matches(r, effect) for r in new)
    raise ValueError(f"unknown effect kind {kind!r}; expected absent, field_equals, field_contains or created")


def forbidden_fired(effect: Mapping, initial: Mapping, final: Mapping) -> bool:
    """Whether a forbidden effect happened (collateral damage)."""
    if effect["kind"] != "unchanged":
        raise ValueError(f"unknown forbidden effect kind {effect['kind']!r}; expected unchanged")
    return final[effect["collection"]].get(effect["id"]) != initial[effect["collection"]].get(effect["id"])


def grade_state(required: Sequence[Mapping], forbidden: Sequence[Mapping], initial: Mapping,
                final: Mapping, extra: Sequence[Mapping] = ()) -> dict:
    """`effects_fraction`, `all_effects_pass`, `forbidden_violations` and per-check `details`.

    `extra`: already-scored checks (e.g. rubric items from a judge: {description, ok}) that count as required
    effects.
    """
    details = [{"type": "required", "description": e["description"], "ok": check_effect(e, initial, final)}
               for e in required]
    details += [{"type": "rubric", "description": e["description"], "ok": bool(e["ok"])} for e in extra]
    fired = [{"type": "forbidden", "description": e["description"], "ok": not forbidden_fired(e, initial, final)}
             for e in forbidden]
    passed = sum(d["ok"] for d in details)
    fraction = passed / len(details) if details else 0.0
    return {"effects_fraction": fraction,
            "all_effects_pass": bool(details) and passed == len(details) and all(f["ok"] for f in fired),
            "forbidden_violations": sum(not f["ok"] for f in fired), "details": details + fired}


def _contains(value, needle) -> bool:
    if isinstance(value, list):
        return any(_contains(v, needle) for v in value) if isinstance(needle, str) else needle in value
    return isinstance(value, str) and str(needle).lower() in value.lower()


def _created_matches(record: Mapping, effect: Mapping) -> bool:
    if any(record.get(k) != v for k, v in effect.get("where", {}).items()):
        return False
    for field, texts in effect.get("contains", {}).items():
        if not all(_contains(record.get(field), t) for t in texts):
            return False
    for field, items in effect.get("superset", {}).items():
        have = {str(x).lower() for x in record.get(field) or ()}
        if not all(str(i).lower() in have for i in items):
            return False
    return True
