"""Customer-facing task templates (ticketing, CRM, calendar, chat, email, drive).

Each template reads the initial world through `View` and returns a `Draft` (or None when the world has no
suitable records). Requests name customers by industry and tickets by a paraphrase of their problem, never by
id or exact name, so the agent must look records up first (the hard split).
"""
from __future__ import annotations

import datetime as dt
import random

from mercury_jax.envs.enterprise.drafts import (
    Draft,
    View,
    absent,
    contains,
    created,
    equals,
    mentions,
    next_id,
    step,
    unchanged,
)
from mercury_jax.envs.enterprise.world import TOPICS

PARAPHRASE = dict(TOPICS)
OPEN_STAGES = ("prospecting", "proposal", "negotiation")


def _customer_start(v: View, account: dict) -> list[dict]:
    return [step("search_accounts", query=account["industry"])]


def _others(records: list[dict], keep_id: str, collection: str, what: str) -> list[dict]:
    return [unchanged(collection, r["id"], f"{what} {r['id']} is left alone") for r in records if r["id"] != keep_id]


def reassign_ticket(v: View, rng: random.Random) -> Draft | None:
    tickets = [t for t in v.db["tickets"].values() if t["status"] == "open"]
    if not tickets:
        return None
    ticket = rng.choice(tickets)
    account = v.db["accounts"][ticket["account_id"]]
    targets = [p for p in v.staff("Support") if p["id"] != ticket["assignee_id"]]
    if not targets:
        return None
    target = rng.choice(targets)
    tid, pid = ticket["id"], target["id"]
    return Draft(
        "reassign_ticket", v.head("Support")["id"],
        f"{v.customer(account).capitalize()} says {PARAPHRASE[ticket['title']]}. Hand that ticket over to the support "
        f"engineer based in {target['location']} and leave a comment on it that names its new owner.",
        _customer_start(v, account) + [
            step("search_tickets", account_id=account["id"]),
            step("search_people", query=target["location"], department="Support"),
            step("reassign_ticket", ticket_id=tid, assignee_id=pid),
            step("add_ticket_comment", ticket_id=tid, text=f"Reassigned to {target['name']}.")],
        [equals("tickets", tid, "assignee_id", pid, f"ticket {tid} is assigned to {pid}"),
         contains("tickets", tid, "comments", target["name"], f"a comment on {tid} names {target['name']}")],
        _others(v.of_account("tickets", account["id"]), tid, "tickets", "ticket"),
        [["tickets", tid], ["accounts", account["id"]], ["people", pid]],
        f"Ticket {tid} ({ticket['title']}) now belongs to {target['name']}; I left a comment saying so.",
        [mentions(tid, "the reply names the ticket")])


def close_ticket_and_reply(v: View, rng: random.Random) -> Draft | None:
    options = []
    for ticket in v.db["tickets"].values():
        contacts = v.of_account("contacts", ticket["account_id"])
        roles = [c["role"] for c in contacts]
        options += [(ticket, c) for c in contacts if ticket["status"] != "closed" and roles.count(c["role"]) == 1]
    if not options:
        return None
    ticket, contact = rng.choice(options)
    account = v.db["accounts"][ticket["account_id"]]
    tid = ticket["id"]
    return Draft(
        "close_ticket_and_reply", rng.choice(v.staff("Support"))["id"],
        f"The {contact['role']} at {v.customer(account)} wrote that the problem where "
        f"{PARAPHRASE[ticket['title']]} is solved. Close that ticket and email them a short confirmation that quotes "
        "the ticket id.",
        _customer_start(v, account) + [
            step("search_contacts", account_id=account["id"]),
            step("search_tickets", account_id=account["id"]),
            step("update_ticket", ticket_id=tid, status="closed"),
            step("send_email", to=[contact["email"]], subject=f"Ticket {tid} closed",
                 body=f"Hi {contact['name'].split()[0]}, ticket {tid} ({ticket['title']}) is now closed. Thanks!")],
        [equals("tickets", tid, "status", "closed", f"ticket {tid} is closed"),
         created("emails", f"an email to {contact['email']} quotes {tid}", where={"folder": "sent"},
                 superset={"to": [contact["email"]]}, texts={"body": [tid]})],
        _others(v.of_account("tickets", account["id"]), tid, "tickets", "ticket"),
        [["tickets", tid], ["accounts", account["id"]], ["contacts", contact["id"]]],
        f"Closed ticket {tid} and emailed {contact['name']} ({contact['email']}) to confirm.",
        [mentions(tid, "the reply names the ticket")])


def _account_event(v: View, rng: random.Random) -> tuple[dict, dict, str]:
    event = rng.choice([e for e in v.db["events"].values() if e["account_id"]])
    account = v.db["accounts"][event["account_id"]]
    return event, account, event["title"][len(account["name"]) + 1:]


