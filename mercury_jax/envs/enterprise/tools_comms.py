"""Email, chat and calendar tool surfaces over one world database (closures: one set per episode).

Email: search_emails, get_email, send_email, delete_email.  Chat: list_channels, search_chat_messages,
post_chat_message, delete_chat_message.  Calendar: search_events, get_event, create_event, update_event,
cancel_event.  Writes validate their arguments and raise `ToolError` with the fix.
"""
from __future__ import annotations

from mercury_jax.envs.enterprise.toolkit import ToolError, check_datetime, dumps, get_record, matches, person_by_email


def email_tools(db: dict) -> dict:
    me = db["meta"].get("persona_email", "me@" + db["meta"]["domain"])

    def new_id(prefix: str, collection: str) -> str:
        return f"{prefix}-{9000 + len(db[collection]) + 1}"

    async def search_emails(query: str = "", folder: str = "") -> str:
        """Search emails by words in sender, recipients, subject or body; folder is inbox or sent."""
        hits = [{k: e[k] for k in ("id", "from", "to", "subject", "date", "folder")} for e in db["emails"].values()
                if (not folder or e["folder"] == folder) and matches(e, query, ("from", "to", "subject", "body"))]
        return dumps(hits[:10])

    async def get_email(email_id: str) -> str:
        """Read one email with its body."""
        return dumps(get_record(db, "emails", email_id, noun="email", prefix="E", finder="search_emails"))

    async def send_email(to: list[str], subject: str, body: str, cc: list[str] | None = None) -> str:
        """Send an email; to and cc are lists of email addresses."""
        recipients = [a.strip().lower() for a in (to or [])]
        if not recipients or any("@" not in a for a in recipients + list(cc or [])):
            raise ToolError(f"to must be a non-empty list of email addresses like [\"ana@x.com\"], got {to!r}")
        if not subject.strip() or not body.strip():
            raise ToolError("subject and body must not be empty")
        eid = new_id("E", "emails")
        db["emails"][eid] = {"id": eid, "from": me, "to": recipients, "cc": [a.lower() for a in cc or []],
                             "subject": subject, "body": body, "folder": "sent", "date": db["meta"]["today"]}
        return dumps({"sent": eid, "to": recipients})

    async def delete_email(email_id: str) -> str:
        """Delete one email."""
        get_record(db, "emails", email_id, noun="email", prefix="E", finder="search_emails")
        del db["emails"][email_id.strip()]
        return dumps({"deleted": email_id.strip()})

    return {f.__name__: f for f in (search_emails, get_email, send_email, delete_email)}


def chat_tools(db: dict) -> dict:
    me = db["meta"].get("persona_id")

    async def list_channels() -> str:
        """List chat channels with their ids and member counts."""
        return dumps([{"id": c["id"], "name": c["name"], "members": len(c["members"])}
                      for c in db["channels"].values()])

    async def search_chat_messages(query: str = "", channel_id: str = "") -> str:
        """Search chat messages by words, optionally inside one channel."""
        if channel_id:
            get_record(db, "channels", channel_id, noun="channel", prefix="C", finder="list_channels")
        hits = [m for m in db["chat_messages"].values()
                if (not channel_id or m["channel_id"] == channel_id) and matches(m, query, ("text",))]
        return dumps(hits[:10])

    async def post_chat_message(channel_id: str, text: str) -> str:
        """Post a message to a channel (use the channel id from list_channels)."""
        get_record(db, "channels", channel_id, noun="channel", prefix="C", finder="list_channels")
        if not text.strip():
            raise ToolError("text must not be empty")
        mid = f"M-{9000 + len(db['chat_messages']) + 1}"
        db["chat_messages"][mid] = {"id": mid, "channel_id": channel_id.strip(), "author_id": me, "text": text,
                                    "date": db["meta"]["today"]}
        return dumps({"posted": mid})

    async def delete_chat_message(message_id: str) -> str:
        """Delete one chat message."""
        get_record(db, "chat_messages", message_id, noun="message", prefix="M", finder="search_chat_messages")
        del db["chat_messages"][message_id.strip()]
        return dumps({"deleted": message_id.strip()})

    return {f.__name__: f for f in (list_channels, search_chat_messages, post_chat_message, delete_chat_message)}


def calendar_tools(db: dict) -> dict:
    def brief(e: dict) -> dict:
        return {k: e[k] for k in ("id", "title", "start", "end", "attendees")}

    async def search_events(query: str = "", date: str = "") -> str:
        """Search calendar events by words in title, attendees or location; date is YYYY-MM-DD."""
        hits = [brief(e) for e in db["events"].values()
                if (not date or e["start"].startswith(date)) and matches(e, query, ("title", "attendees",
                                                                                         "location"))]
        return dumps(hits[:10])

    async def get_event(event_id: str) -> str:
        """Read one calendar event."""
        return dumps(get_record(db, "events", event_id, noun="event", prefix="EV", finder="search_events"))

    async def create_event(title: str, start: str, end: str, attendees: list[str], location: str = "Video") -> str:
        """Create an event; start and end like 2026-03-14T15:00; attendees are email addresses."""
        check_datetime(start, "start"), check_datetime(end, "end")
        if end <= start:
            raise ToolError(f"end {end} must be after start {start}")
        if not attendees or any("@" not in a for a in attendees):
            raise ToolError(f"attendees must be a non-empty list of email addresses, got {attendees!r}")
        eid = f"EV-{9000 + len(db['events']) + 1}"
        organizer = person_by_email(db, db["meta"].get("persona_email", ""))
        db["events"][eid] = {"id": eid, "title": title, "organizer_id": organizer and organizer["id"],
                             "attendees": [a.strip().lower() for a in attendees], "start": start, "end": end,
                             "location": location, "account_id": None}
        return dumps({"created": eid})

    async def update_event(event_id: str, title: str | None = None, start: str | None = None,
                           end: str | None = None, location: str | None = None) -> str:
        """Change an event's title, start, end or location (times like 2026-03-14T15:00)."""
        event = get_record(db, "events", event_id, noun="event", prefix="EV", finder="search_events")
        new = {"title": title, "start": start and check_datetime(start, "start"),
               "end": end and check_datetime(end, "end"), "location": location}
        new = {k: v for k, v in new.items() if v is not None}
        if not new:
            raise ToolError("nothing to update: give at least one of title, start, end, location")
        if new.get("end", event["end"]) <= new.get("start", event["start"]):
            raise ToolError("the event would end before it starts; give both start and end")
        event.update(new)
        return dumps(brief(event))

    async def cancel_event(event_id: str) -> str:
        """Cancel (delete) a calendar event."""
        get_record(db, "events", event_id, noun="event", prefix="EV", finder="search_events")
        del db["events"][event_id.strip()]
        return dumps({"cancelled": event_id.strip()})

    return {f.__name__: f for f in (search_events, get_event, create_event, update_event, cancel_event)}
