"""Enterprise world: oracle solves every task (1.0), doing nothing scores 0, half the writes score in between,
collateral damage fails all_effects_pass, the hard split, tool counts, determinism, helpful tool errors."""
import json
import re
import statistics

import pytest

from mercury_jax.envs.enterprise.effects import check_effect, forbidden_fired, grade_state
from mercury_jax.envs.enterprise.oracle import is_write, partial_script, run_script
from mercury_jax.envs.enterprise.tasks import FULL_TEMPLATES, generate_tasks, initial_state
from mercury_jax.envs.enterprise.toolkit import call_sync
from mercury_jax.envs.enterprise.toolset import ALL_TOOLS, SERVICE_OF, SERVICE_TOOLS, make_tools
from mercury_jax.envs.enterprise.world import generate_world

NAME_FIELD = {"people": "name", "contacts": "name", "accounts": "name", "deals": "name", "tickets": "title",
              "events": "title", "documents": "title", "emails": "subject", "leave_requests": None}
ID_PATTERN = re.compile(r"\b(?:P|E|C|EV|DOC|L|A|CT|D|T|M)-\d+\b")


@pytest.fixture(scope="module")
def tasks():
    """200 tasks: 20 worlds x 10."""
    return [t for seed in range(20) for t in generate_tasks(seed, 10)]


def grade(task, final):
    return grade_state(task["required_effects"], task["forbidden_effects"], initial_state(task), final)


def test_oracle_solves_every_task_and_nothing_scores_zero(tasks):
    assert len(tasks) == 200
    for task in tasks:
        db = initial_state(task)
        results = run_script(task, db)
        assert not [r for r in results if r[2]], (task["task_id"], [r for r in results if r[2]])
        solved = grade(task, db)
        assert (solved["effects_fraction"], solved["all_effects_pass"]) == (1.0, True), (task["task_id"], solved)
        nothing = grade(task, initial_state(task))
        assert (nothing["effects_fraction"], nothing["all_effects_pass"]) == (0.0, False), task["task_id"]


def test_half_the_writes_scores_in_between(tasks):
    checked = 0
    for task in tasks:
        if sum(is_write(s["tool"]) for s in task["oracle"]["steps"]) < 2:
            continue
        db = initial_state(task)
        run_script(task, db, partial_script(task, 0.5))
        result = grade(task, db)
        assert 0.0 < result["effects_fraction"] < 1.0 and not result["all_effects_pass"], task["task_id"]
        checked += 1
    assert checked >= 150


def test_forbidden_effect_fails_all_effects_pass(tasks):
    checked = 0
    for task in tasks:
        if not task["forbidden_effects"]:
            continue
        db = initial_state(task)
        run_script(task, db)
        victim = task["forbidden_effects"][0]
        del db[victim["collection"]][victim["id"]]  # collateral damage on a record the task did not ask for
        result = grade(task, db)
        assert result["effects_fraction"] == 1.0 and not result["all_effects_pass"], task["task_id"]
        assert result["forbidden_violations"] == 1
        checked += 1
    assert checked == len(tasks)


def test_editing_a_forbidden_record_is_a_violation_too(tasks):
    """Collateral damage that edits a bystander (rather than deleting it) is caught the same way."""
    checked = 0
    for task in tasks:
        if not task["forbidden_effects"]:
            continue
        db = initial_state(task)
        run_script(task, db)
        victim = task["forbidden_effects"][0]
        record = db[victim["collection"]][victim["id"]]
        field = next(k for k in record if k != "id")
        record[field] = f"{record[field]} (edited)"
        result = grade(task, db)
        assert result["effects_fraction"] == 1.0 and not result["all_effects_pass"], task["task_id"]
        assert result["forbidden_violations"] == 1, task["task_id"]
        checked += 1
    assert checked == len(tasks)