def reschedule_meeting(v: View, rng: random.Random) -> Draft | None:
    event, account, kind = _account_event(v, rng)
    day = dt.date.fromisoformat(event["start"][:10]) + dt.timedelta(days=rng.randint(1, 7))
    start, end = f"{day.isoformat()}T{event['start'][11:]}", f"{day.isoformat()}T{event['end'][11:]}"
    outside = [a for a in event["attendees"] if not a.endswith("@" + v.db["meta"]["domain"])]
    if not outside:
        return None
    eid = event["id"]
    return Draft(
        "reschedule_meeting", event["organizer_id"],
        f"The {kind} with {v.customer(account)} has to move to {day.isoformat()}, same time and length. Update the "
        "meeting and email the attendees from the customer's side the new date (as YYYY-MM-DD).",
        _customer_start(v, account) + [
            step("search_events", query=account["name"]),
            step("update_event", event_id=eid, start=start, end=end),
            step("send_email", to=outside, subject="Meeting moved",
                 body=f"Hello, our {kind} is moving to {day.isoformat()}, same time. See you then.")],
        [equals("events", eid, "start", start, f"event {eid} starts at {start}"),
         equals("events", eid, "end", end, f"event {eid} ends at {end}"),
         created("emails", f"the customer attendees are told {day.isoformat()}", where={"folder": "sent"},
                 superset={"to": outside}, texts={"body": [day.isoformat()]})],
        _others(v.of_account("events", account["id"]), eid, "events", "event"),
        [["events", eid], ["accounts", account["id"]]],
        f"Moved {event['title']} ({eid}) to {start} and emailed {', '.join(outside)}.",
        [mentions(day.isoformat(), "the reply gives the new date")])


def cancel_meeting(v: View, rng: random.Random) -> Draft | None:
    event, account, kind = _account_event(v, rng)
    eid, channel = event["id"], v.channel("sales")
    return Draft(
        "cancel_meeting", event["organizer_id"],
        f"The {kind} with {v.customer(account)} is off. Cancel it and tell the #sales channel that it was cancelled.",
        _customer_start(v, account) + [
            step("search_events", query=account["name"]),
            step("cancel_event", event_id=eid),
            step("list_channels"),
            step("post_chat_message", channel_id=channel["id"],
                 text=f"The {event['title']} on {event['start'][:10]} is cancelled.")],
        [absent("events", eid, f"event {eid} is cancelled"),
         created("chat_messages", "#sales hears about the cancellation", where={"channel_id": channel["id"]},
                 texts={"text": ["cancel"]})],
        _others(v.of_account("events", account["id"]), eid, "events", "event"),
        [["events", eid], ["accounts", account["id"]]],
        f"Cancelled {event['title']} ({eid}) and told #sales.", [mentions(eid, "the reply names the event")])


def open_tickets_document(v: View, rng: random.Random) -> Draft | None:
    accounts = [a for a in v.db["accounts"].values() if v.of_account("tickets", a["id"], status="open")]
    if not accounts:
        return None
    account = rng.choice(accounts)
    open_ids = [t["id"] for t in v.of_account("tickets", account["id"], status="open")]
    owner = v.person(account["owner_id"])
    title = f"Open tickets - {account['industry']} customer"
    doc_id = next_id(v.db, "documents", "DOC")
    return Draft(
        "open_tickets_document", v.head("Support")["id"],
        f"Create a document titled '{title}' that lists the id of every open ticket of {v.customer(account)}, and "
        "share it with that customer's account owner.",
        _customer_start(v, account) + [
            step("search_tickets", account_id=account["id"], status="open"),
            step("get_account", account_id=account["id"]),
            step("get_person", person_id=owner["id"]),
            step("create_document", title=title, content="Open tickets: " + ", ".join(open_ids)),
            step("share_document", document_id=doc_id, emails=[owner["email"]])],
        [created("documents", f"a document '{title}' lists {', '.join(open_ids)}", where={"title": title},
                 texts={"content": open_ids}),
         created("documents", f"'{title}' is shared with {owner['email']}", where={"title": title},
                 superset={"shared_with": [owner["email"]]})],
        [unchanged("tickets", t, f"ticket {t} is left alone") for t in open_ids],
        [["accounts", account["id"]], ["people", owner["id"]]] + [["tickets", t] for t in open_ids],
        f"Created {doc_id} listing {', '.join(open_ids)} and shared it with {owner['name']}.",
        [mentions(open_ids[0], "the reply names an open ticket")])


