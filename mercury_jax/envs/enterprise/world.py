"""World generator: one integer seed -> one synthetic company, as a plain JSON-able database.

`generate_world(seed, config)` is a pure function of its arguments (its own `random.Random(seed)`), so graders
and oracles rebuild the initial state from the task's seed instead of storing it. The database is a dict of
collections (`people`, `emails`, `channels`, `chat_messages`, `events`, `documents`, `leave_requests`,
`accounts`, `contacts`, `deals`, `tickets`), each a dict `id -> record` in insertion order, plus `meta`.

Cross-references are real: tickets belong to accounts and are assigned to Support staff, customer emails come
from account contacts and mention their ticket's topic, meetings invite account owners and contacts, renewal
plans belong to accounts, leave requests belong to people. Attributes that tasks use to describe a record
indirectly are unique inside a world: one account per industry, one head per department, one Support engineer
per city, one contact per role inside an account.
"""
from __future__ import annotations

import datetime as dt
import random
from dataclasses import dataclass

FIRST = ["Ada", "Bruno", "Chiara", "Dmitri", "Elena", "Farid", "Greta", "Hiro", "Ines", "Jonas", "Kemi", "Lars",
         "Mei", "Nadia", "Omar", "Priya", "Quentin", "Rosa", "Sven", "Tariq", "Uma", "Viktor", "Wen", "Ximena",
         "Yusuf", "Zofia", "Amara", "Bjorn", "Carmen", "Dario", "Esme", "Felix", "Gita", "Hugo", "Ilse", "Joao"]
LAST = ["Abara", "Brandt", "Castillo", "Dubois", "Eriksen", "Fontaine", "Gallo", "Haddad", "Iverson", "Jansen",
        "Kowalski", "Lindqvist", "Moreau", "Nakamura", "Okafor", "Petrov", "Quist", "Rossi", "Sato", "Tanaka",
        "Ueda", "Vasquez", "Weber", "Xu", "Yilmaz", "Zeller", "Achebe", "Bauer", "Costa", "Dahl"]
CITIES = ["Lisbon", "Porto", "Lyon", "Leeds", "Turin", "Ghent", "Krakow", "Bergen", "Malmo", "Graz", "Utrecht",
          "Bilbao", "Tartu", "Cork", "Brno", "Aarhus"]
COMPANY_WORDS = ["Aster", "Birch", "Cobalt", "Delta", "Ember", "Fjord", "Granite", "Harbor", "Indigo", "Juniper",
                 "Kestrel", "Lumen", "Meridian", "Nimbus", "Orchid", "Pioneer", "Quartz", "Raven", "Summit", "Tidal"]
SUFFIXES = ["Ltd", "Group", "Labs", "Systems", "Partners", "Works", "Holdings", "Co"]
INDUSTRIES = ["logistics", "retail", "healthcare", "insurance", "energy", "education", "manufacturing",
              "hospitality", "media", "telecom", "agriculture", "banking"]
DEPARTMENTS = {
    "Support": ["Support Engineer", "Support Engineer", "Support Engineer", "Support Engineer"],
    "Sales": ["Account Executive", "Account Executive", "Sales Analyst", "Account Executive"],
    "Engineering": ["Backend Engineer", "Frontend Engineer", "Site Reliability Engineer", "QA Engineer"],
    "Finance": ["Accountant", "Financial Analyst", "Payroll Specialist"],
    "Marketing": ["Content Strategist", "Brand Designer", "Growth Marketer"],
    "Legal": ["Counsel", "Paralegal", "Compliance Officer"],
    "Operations": ["Office Manager", "Procurement Specialist", "Facilities Coordinator"],
}
CONTACT_ROLES = ["CFO", "IT Manager", "Procurement Lead", "Operations Director", "CTO", "Head of Facilities"]
# (ticket title, an indirect paraphrase a task may use, a keyword the paraphrase avoids giving away exactly)
TOPICS = [
    ("SSO login failures", "their staff cannot sign in through single sign-on"),
    ("Invoice total mismatch", "the amount on their bill looks wrong"),
    ("Data export timeout", "their exports never finish"),
    ("Mobile app crash on upload", "the phone app dies when they upload files"),
    ("Webhook deliveries delayed", "their integrations receive events late"),
    ("Report dashboard blank", "their dashboards show nothing"),
    ("Password reset emails missing", "reset links never arrive"),
    ("API rate limit errors", "their scripts keep getting throttled"),
    ("Calendar sync duplicates", "meetings show up twice after syncing"),
    ("Search results outdated", "search keeps showing stale results"),
]
LEAVE_KINDS = ["vacation", "parental", "sick", "training"]
DEAL_STAGES = ["prospecting", "proposal", "negotiation", "closed_won", "closed_lost"]
MEETING_KINDS = ["quarterly business review", "renewal call", "onboarding workshop", "roadmap briefing"]


