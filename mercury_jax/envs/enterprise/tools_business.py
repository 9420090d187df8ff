"""CRM (accounts, contacts, deals) and ticketing tool surfaces over one world database.

CRM: search_accounts, get_account, update_account, search_contacts, create_contact, delete_contact, list_deals,
update_deal.  Ticketing: search_tickets, get_ticket, create_ticket, update_ticket, reassign_ticket,
add_ticket_comment, delete_ticket.  Enumerated fields (stage, status, priority) are checked against their values.
"""
from __future__ import annotations

from mercury_jax.envs.enterprise.toolkit import ToolError, dumps, get_record, matches
from mercury_jax.envs.enterprise.world import DEAL_STAGES

TICKET_STATUSES = ("open", "pending", "closed")
PRIORITIES = ("low", "normal", "high", "urgent")


def _one_of(value: str | None, allowed, name: str) -> str | None:
    if value is not None and value not in allowed:
        raise ToolError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
    return value


def crm_tools(db: dict) -> dict:
    async def search_accounts(query: str = "") -> str:
        """Search customer accounts by words in name, industry, city or tier."""
        return dumps([{k: a[k] for k in ("id", "name", "industry", "city", "renewal_date")}
                      for a in db["accounts"].values() if matches(a, query, ("name", "industry", "city", "tier"))])

    async def get_account(account_id: str) -> str:
        """Read one account (owner, tier, renewal date, status)."""
        return dumps(get_record(db, "accounts", account_id, noun="account", prefix="A", finder="search_accounts"))

    async def update_account(account_id: str, tier: str | None = None, renewal_date: str | None = None,
                             status: str | None = None) -> str:
        """Change an account's tier, renewal date or status."""
        account = get_record(db, "accounts", account_id, noun="account", prefix="A", finder="search_accounts")
        new = {k: v for k, v in (("tier", tier), ("renewal_date", renewal_date), ("status", status)) if v}
        if not new:
            raise ToolError("nothing to update: give tier, renewal_date or status")
        account.update(new)
        return dumps(account)

    async def search_contacts(query: str = "", account_id: str = "") -> str:
        """Search customer contacts by words in name, role or email, optionally for one account."""
        return dumps([c for c in db["contacts"].values() if (not account_id or c["account_id"] == account_id)
                      and matches(c, query, ("name", "role", "email"))][:12])

    async def create_contact(account_id: str, name: str, email: str, role: str) -> str:
        """Add a contact to an account."""
        get_record(db, "accounts", account_id, noun="account", prefix="A", finder="search_accounts")
        if "@" not in email:
            raise ToolError(f"email must be an email address, got {email!r}")
        cid = f"CT-{9000 + len(db['contacts']) + 1}"
        db["contacts"][cid] = {"id": cid, "account_id": account_id, "name": name, "role": role,
                               "email": email.strip().lower()}
        return dumps({"created": cid})

    async def delete_contact(contact_id: str) -> str:
        """Delete a contact."""
        get_record(db, "contacts", contact_id, noun="contact", prefix="CT", finder="search_contacts")
        del db["contacts"][contact_id.strip()]
        return dumps({"deleted": contact_id.strip()})

    async def list_deals(account_id: str = "", stage: str = "") -> str:
        """List deals, optionally for one account or stage."""
        return dumps([d for d in db["deals"].values() if (not account_id or d["account_id"] == account_id)
                      and (not stage or d["stage"] == stage)])

    async def update_deal(deal_id: str, stage: str = "", amount: int = 0, close_date: str = "") -> str:
        """Change a deal's stage, amount or close date (empty or 0 leaves a field as it is)."""
        deal = get_record(db, "deals", deal_id, noun="deal", prefix="D", finder="list_deals")
        _one_of(stage or None, DEAL_STAGES, "stage")
        new = {k: v for k, v in (("stage", stage), ("amount", amount), ("close_date", close_date)) if v}
        if not new:
            raise ToolError("nothing to update: give stage, amount or close_date")
        deal.update(new)
        return dumps(deal)

    return {f.__name__: f for f in (search_accounts, get_account, update_account, search_contacts, create_contact,
                                    delete_contact, list_deals, update_deal)}


def ticket_tools(db: dict) -> dict:
    def brief(t: dict) -> dict:
        return {k: t[k] for k in ("id", "title", "account_id", "assignee_id", "status", "priority")}

    def ticket(ticket_id: str) -> dict:
        return get_record(db, "tickets", ticket_id, noun="ticket", prefix="T", finder="search_tickets")

    async def search_tickets(query: str = "", status: str = "", account_id: str = "") -> str:
        """Search support tickets by words in the title, optionally by status or account id."""
        _one_of(status or None, TICKET_STATUSES, "status")
        return dumps([brief(t) for t in db["tickets"].values() if (not status or t["status"] == status)
                      and (not account_id or t["account_id"] == account_id) and matches(t, query, ("title",))])

    async def get_ticket(ticket_id: str) -> str:
        """Read one ticket with its comments."""
        return dumps(ticket(ticket_id))

    async def create_ticket(title: str, description: str, account_id: str, priority: str = "normal") -> str:
        """Open a ticket for an account."""
        get_record(db, "accounts", account_id, noun="account", prefix="A", finder="search_accounts")
        _one_of(priority, PRIORITIES, "priority")
        tid = f"T-{9000 + len(db['tickets']) + 1}"
        db["tickets"][tid] = {"id": tid, "title": title, "description": description, "account_id": account_id,
                              "assignee_id": None, "status": "open", "priority": priority, "comments": [],
                              "created": db["meta"]["today"]}
        return dumps({"created": tid})

    async def update_ticket(ticket_id: str, status: str = "", priority: str = "") -> str:
        """Change a ticket's status (open, pending, closed) or priority (low, normal, high, urgent)."""
        record = ticket(ticket_id)
        _one_of(status or None, TICKET_STATUSES, "status"), _one_of(priority or None, PRIORITIES, "priority")
        if not status and not priority:
            raise ToolError("nothing to update: give status or priority")
        record.update({k: v for k, v in (("status", status), ("priority", priority)) if v})
        return dumps(brief(record))

    async def reassign_ticket(ticket_id: str, assignee_id: str) -> str:
        """Assign a ticket to an employee (by person id)."""
        record = ticket(ticket_id)
        get_record(db, "people", assignee_id, noun="person", prefix="P", finder="search_people")
        record["assignee_id"] = assignee_id.strip()
        return dumps(brief(record))

    async def add_ticket_comment(ticket_id: str, text: str) -> str:
        """Add a comment to a ticket."""
        record = ticket(ticket_id)
        if not text.strip():
            raise ToolError("text must not be empty")
        record["comments"].append(text)
        return dumps({"id": record["id"], "comments": len(record["comments"])})

    async def delete_ticket(ticket_id: str) -> str:
        """Delete a ticket."""
        ticket(ticket_id)
        del db["tickets"][ticket_id.strip()]
        return dumps({"deleted": ticket_id.strip()})

    return {f.__name__: f for f in (search_tickets, get_ticket, create_ticket, update_ticket, reassign_ticket,
                                    add_ticket_comment, delete_ticket)}
