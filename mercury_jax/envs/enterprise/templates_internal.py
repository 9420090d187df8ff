"""Internal task templates (HR, calendar, drive, email, chat): leave decisions, promotions, renewal meetings,
document sharing, phishing clean-up.

Employees are described by department and city (unique among a department's staff), department heads by
department, customers by industry; never by id or exact name (the hard split).
"""
from __future__ import annotations

import datetime as dt
import random

from mercury_jax.envs.enterprise.drafts import Draft, View, absent, contains, created, equals, mentions, step, unchanged


def _pending_leave(v: View, rng: random.Random):
    requests = [r for r in v.db["leave_requests"].values() if r["status"] == "pending"]
    if not requests:
        return None
    request = rng.choice(requests)
    person = v.person(request["person_id"])
    others = [unchanged("leave_requests", r["id"], f"leave request {r['id']} is left alone")
              for r in requests if r["id"] != request["id"]]
    lookups = [step("search_people", query=person["location"], department=person["department"]),
               step("list_leave_requests", person_id=person["id"], status="pending")]
    return request, person, others, lookups


def approve_leave(v: View, rng: random.Random) -> Draft | None:
    found = _pending_leave(v, rng)
    if found is None:
        return None
    request, person, others, lookups = found
    channel, lid = v.channel(person["department"].lower()), request["id"]
    return Draft(
        "approve_leave", person["manager_id"],
        f"Approve the pending leave request from my team member based in {person['location']}, then post their "
        f"first and last day of leave (as YYYY-MM-DD) in the #{channel['name']} channel.",
        lookups + [step("approve_leave", request_id=lid), step("list_channels"),
                   step("post_chat_message", channel_id=channel["id"],
                        text=f"{person['name']} is on leave from {request['start']} to {request['end']}.")],
        [equals("leave_requests", lid, "status", "approved", f"leave request {lid} is approved"),
         created("chat_messages", f"#{channel['name']} gets the dates", where={"channel_id": channel["id"]},
                 texts={"text": [request["start"], request["end"]]})],
        others, [["leave_requests", lid], ["people", person["id"]]],
        f"Approved {lid} for {person['name']} ({request['start']} to {request['end']}) and posted the dates.",
        [mentions(lid, "the reply names the leave request")])


def reject_leave(v: View, rng: random.Random) -> Draft | None:
    found = _pending_leave(v, rng)
    if found is None:
        return None
    request, person, others, lookups = found
    day = dt.date.fromisoformat(v.today) + dt.timedelta(days=rng.randint(1, 10))
    hour = rng.choice([9, 10, 13, 14, 16])
    start, end = f"{day.isoformat()}T{hour:02d}:00", f"{day.isoformat()}T{hour:02d}:30"
    lid = request["id"]
    return Draft(
        "reject_leave", person["manager_id"],
        f"My team member based in {person['location']} asked for leave, but the quarter-end freeze applies. Reject "
        f"their pending request with that reason and book a 30-minute catch-up with them on {day.isoformat()} at "
        f"{hour:02d}:00.",
        lookups + [step("reject_leave", request_id=lid, reason="The quarter-end freeze applies."),
                   step("create_event", title="Catch-up", start=start, end=end, attendees=[person["email"]])],
        [equals("leave_requests", lid, "status", "rejected", f"leave request {lid} is rejected"),
         contains("leave_requests", lid, "reason", "freeze", "the rejection gives the freeze as reason"),
         created("events", f"a catch-up with {person['email']} at {start}", where={"start": start, "end": end},
                 superset={"attendees": [person["email"]]})],
        others, [["leave_requests", lid], ["people", person["id"]]],
        f"Rejected {lid} (quarter-end freeze) and booked a catch-up with {person['name']} at {start}.",
        [mentions(lid, "the reply names the leave request")])


def schedule_renewal_meeting(v: View, rng: random.Random) -> Draft | None:
    account = rng.choice(list(v.db["accounts"].values()))
    contacts = v.of_account("contacts", account["id"])
    roles = [c["role"] for c in contacts]
    contact = rng.choice([c for c in contacts if roles.count(c["role"]) == 1])
    owner = v.person(account["owner_id"])
    day = dt.date.fromisoformat(v.today) + dt.timedelta(days=rng.randint(3, 20))
    hour = rng.choice([9, 10, 11, 14, 15])
    start, end = f"{day.isoformat()}T{hour:02d}:00", f"{day.isoformat()}T{hour + 1:02d}:00"
    persona = v.head("Sales") if v.head("Sales")["id"] != owner["id"] else v.people(department="Executive")[0]
    return Draft(
        "schedule_renewal_meeting", persona["id"],
        f"Set up a one-hour renewal meeting on {day.isoformat()} at {hour:02d}:00 with the account owner for "
        f"{v.customer(account)} and the customer's {contact['role']}, and email the {contact['role']} the date "
        "(as YYYY-MM-DD).",
        [step("search_accounts", query=account["industry"]), step("get_account", account_id=account["id"]),
         step("get_person", person_id=owner["id"]), step("search_contacts", account_id=account["id"]),
         step("create_event", title=f"{account['name']} renewal", start=start, end=end,
              attendees=[owner["email"], contact["email"]]),
         step("send_email", to=[contact["email"]], subject="Renewal meeting",
              body=f"Hi {contact['name'].split()[0]}, let's meet on {day.isoformat()} at {hour:02d}:00.")],
        [created("events", f"a renewal meeting at {start} with {owner['email']} and {contact['email']}",
                 where={"start": start, "end": end}, texts={"title": ["renewal"]},
                 superset={"attendees": [owner["email"], contact["email"]]}),
         created("emails", f"{contact['email']} is told {day.isoformat()}", where={"folder": "sent"},
                 superset={"to": [contact["email"]]}, texts={"body": [day.isoformat()]})],
        [unchanged("events", e["id"], f"event {e['id']} is left alone")
         for e in v.of_account("events", account["id"])],
        [["accounts", account["id"]], ["contacts", contact["id"]], ["people", owner["id"]]],
        f"Booked the {account['name']} renewal at {start} with {owner['name']} and {contact['name']}, and emailed "
        f"{contact['email']}.", [mentions(day.isoformat(), "the reply gives the date")])


