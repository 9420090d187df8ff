"""Drive (documents) and HR (people, org chart, leave) tool surfaces over one world database.

Drive: search_documents, get_document, create_document, update_document, share_document, delete_document.
HR: search_people, get_person, list_direct_reports, update_person, list_leave_requests, approve_leave,
reject_leave.  Leave decisions apply to pending requests only; a rejection needs a reason.
"""
from __future__ import annotations

from mercury_jax.envs.enterprise.toolkit import ToolError, dumps, get_record, matches, person_by_email


def drive_tools(db: dict) -> dict:
    def brief(d: dict) -> dict:
        return {k: d[k] for k in ("id", "title", "folder", "owner_id")}

    async def search_documents(query: str = "", folder: str = "") -> str:
        """Search documents by words in title or content."""
        return dumps([brief(d) for d in db["documents"].values()
                      if (not folder or d["folder"] == folder) and matches(d, query, ("title", "content"))][:10])

    async def get_document(document_id: str) -> str:
        """Read one document with its content and sharing list."""
        return dumps(get_record(db, "documents", document_id, noun="document", prefix="DOC",
                                finder="search_documents"))

    async def create_document(title: str, content: str, folder: str = "General") -> str:
        """Create a document."""
        if not title.strip():
            raise ToolError("title must not be empty")
        did = f"DOC-{9000 + len(db['documents']) + 1}"
        owner = person_by_email(db, db["meta"].get("persona_email", ""))
        db["documents"][did] = {"id": did, "title": title, "owner_id": owner and owner["id"], "folder": folder,
                                "shared_with": [], "content": content}
        return dumps({"created": did})

    async def update_document(document_id: str, title: str | None = None, content: str | None = None) -> str:
        """Replace a document's title or content."""
        doc = get_record(db, "documents", document_id, noun="document", prefix="DOC", finder="search_documents")
        if title is None and content is None:
            raise ToolError("nothing to update: give title or content")
        doc.update({k: v for k, v in (("title", title), ("content", content)) if v is not None})
        return dumps(brief(doc))

    async def share_document(document_id: str, emails: list[str]) -> str:
        """Share a document with people (a list of email addresses)."""
        doc = get_record(db, "documents", document_id, noun="document", prefix="DOC", finder="search_documents")
        if not emails or any("@" not in e for e in emails):
            raise ToolError(f"emails must be a non-empty list of email addresses, got {emails!r}")
        for email in emails:
            if email.strip().lower() not in doc["shared_with"]:
                doc["shared_with"].append(email.strip().lower())
        return dumps({"id": doc["id"], "shared_with": doc["shared_with"]})

    async def delete_document(document_id: str) -> str:
        """Delete a document."""
        get_record(db, "documents", document_id, noun="document", prefix="DOC", finder="search_documents")
        del db["documents"][document_id.strip()]
        return dumps({"deleted": document_id.strip()})

    return {f.__name__: f for f in (search_documents, get_document, create_document, update_document,
                                    share_document, delete_document)}


def hr_tools(db: dict) -> dict:
    async def search_people(query: str = "", department: str = "") -> str:
        """Search employees by words in name, title, email or location, optionally in one department."""
        return dumps([p for p in db["people"].values()
                      if (not department or p["department"].lower() == department.lower())
                      and matches(p, query, ("name", "title", "email", "location", "department"))][:12])

    async def get_person(person_id: str) -> str:
        """Read one employee record."""
        return dumps(get_record(db, "people", person_id, noun="person", prefix="P", finder="search_people"))

    async def list_direct_reports(manager_id: str) -> str:
        """List the people who report to a manager (by the manager's person id)."""
        get_record(db, "people", manager_id, noun="person", prefix="P", finder="search_people")
        return dumps([p for p in db["people"].values() if p["manager_id"] == manager_id.strip()])

    async def update_person(person_id: str, title: str | None = None, department: str | None = None,
                            location: str | None = None) -> str:
        """Change an employee's title, department or location."""
        person = get_record(db, "people", person_id, noun="person", prefix="P", finder="search_people")
        new = {k: v for k, v in (("title", title), ("department", department), ("location", location)) if v}
        if not new:
            raise ToolError("nothing to update: give title, department or location")
        person.update(new)
        return dumps(person)

    async def list_leave_requests(status: str = "", person_id: str = "") -> str:
        """List leave requests, optionally by status (pending, approved, rejected) or person id."""
        return dumps([r for r in db["leave_requests"].values()
                      if (not status or r["status"] == status) and (not person_id
                                                                         or r["person_id"] == person_id)])

    def pending(request_id: str) -> dict:
        request = get_record(db, "leave_requests", request_id, noun="leave request", prefix="L",
                             finder="list_leave_requests")
        if request["status"] != "pending":
            raise ToolError(f"leave request {request['id']} is already {request['status']}; only pending "
                            "requests can be decided")
        return request

    async def approve_leave(request_id: str) -> str:
        """Approve a pending leave request."""
        request = pending(request_id)
        request["status"] = "approved"
        return dumps(request)

    async def reject_leave(request_id: str, reason: str) -> str:
        """Reject a pending leave request, giving the reason."""
        request = pending(request_id)
        if not reason.strip():
            raise ToolError("a rejection needs a reason the employee will read")
        request.update(status="rejected", reason=reason)
        return dumps(request)

    return {f.__name__: f for f in (search_people, get_person, list_direct_reports, update_person,
                                    list_leave_requests, approve_leave, reject_leave)}