@dataclass(frozen=True)
class WorldConfig:
    """Sizes of a generated company (the tiny preset shrinks these)."""
    departments: int = 6          # Support and Sales always, then the others in a seeded order
    staff_per_department: tuple[int, int] = (2, 4)
    accounts: tuple[int, int] = (6, 8)
    tickets_per_account: tuple[int, int] = (1, 3)
    events: int = 8
    documents_extra: int = 4
    leave_requests: int = 5
    filler_emails: int = 6
    short_ids: bool = False       # one-digit ids numbered from 1 or 2 ("D-3"): copyable by a from-scratch tiny model


def generate_world(seed: int, config: WorldConfig = WorldConfig()) -> dict:
    """The company for `seed`: a fresh database (same seed and config -> equal database)."""
    rng = random.Random(f"enterprise-world-{seed}")
    return _Builder(rng, config).build(seed)


def date_str(day: dt.date) -> str:
    return day.isoformat()


class _Builder:
    def __init__(self, rng: random.Random, config: WorldConfig):
        self.rng, self.config = rng, config
        self.db: dict = {k: {} for k in ("people", "emails", "channels", "chat_messages", "events", "documents",
                                         "leave_requests", "accounts", "contacts", "deals", "tickets")}
        self.counters: dict[str, int] = {}
        self.names: set[str] = set()

    def new_id(self, prefix: str) -> str:
        if self.config.short_ids:
            self.counters[prefix] = self.counters.get(prefix, self.rng.randrange(2)) + 1
        else:
            self.counters[prefix] = self.counters.get(prefix, 100 + self.rng.randrange(800)) + self.rng.randint(1, 9)
        return f"{prefix}-{self.counters[prefix]}"

    def person_name(self) -> str:
        while True:
            name = f"{self.rng.choice(FIRST)} {self.rng.choice(LAST)}"
            if name not in self.names:
                self.names.add(name)
                return name

    def build(self, seed: int) -> dict:
        rng, db = self.rng, self.db
        self.today = dt.date(2026, 1, 5) + dt.timedelta(days=rng.randrange(300))
        self.company = rng.choice(COMPANY_WORDS) + rng.choice(["soft", "ware", "ly", "io", "stack"])
        self.domain = self.company.lower() + ".com"
        db["meta"] = {"seed": seed, "company": self.company, "domain": self.domain, "today": date_str(self.today)}
        self._people()
        self._channels()
        self._accounts()
        self._tickets()
        self._emails()
        self._events()
        self._documents()
        self._leave()
        return db

    def _add_person(self, name: str, title: str, department: str, manager_id: str | None, city: str) -> str:
        pid = self.new_id("P")
        email = name.lower().replace(" ", ".") + "@" + self.domain
        self.db["people"][pid] = {"id": pid, "name": name, "email": email, "title": title,
                                  "department": department, "manager_id": manager_id, "location": city}
        return pid

    def _people(self) -> None:
        rng = self.rng
        others = [d for d in DEPARTMENTS if d not in ("Support", "Sales")]
        rng.shuffle(others)
        self.departments = ["Support", "Sales"] + others[: max(0, self.config.departments - 2)]
        self.ceo = self._add_person(self.person_name(), "Chief Executive Officer", "Executive", None,
                                    rng.choice(CITIES))
        self.heads, self.staff = {}, {}
        for dept in self.departments:
            head = self._add_person(self.person_name(), f"Head of {dept}", dept, self.ceo, rng.choice(CITIES))
            self.heads[dept] = head
            count = rng.randint(*self.config.staff_per_department)
            cities = rng.sample(CITIES, count)  # unique city per person inside a department
            titles = DEPARTMENTS[dept]
            self.staff[dept] = [self._add_person(self.person_name(), titles[i % len(titles)], dept, head, cities[i])
                                for i in range(count)]

    def _channels(self) -> None:
        everyone = list(self.db["people"])
        for name, members in [("general", everyone)] + [
                (d.lower(), [self.heads[d]] + self.staff[d]) for d in self.departments] + [
                ("security", [self.heads["Support"]] + self.staff["Support"])]:
            cid = self.new_id("C")
            self.db["channels"][cid] = {"id": cid, "name": name, "members": members}

    def _accounts(self) -> None:
        rng = self.rng
        count = rng.randint(*self.config.accounts)
        industries = rng.sample(INDUSTRIES, count)
        words = rng.sample(COMPANY_WORDS, count)
        sellers = [self.heads["Sales"]] + self.staff["Sales"]
        for industry, word in zip(industries, words):
            aid = self.new_id("A")
            name = f"{word} {rng.choice(SUFFIXES)}"
            domain = word.lower() + rng.choice(["corp", "hq", "net", "group"]) + ".com"
            renewal = self.today + dt.timedelta(days=rng.randrange(-20, 120))
            self.db["accounts"][aid] = {
                "id": aid, "name": name, "industry": industry, "city": rng.choice(CITIES), "domain": domain,
                "owner_id": rng.choice(sellers), "tier": rng.choice(["gold", "silver", "bronze"]),
                "renewal_date": date_str(renewal), "status": "active"}
            for role in rng.sample(CONTACT_ROLES, rng.randint(2, 3)):
                cid = self.new_id("CT")
                name_c = self.person_name()
                self.db["contacts"][cid] = {"id": cid, "account_id": aid, "name": name_c, "role": role,
                                            "email": name_c.split()[0].lower() + "@" + domain}
            if len(self.db["accounts"]) <= 2:  # a stale duplicate contact off the customer's domain
                original = self.db["contacts"][cid]
                dup = self.new_id("CT")
                self.db["contacts"][dup] = dict(original, id=dup, email=original["email"].split("@")[0]
                                                + "@" + rng.choice(["mailbox.net", "webmail.org", "inbox.io"]))
            for k in range(rng.randint(1, 2)):
                did = self.new_id("D")
                stage = rng.choice(DEAL_STAGES[:3]) if k == 0 else rng.choice(DEAL_STAGES[3:])
                self.db["deals"][did] = {
                    "id": did, "account_id": aid, "name": f"{word} {rng.choice(['expansion', 'renewal', 'pilot'])}",
                    "stage": stage, "amount": rng.randrange(10, 400) * 500,
                    "close_date": date_str(self.today + dt.timedelta(days=rng.randrange(-60, 90))),
                    "owner_id": self.db["accounts"][aid]["owner_id"]}

    def _tickets(self) -> None:
        rng = self.rng
        support = [self.heads["Support"]] + self.staff["Support"]
        for aid in self.db["accounts"]:
            for title, _ in rng.sample(TOPICS, rng.randint(*self.config.tickets_per_account)):
                tid = self.new_id("T")
                self.db["tickets"][tid] = {
                    "id": tid, "title": title, "account_id": aid, "assignee_id": rng.choice(support),
                    "status": rng.choice(["open", "open", "pending", "closed"]),
                    "priority": rng.choice(["low", "normal", "high"]), "comments": [],
                    "created": date_str(self.today - dt.timedelta(days=rng.randrange(1, 40)))}

    def _email(self, sender: str, to: list[str], subject: str, body: str, folder: str, days_ago: int) -> str:
        eid = self.new_id("E")
        self.db["emails"][eid] = {"id": eid, "from": sender, "to": to, "cc": [], "subject": subject, "body": body,
                                  "folder": folder, "date": date_str(self.today - dt.timedelta(days=days_ago))}
        return eid

    def _emails(self) -> None:
        rng, db = self.rng, self.db
        people = list(db["people"].values())
        for ticket in db["tickets"].values():
            if ticket["status"] == "closed" or rng.random() < 0.5:
                continue
            contact = rng.choice([c for c in db["contacts"].values() if c["account_id"] == ticket["account_id"]])
            assignee = db["people"][ticket["assignee_id"]]
            self._email(contact["email"], [assignee["email"]], f"Re: {ticket['title']}",
                        f"Hi {assignee['name'].split()[0]}, any news on ticket {ticket['id']}? Regards, "
                        f"{contact['name']}", "inbox", rng.randrange(0, 10))
        for _ in range(self.config.filler_emails):
            a, b = rng.sample(people, 2)
            topic = rng.choice(["budget review", "offsite planning", "hiring plan", "vendor contract", "OKR draft"])
            self._email(a["email"], [b["email"]], topic.capitalize(), f"Hi {b['name'].split()[0]}, notes on the "
                        f"{topic} are in the drive. {a['name']}", "inbox", rng.randrange(0, 20))
        self._email(f"it-helpdesk@{self.domain.replace('.com', '-support.net')}",
                    [rng.choice(people)["email"]], "Password expiry notice",
                    "Your password expires today. Click the link to keep it: http://reset.example/login",
                    "inbox", rng.randrange(0, 5))
        chat_people = list(db["people"])
        general = next(iter(db["channels"]))
        for _ in range(4):
            mid = self.new_id("M")
            db["chat_messages"][mid] = {"id": mid, "channel_id": general, "author_id": rng.choice(chat_people),
                                        "text": rng.choice(["Lunch at noon?", "Deploy went fine", "Reminder: "
                                                            "timesheets due Friday", "Welcome to the team!"]),
                                        "date": date_str(self.today - dt.timedelta(days=rng.randrange(0, 7)))}

    def _events(self) -> None:
        rng, db = self.rng, self.db
        accounts = list(db["accounts"].values())
        kinds = list(MEETING_KINDS)
        for k in range(self.config.events):
            account = accounts[k % len(accounts)]
            kind = kinds[k % len(kinds)]
            owner = db["people"][account["owner_id"]]
            contacts = [c["email"] for c in db["contacts"].values() if c["account_id"] == account["id"]]
            day = self.today + dt.timedelta(days=rng.randrange(1, 30))
            hour = rng.choice([9, 10, 11, 14, 15, 16])
            eid = self.new_id("EV")
            db["events"][eid] = {
                "id": eid, "title": f"{account['name']} {kind}", "organizer_id": owner["id"],
                "attendees": [owner["email"]] + contacts[:2], "start": f"{date_str(day)}T{hour:02d}:00",
                "end": f"{date_str(day)}T{hour + 1:02d}:00", "location": rng.choice(["Room 1", "Room 2", "Video"]),
                "account_id": account["id"]}

    def _documents(self) -> None:
        db = self.db
        for account in db["accounts"].values():
            did = self.new_id("DOC")
            db["documents"][did] = {
                "id": did, "title": f"{account['name']} renewal plan", "owner_id": account["owner_id"],
                "folder": "Sales", "shared_with": [],
                "content": f"Renewal of {account['name']} due {account['renewal_date']}. Tier {account['tier']}."}
        for event in list(db["events"].values())[: self.config.documents_extra]:
            did = self.new_id("DOC")
            db["documents"][did] = {
                "id": did, "title": f"Notes - {event['title']}", "owner_id": event["organizer_id"],
                "folder": "Meetings", "shared_with": [], "content": f"Agenda for {event['title']}: status, risks, "
                                                                     "next steps."}

    def _leave(self) -> None:
        rng, db = self.rng, self.db
        staff = [p for d in self.departments for p in self.staff[d]]
        for person in rng.sample(staff, min(self.config.leave_requests, len(staff))):
            start = self.today + dt.timedelta(days=rng.randrange(5, 60))
            lid = self.new_id("L")
            db["leave_requests"][lid] = {
                "id": lid, "person_id": person, "kind": rng.choice(LEAVE_KINDS), "start": date_str(start),
                "end": date_str(start + dt.timedelta(days=rng.randrange(1, 10))),
                "status": rng.choice(["pending", "pending", "approved"]), "reason": ""}