def share_renewal_plan(v: View, rng: random.Random) -> Draft | None:
    account = rng.choice(list(v.db["accounts"].values()))
    doc = next(d for d in v.db["documents"].values() if d["title"] == f"{account['name']} renewal plan")
    department = rng.choice([d for d in v.departments() if d != "Sales"])
    head = v.head(department)
    return Draft(
        "share_renewal_plan", account["owner_id"],
        f"Share the renewal plan of {v.customer(account)} with the head of {department} and email them the "
        "document id.",
        [step("search_accounts", query=account["industry"]),
         step("search_documents", query=f"{account['name']} renewal plan"),
         step("search_people", query=f"head of {department}"),
         step("share_document", document_id=doc["id"], emails=[head["email"]]),
         step("send_email", to=[head["email"]], subject="Renewal plan",
              body=f"Hi {head['name'].split()[0]}, the renewal plan is document {doc['id']}.")],
        [contains("documents", doc["id"], "shared_with", head["email"], f"{doc['id']} is shared with the head"),
         created("emails", f"{head['email']} gets the document id", where={"folder": "sent"},
                 superset={"to": [head["email"]]}, texts={"body": [doc["id"]]})],
        [unchanged("documents", d["id"], f"document {d['id']} is left alone") for d in v.db["documents"].values()
         if d["title"].endswith("renewal plan") and d["id"] != doc["id"]][:3],
        [["documents", doc["id"]], ["accounts", account["id"]], ["people", head["id"]]],
        f"Shared {doc['id']} with {head['name']} and emailed them.",
        [mentions(doc["id"], "the reply names the document")])


def delete_phishing(v: View, rng: random.Random) -> Draft | None:
    email = next(e for e in v.db["emails"].values() if e["from"].startswith("it-helpdesk@"))
    channel = v.channel("security")
    bystanders = [e for e in v.db["emails"].values() if e["id"] != email["id"]]
    return Draft(
        "delete_phishing", v.head("Support")["id"],
        "Someone received a fake password-expiry email that pretends to come from our IT helpdesk. Delete it and "
        "warn the #security channel, naming the sender's address.",
        [step("search_emails", query="password"), step("delete_email", email_id=email["id"]),
         step("list_channels"),
         step("post_chat_message", channel_id=channel["id"],
              text=f"Phishing alert: delete any email from {email['from']}.")],
        [absent("emails", email["id"], f"phishing email {email['id']} is deleted"),
         created("chat_messages", f"#security is warned about {email['from']}", where={"channel_id": channel["id"]},
                 texts={"text": [email["from"]]})],
        [unchanged("emails", e["id"], f"email {e['id']} is left alone")
         for e in rng.sample(bystanders, min(2, len(bystanders)))],
        [["emails", email["id"]]],
        f"Deleted {email['id']} from {email['from']} and warned #security.",
        [mentions(email["from"], "the reply names the sender")])


def promote_employee(v: View, rng: random.Random) -> Draft | None:
    person = rng.choice([p for d in v.departments() for p in v.staff(d)])
    manager = v.person(person["manager_id"])
    new_title = f"Senior {person['title']}"
    peers = [p for p in v.staff(person["department"]) if p["id"] != person["id"]]
    return Draft(
        "promote_employee", v.people(department="Executive")[0]["id"],
        f"The {person['department']} team member based in {person['location']} has been promoted to {new_title}. "
        "Update their HR record and email them congratulations, copying their manager.",
        [step("search_people", query=person["location"], department=person["department"]),
         step("get_person", person_id=manager["id"]),
         step("update_person", person_id=person["id"], title=new_title),
         step("send_email", to=[person["email"]], cc=[manager["email"]], subject="Congratulations",
              body=f"Congratulations on becoming {new_title}, {person['name'].split()[0]}!")],
        [equals("people", person["id"], "title", new_title, f"{person['id']} is now {new_title}"),
         created("emails", f"{person['email']} is congratulated with {manager['email']} in copy",
                 where={"folder": "sent"}, superset={"to": [person["email"]], "cc": [manager["email"]]})],
        [unchanged("people", manager["id"], "the manager's record is left alone")]
        + [unchanged("people", p["id"], f"peer {p['id']} is left alone") for p in peers[:2]],
        [["people", person["id"]], ["people", manager["id"]]],
        f"{person['name']} is now {new_title}; congratulated them with {manager['name']} in copy.",
        [mentions(new_title, "the reply gives the new title")])


TEMPLATES = {f.__name__: f for f in (approve_leave, reject_leave, schedule_renewal_meeting, share_renewal_plan,
                                     delete_phishing, promote_employee)}
