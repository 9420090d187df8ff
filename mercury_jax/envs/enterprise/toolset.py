"""The seven enterprise services and their tools; `make_tools(db, names)` builds one episode's tool set.

| service   | tools |
|-----------|-------|
| email     | search_emails get_email send_email delete_email |
| chat      | list_channels search_chat_messages post_chat_message delete_chat_message |
| calendar  | search_events get_event create_event update_event cancel_event |
| drive     | search_documents get_document create_document update_document share_document delete_document |
| hr        | search_people get_person list_direct_reports update_person list_leave_requests approve_leave     |
|           | reject_leave |
| crm       | search_accounts get_account update_account search_contacts create_contact delete_contact list_deals |
|           | update_deal |
| ticketing | search_tickets get_ticket create_ticket update_ticket reassign_ticket add_ticket_comment delete_ticket |
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

from mercury_jax.envs.enterprise.tools_business import crm_tools, ticket_tools
from mercury_jax.envs.enterprise.tools_comms import calendar_tools, chat_tools, email_tools
from mercury_jax.envs.enterprise.tools_work import drive_tools, hr_tools

SERVICES: dict[str, Callable[[dict], dict]] = {
    "email": email_tools, "chat": chat_tools, "calendar": calendar_tools, "drive": drive_tools, "hr": hr_tools,
    "crm": crm_tools, "ticketing": ticket_tools}

SERVICE_TOOLS: dict[str, tuple[str, ...]] = {
    "email": ("search_emails", "get_email", "send_email", "delete_email"),
    "chat": ("list_channels", "search_chat_messages", "post_chat_message", "delete_chat_message"),
    "calendar": ("search_events", "get_event", "create_event", "update_event", "cancel_event"),
    "drive": ("search_documents", "get_document", "create_document", "update_document", "share_document",
              "delete_document"),
    "hr": ("search_people", "get_person", "list_direct_reports", "update_person", "list_leave_requests",
           "approve_leave", "reject_leave"),
    "crm": ("search_accounts", "get_account", "update_account", "search_contacts", "create_contact",
            "delete_contact", "list_deals", "update_deal"),
    "ticketing": ("search_tickets", "get_ticket", "create_ticket", "update_ticket", "reassign_ticket",
                  "add_ticket_comment", "delete_ticket"),
}
ALL_TOOLS: tuple[str, ...] = tuple(t for tools in SERVICE_TOOLS.values() for t in tools)
SERVICE_OF: dict[str, str] = {t: s for s, tools in SERVICE_TOOLS.items() for t in tools}


def make_tools(db: dict, names: Iterable[str] | None = None) -> dict[str, Callable]:
    """The async tool functions over `db` named in `names` (all tools when None), in `names` order."""
    names = list(ALL_TOOLS if names is None else names)
    unknown = [n for n in names if n not in SERVICE_OF]
    if unknown:
        raise ValueError(f"unknown enterprise tools {unknown}; known: {', '.join(ALL_TOOLS)}")
    built: dict[str, Callable] = {}
    for service in {SERVICE_OF[n] for n in names}:
        built.update(SERVICES[service](db))
    return {n: built[n] for n in names}