def test_created_effect_needs_a_new_record(tasks):
    """A record the oracle created satisfies its `created` effect; the same record present from the start (so not
    created in the episode) does not."""
    checked = 0
    for task in tasks:
        created = [e for e in task["required_effects"] if e["kind"] == "created"]
        if not created:
            continue
        initial, db = initial_state(task), initial_state(task)
        run_script(task, db)
        for effect in created:
            assert check_effect(effect, initial, db), (task["task_id"], effect)
            collection = effect["collection"]
            already_there = {**initial, collection: {**initial[collection], **db[collection]}}
            assert not check_effect(effect, already_there, db), (task["task_id"], effect)
            checked += 1
    assert checked >= 50


def _ticket(title, status="open", tags=("billing",)):
    return {"title": title, "status": status, "tags": list(tags)}


CREATED_TICKET = {"kind": "created", "collection": "tickets", "where": {"status": "open"},
                  "contains": {"title": ["refund"]}, "superset": {"tags": ["Billing"]}, "description": "a ticket"}


@pytest.mark.parametrize("final_tickets,ok", [
    ({"T-1": _ticket("Refund for ACME")}, False),                                      # existed before: not created
    ({"T-1": _ticket("Refund for ACME", status="closed")}, False),                     # edited, still not created
    ({"T-1": _ticket("Refund for ACME"), "T-2": _ticket("Refund again")}, True),       # a new matching record
    ({"T-1": _ticket("Refund for ACME"), "T-2": _ticket("Invoice question")}, False),  # new, text missing
    ({"T-1": _ticket("Refund for ACME"), "T-2": _ticket("refund", status="closed")}, False),  # new, where fails
    ({"T-1": _ticket("Refund for ACME"), "T-2": _ticket("REFUND", tags=())}, False),   # new, superset fails
])
def test_created_effect_on_hand_built_states(final_tickets, ok):
    initial = {"tickets": {"T-1": _ticket("Refund for ACME")}}
    assert check_effect(CREATED_TICKET, initial, {"tickets": final_tickets}) is ok


@pytest.mark.parametrize("final_record,fired", [
    ({"stage": "open", "amount": 5}, False),                 # an equal copy
    ({"stage": "won", "amount": 5}, True),                   # one field edited
    ({"stage": "open", "amount": 5, "note": "x"}, True),     # a field added
    (None, True),                                            # deleted
])
def test_unchanged_forbidden_effect_on_hand_built_states(final_record, fired):
    effect = {"kind": "unchanged", "collection": "deals", "id": "D-1", "description": "deal D-1 is left alone"}
    initial = {"deals": {"D-1": {"stage": "open", "amount": 5}, "D-2": {"stage": "open", "amount": 7}}}
    final = {"deals": {"D-2": {"stage": "lost", "amount": 7}}}  # another record's edit is not this effect's business
    if final_record is not None:
        final["deals"]["D-1"] = final_record
    assert forbidden_fired(effect, initial, final) is fired
    result = grade_state([], [effect], initial, final)
    assert result["forbidden_violations"] == int(fired)
    assert result["details"] == [{"type": "forbidden", "description": "deal D-1 is left alone", "ok": not fired}]


def test_hard_split_no_required_id_or_name_in_prompt(tasks):
    for task in tasks:
        db = initial_state(task)
        prompt = (task["system_prompt"] + "\n" + task["user_prompt"]).lower()
        assert task["records"], task["task_id"]
        for collection, record_id in task["records"]:
            assert record_id.lower() not in prompt, (task["task_id"], record_id)
            field = NAME_FIELD[collection]
            if field:
                assert db[collection][record_id][field].lower() not in prompt, (task["task_id"], record_id)
        assert not ID_PATTERN.search(task["user_prompt"]), task["task_id"]


def test_oracle_write_ids_were_observed_first(tasks):
    """Every id the oracle passes to a tool was shown by an earlier observation (or is the id a create returned)."""
    for task in tasks[:100]:
        seen = task["user_prompt"]
        for step, text, _ in run_script(task, initial_state(task)):
            for record_id in ID_PATTERN.findall(json.dumps(step["args"])):
                assert record_id in seen, (task["task_id"], step, record_id)
            seen += text


