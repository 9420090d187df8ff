"""What a task template produces (`Draft`), effect constructors, and a read-only view for describing records
indirectly.

A template reads the initial world and returns a `Draft`: the persona, one indirect request, the oracle's tool
calls (lookups whose observations reveal every id the writes use, then the writes), required and forbidden
effects, the records the request is about (`records`: none of their ids or exact names may appear in the
prompt: the hard split), the oracle's final answer and rubric items for the judge.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Draft:
    template: str
    persona_id: str
    user_prompt: str
    steps: list[dict]
    required: list[dict]
    forbidden: list[dict]
    records: list[list[str]]
    answer: str
    rubric: list[dict] = field(default_factory=list)


def step(tool: str, **args) -> dict:
    return {"tool": tool, "args": args}


def equals(collection: str, record_id: str, field_name: str, value, description: str) -> dict:
    return {"kind": "field_equals", "collection": collection, "id": record_id, "field": field_name,
            "value": value, "description": description}


def contains(collection: str, record_id: str, field_name: str, value, description: str) -> dict:
    return {"kind": "field_contains", "collection": collection, "id": record_id, "field": field_name,
            "value": value, "description": description}


def absent(collection: str, record_id: str, description: str) -> dict:
    return {"kind": "absent", "collection": collection, "id": record_id, "description": description}


def created(collection: str, description: str, *, where=None, texts=None, superset=None) -> dict:
    return {"kind": "created", "collection": collection, "where": where or {}, "contains": texts or {},
            "superset": superset or {}, "description": description}


def unchanged(collection: str, record_id: str, description: str) -> dict:
    return {"kind": "unchanged", "collection": collection, "id": record_id, "description": description}


def mentions(value: str, description: str) -> dict:
    """A rubric item the deterministic judge checks: the final reply mentions `value`."""
    return {"kind": "mentions", "value": value, "description": description}


def next_id(db: dict, collection: str, prefix: str) -> str:
    """The id the tools give the next record created in `collection` (when nothing else was created first)."""
    return f"{prefix}-{9000 + len(db[collection]) + 1}"


class View:
    """Lookups over the initial world that templates use to pick records and describe them."""

    def __init__(self, db: dict):
        self.db = db
        self.today = db["meta"]["today"]

    def people(self, **where) -> list[dict]:
        return [p for p in self.db["people"].values() if all(p.get(k) == v for k, v in where.items())]

    def head(self, department: str) -> dict:
        return self.people(title=f"Head of {department}")[0]

    def staff(self, department: str) -> list[dict]:
        return [p for p in self.people(department=department) if not p["title"].startswith("Head of")]

    def departments(self) -> list[str]:
        return [p["department"] for p in self.db["people"].values() if p["title"].startswith("Head of")]

    def channel(self, name: str) -> dict:
        return next(c for c in self.db["channels"].values() if c["name"] == name)

    def of_account(self, collection: str, account_id: str, **where) -> list[dict]:
        return [r for r in self.db[collection].values() if r.get("account_id") == account_id
                and all(r.get(k) == v for k, v in where.items())]

    def person(self, person_id: str) -> dict:
        return self.db["people"][person_id]

    @staticmethod
    def customer(account: dict) -> str:
        """Accounts are described by industry, unique inside a world."""
        return f"our {account['industry']} customer"