def remove_duplicate_contact(v: View, rng: random.Random) -> Draft | None:
    pairs = []
    for account in v.db["accounts"].values():
        contacts = v.of_account("contacts", account["id"])
        for c in contacts:
            for d in contacts:
                if c["name"] == d["name"] and c["email"].endswith("@" + account["domain"]) and d is not c:
                    pairs.append((account, c, d))
    if not pairs:
        return None
    account, good, dup = rng.choice(pairs)
    return Draft(
        "remove_duplicate_contact", account["owner_id"],
        f"{v.customer(account).capitalize()} has two contact entries for their {good['role']}. Delete the one whose "
        "email is not on the customer's own domain, then email the remaining address to confirm we updated our "
        "records.",
        _customer_start(v, account) + [
            step("search_contacts", account_id=account["id"]),
            step("delete_contact", contact_id=dup["id"]),
            step("send_email", to=[good["email"]], subject="Contact details updated",
                 body=f"Hi {good['name'].split()[0]}, we removed an outdated address and will use this one.")],
        [absent("contacts", dup["id"], f"duplicate contact {dup['id']} is deleted"),
         created("emails", f"{good['email']} gets a confirmation", where={"folder": "sent"},
                 superset={"to": [good["email"]]})],
        [unchanged("contacts", good["id"], f"the correct contact {good['id']} is kept as it was")],
        [["contacts", good["id"]], ["contacts", dup["id"]], ["accounts", account["id"]]],
        f"Deleted {dup['id']} ({dup['email']}) and emailed {good['email']}.",
        [mentions(dup["id"], "the reply names the deleted contact")])


def update_deal(v: View, rng: random.Random) -> Draft | None:
    deals = [d for d in v.db["deals"].values() if d["stage"] in OPEN_STAGES]
    if not deals:
        return None
    deal = rng.choice(deals)
    account = v.db["accounts"][deal["account_id"]]
    stage = rng.choice([s for s in OPEN_STAGES + ("closed_won",) if s != deal["stage"]])
    amount = rng.randrange(20, 500) * 500
    channel, did = v.channel("sales"), deal["id"]
    return Draft(
        "update_deal", account["owner_id"],
        f"The open deal with {v.customer(account)} has reached the {stage.replace('_', ' ')} stage and is now worth "
        f"{amount} dollars. Update it, then post the news with the deal id in the #sales channel.",
        _customer_start(v, account) + [
            step("list_deals", account_id=account["id"]),
            step("update_deal", deal_id=did, stage=stage, amount=amount),
            step("list_channels"),
            step("post_chat_message", channel_id=channel["id"], text=f"Deal {did} is now {stage} at {amount}.")],
        [equals("deals", did, "stage", stage, f"deal {did} is at stage {stage}"),
         equals("deals", did, "amount", amount, f"deal {did} is worth {amount}"),
         created("chat_messages", f"#sales hears about {did}", where={"channel_id": channel["id"]},
                 texts={"text": [did]})],
        _others(v.of_account("deals", account["id"]), did, "deals", "deal"),
        [["deals", did], ["accounts", account["id"]]],
        f"Deal {did} is now {stage} at {amount}; posted in #sales.", [mentions(did, "the reply names the deal")])


def escalate_open_tickets(v: View, rng: random.Random) -> Draft | None:
    accounts = [a for a in v.db["accounts"].values() if v.of_account("tickets", a["id"], status="open")]
    if not accounts:
        return None
    account = rng.choice(accounts)
    tickets = v.of_account("tickets", account["id"])
    open_ids = [t["id"] for t in tickets if t["status"] == "open"]
    channel = v.channel("support")
    return Draft(
        "escalate_open_tickets", v.head("Support")["id"],
        f"Every open ticket of {v.customer(account)} is now urgent: raise their priority and post their ids in the "
        "#support channel.",
        _customer_start(v, account) + [step("search_tickets", account_id=account["id"], status="open")]
        + [step("update_ticket", ticket_id=t, priority="urgent") for t in open_ids] + [
            step("list_channels"),
            step("post_chat_message", channel_id=channel["id"], text="Now urgent: " + ", ".join(open_ids))],
        [equals("tickets", t, "priority", "urgent", f"ticket {t} is urgent") for t in open_ids]
        + [created("chat_messages", "#support gets the ids", where={"channel_id": channel["id"]},
                   texts={"text": open_ids})],
        [unchanged("tickets", t["id"], f"non-open ticket {t['id']} is left alone")
         for t in tickets if t["status"] != "open"],
        [["accounts", account["id"]]] + [["tickets", t] for t in open_ids],
        f"Raised {', '.join(open_ids)} to urgent and posted them in #support.",
        [mentions(open_ids[0], "the reply names a ticket")])


TEMPLATES = {f.__name__: f for f in (reassign_ticket, close_ticket_and_reply, reschedule_meeting, cancel_meeting,
                                     open_tickets_document, remove_duplicate_contact, update_deal,
                                     escalate_open_tickets)}