def test_tool_counts_templates_and_coverage(tasks):
    counts = [len(t["tool_names"]) for t in tasks]
    assert min(counts) >= 10 and max(counts) <= 26
    assert 15.0 <= statistics.mean(counts) <= 17.5
    for task in tasks:
        assert set(s["tool"] for s in task["oracle"]["steps"]) <= set(task["tool_names"])
        assert task["tool_names"] == sorted(set(task["tool_names"])) and set(task["tool_names"]) <= set(ALL_TOOLS)
    assert len(FULL_TEMPLATES) >= 12 and {t["template"] for t in tasks} == set(FULL_TEMPLATES)
    used = {s["tool"] for t in tasks for s in t["oracle"]["steps"]}
    assert {SERVICE_OF[t] for t in used if is_write(t)} == set(SERVICE_TOOLS)  # every service gets written to
    for verb in ("create_", "update_", "delete_"):
        assert any(t.startswith(verb) for t in used), verb
    for task in tasks:
        for key in ("task_id", "world", "seed", "system_prompt", "user_prompt", "tool_names"):
            assert key in task
        assert task["world"] == "enterprise"


def test_generation_is_deterministic_per_seed():
    first = json.dumps(generate_tasks(7, 10), sort_keys=True)
    assert first == json.dumps(generate_tasks(7, 10), sort_keys=True)
    assert first != json.dumps(generate_tasks(8, 10), sort_keys=True)
    assert generate_world(3) == generate_world(3) and generate_world(3) != generate_world(4)


def test_world_cross_references_resolve():
    db = generate_world(11)
    for ticket in db["tickets"].values():
        assert ticket["account_id"] in db["accounts"] and ticket["assignee_id"] in db["people"]
    for contact in db["contacts"].values():
        assert contact["account_id"] in db["accounts"]
    for request in db["leave_requests"].values():
        assert request["person_id"] in db["people"]
    industries = [a["industry"] for a in db["accounts"].values()]
    assert len(industries) == len(set(industries))


@pytest.mark.parametrize("tool, args, message", [
    ("get_ticket", {"ticket_id": "T-1"}, "no ticket 'T-1'; ticket ids look like T-123, find them with search_tickets"),
    ("update_ticket", {"ticket_id": "TICKET", "status": "done"}, "status must be one of open, pending, closed"),
    ("send_email", {"to": ["nobody"], "subject": "s", "body": "b"}, "to must be a non-empty list of email addresses"),
    ("create_event", {"title": "x", "start": "tomorrow", "end": "2026-01-01T10:00", "attendees": ["a@b.c"]},
     "start must be a date and time like 2026-03-14T15:00"),
    ("approve_leave", {"request_id": "APPROVED"}, "only pending requests can be decided"),
    ("update_person", {"person_id": "SOMEONE"}, "nothing to update"),
])
def test_tool_errors_name_the_fix(tool, args, message):
    db = generate_world(2)
    args = dict(args)
    if args.get("ticket_id") == "TICKET":
        args["ticket_id"] = next(iter(db["tickets"]))
    if args.get("request_id") == "APPROVED":
        args["request_id"] = next(i for i, r in db["leave_requests"].items() if r["status"] != "pending")
    if args.get("person_id") == "SOMEONE":
        args["person_id"] = next(iter(db["people"]))
    text, is_error = call_sync(make_tools(db, [tool])[tool], args)
    assert is_error and text.startswith(f"Error executing tool {tool}: ") and message in text


def test_make_tools_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown enterprise tools"):
        make_tools(generate_world(0), ["search_tickets", "launch_rocket"])


def test_short_ids_are_one_digit_unique_and_leave_the_full_world_alone():
    from mercury_jax.envs.presets import ENTERPRISE

    id_pattern = {False: re.compile(r"^[A-Z]+-\d{3,4}$"), True: re.compile(r"^[A-Z]+-\d$")}
    for seed in range(20):
        for short in (False, True):
            config = ENTERPRISE["tiny"].world if short else ENTERPRISE["full"].world
            assert config.short_ids is short
            db = generate_world(seed, config)
            ids = [rid for name, table in db.items() if name != "meta" for rid in table]
            assert len(ids) == len(set(ids))
            assert all(id_pattern[short].match(rid) for rid in ids), [r for r in ids if not id_pattern[short].match(r)]
