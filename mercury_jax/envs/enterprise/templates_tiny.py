"""Two-tool templates for the tiny preset (CPU demos: a whole oracle trajectory in ~512 tokens).

Same contract as the full templates (hard split, required and forbidden effects), fewer lookups and writes.
"""
from __future__ import annotations

import random

from mercury_jax.envs.enterprise.drafts import Draft, View, absent, equals, mentions, step, unchanged
from mercury_jax.envs.enterprise.templates_customer import PARAPHRASE


def tiny_delete_phishing(v: View, rng: random.Random) -> Draft | None:
    email = next(e for e in v.db["emails"].values() if e["from"].startswith("it-helpdesk@"))
    return Draft(
        "tiny_delete_phishing", v.head("Support")["id"], "Delete the fake password-expiry email.",
        [step("search_emails", query="password"), step("delete_email", email_id=email["id"])],
        [absent("emails", email["id"], f"phishing email {email['id']} is deleted")],
        [unchanged("emails", e["id"], f"email {e['id']} is left alone") for e in v.db["emails"].values()
         if e["id"] != email["id"]][:2],
        [["emails", email["id"]]], f"Deleted {email['id']}.", [mentions(email["id"], "the reply names the email")])


def tiny_close_ticket(v: View, rng: random.Random) -> Draft | None:
    open_tickets = [t for t in v.db["tickets"].values() if t["status"] == "open"]
    titles = [t["title"] for t in open_tickets]
    options = [t for t in open_tickets if titles.count(t["title"]) == 1]
    if not options:
        return None
    ticket = rng.choice(options)
    return Draft(
        "tiny_close_ticket", v.head("Support")["id"], f"Close the open ticket where {PARAPHRASE[ticket['title']]}.",
        [step("search_tickets", status="open"), step("update_ticket", ticket_id=ticket["id"], status="closed")],
        [equals("tickets", ticket["id"], "status", "closed", f"ticket {ticket['id']} is closed")],
        [unchanged("tickets", t["id"], f"ticket {t['id']} is left alone") for t in open_tickets
         if t["id"] != ticket["id"]][:2],
        [["tickets", ticket["id"]]], f"Closed {ticket['id']}.", [mentions(ticket["id"], "the reply names the ticket")])


def tiny_deal_stage(v: View, rng: random.Random) -> Draft | None:
    deals = list(v.db["deals"].values())
    amounts = [d["amount"] for d in deals]
    options = [d for d in deals if amounts.count(d["amount"]) == 1]
    if not options:
        return None
    deal = rng.choice(options)
    stage = rng.choice([s for s in ("proposal", "negotiation", "closed_won") if s != deal["stage"]])
    return Draft(
        "tiny_deal_stage", deal["owner_id"], f"Set the deal worth {deal['amount']} to {stage.replace('_', ' ')}.",
        [step("list_deals"), step("update_deal", deal_id=deal["id"], stage=stage)],
        [equals("deals", deal["id"], "stage", stage, f"deal {deal['id']} is at {stage}")],
        [unchanged("deals", d["id"], f"deal {d['id']} is left alone") for d in deals if d["id"] != deal["id"]][:2],
        [["deals", deal["id"]]], f"Deal {deal['id']} is now {stage}.",
        [mentions(deal["id"], "the reply names the deal")])


TEMPLATES = {f.__name__: f for f in (tiny_delete_phishing, tiny_close_ticket, tiny_deal_stage)}
