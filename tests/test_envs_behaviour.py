"""Behaviour multiplier: each factor against hand-computed values, reported separately, product scales down."""
import pytest

from mercury_jax.envs.behaviour import BehaviourConfig, behaviour_multiplier, repetition_rate, states_answer

CALL = "<tool_call>\n<function=search>\n<parameter=query>\nsame query again\n</parameter>\n</function>\n</tool_call>"
# A call whose argument has a line that reads like an answer: it states nothing.
MESSAGE = ("<tool_call>\n<function=send_message>\n<parameter=body>\nTask done: the invoice is paid.\nFinal answer: "
           "paid\n</parameter>\n</function>\n</tool_call>")


def test_clean_trajectory_keeps_full_reward():
    texts = ["</think>\n\n" + CALL, "</think>\n\nI found the page that names the founder of the company.",
             "</think>\n\nFinal answer: Lisbon"]
    multiplier, parts = behaviour_multiplier(texts, finish_reason="stop")
    assert multiplier == 1.0
    assert (parts["repetition"], parts["post_answer_runaway"], parts["degenerate_truncation"]) == (1.0, 1.0, 1.0)


def test_repetition_rate_and_factor_by_hand():
    text = "a b c d a b c d a b c d"  # 9 four-grams, 4 distinct -> rate 5/9
    assert repetition_rate([text]) == pytest.approx(5 / 9)
    multiplier, parts = behaviour_multiplier([text], finish_reason="stop")
    assert parts["repetition"] == pytest.approx(1 - (5 / 9 - 0.3) / 0.7)
    assert multiplier == pytest.approx(parts["repetition"])
    assert repetition_rate(["a b c d a b c d"]) == 0.0  # 5 four-grams < min_ngrams
    assert repetition_rate([CALL] * 30) == 0.0  # tool-call XML repeats by design and is not counted
    half = behaviour_multiplier([text], finish_reason="stop", config=BehaviourConfig(repetition_strength=0.5))[1]
    assert half["repetition"] == pytest.approx(1 - 0.5 * (5 / 9 - 0.3) / 0.7)


@pytest.mark.parametrize("texts, answered_turn, expected, turns, calls", [
    (["Final answer: X", CALL, "more"], None, 0.5, 2, 0),       # two turns after the answer: capped at 1 unit
    (["Final answer: X\n" + CALL], None, 0.5, 0, 1),            # a call after the answer inside the turn
    (["Final answer: X\n" + "y" * 300], None, 0.75, 0, 0),      # 100 chars beyond the free 200: 0.5 unit
    (["Done, I updated the ticket.", "extra"], 0, 0.5, 1, 0),    # answered_turn given by the rollout engine
    (["Done, I updated the ticket."], 0, 1.0, 0, 0),
    (["<think>Final answer: maybe</think>\n\n" + CALL, "</think>\n\nFinal answer: Y"], None, 1.0, 0, 0),
])
def test_post_answer_runaway(texts, answered_turn, expected, turns, calls):
    multiplier, parts = behaviour_multiplier(texts, finish_reason="stop", answered_turn=answered_turn)
    assert parts["post_answer_runaway"] == pytest.approx(expected)
    assert (parts["runaway_turns"], parts["runaway_calls"]) == (turns, calls)


@pytest.mark.parametrize("texts, turns, calls, runaway", [
    ([MESSAGE + "\n" + CALL + "\nFinal answer: paid"], 0, 0, 1.0),   # issue #22: calls before the answer line
    ([MESSAGE, "Final answer: paid"], 0, 0, 1.0),                     # the call's body did not answer turn 0
    ([CALL + "\nFinal answer: X"], 0, 0, 1.0),
    ([CALL + "\nFinal answer: X\n" + MESSAGE], 0, 1, 0.5),             # only calls after the answer line count
    (["Final answer: X " + CALL], 0, 1, 0.5),                          # a call on the answer line is after it
    ([MESSAGE, "Final answer: paid", "more"], 1, 0, 0.5),
])
def test_only_calls_after_the_answer_line_are_runaway(texts, turns, calls, runaway):
    multiplier, parts = behaviour_multiplier(texts, finish_reason="stop")
    assert (parts["runaway_turns"], parts["runaway_calls"], parts["post_answer_runaway"]) == (turns, calls, runaway)
    assert multiplier == runaway


@pytest.mark.parametrize("text, answered", [
    ("Final answer: X", True), ("  final answer : X", True), ("The task is complete.", True), ("<answer>X", True),
    ("task done", True), ("So the final answer: X", False), ("task doneness", False), (MESSAGE, False),
    ("<think>\nFinal answer: maybe\n</think>\n\nlet me check", False), (CALL + "\n\n\tTask complete.", True),
    ("\n" * 5000 + "Final answer: X", True), (" " * 5000 + "x", False),
])
def test_states_answer(text, answered):
    assert states_answer(text) is answered


@pytest.mark.parametrize("last, finish, factor, in_think", [
    ("<think>\nstill thinking and thinking", "length", 0.0, True),
    ("</think>\n\nhalf a sentence", "length", 0.5, False),
    ("<think>\nunfinished", "stop", 1.0, False),
])
def test_degenerate_truncation(last, finish, factor, in_think):
    multiplier, parts = behaviour_multiplier([CALL, last], finish_reason=finish)
    assert parts["degenerate_truncation"] == factor and parts["truncated_in_think"] == in_think
    assert multiplier == pytest.approx(factor)


def test_factors_multiply_and_never_raise_reward():
    # words a b c d x3, final answer x, think after: 17 words, 14 four-grams, 9 distinct -> rate 5/14
    texts = ["a b c d a b c d a b c d", "Final answer: X", "</think>after"]
    multiplier, parts = behaviour_multiplier(texts, finish_reason="length")
    repetition = 1 - (5 / 14 - 0.3) / 0.7
    assert parts["repetition_rate"] == pytest.approx(5 / 14) and parts["repetition"] == pytest.approx(repetition)
    assert (parts["post_answer_runaway"], parts["runaway_turns"]) == (0.5, 1)  # one turn after the answer
    assert (parts["degenerate_truncation"], parts["truncated_in_think"]) == (0.5, False)
    assert multiplier == pytest.approx(repetition * 0.5 * 0.5)
    in_think = behaviour_multiplier(texts[:2] + ["after"], finish_reason="length")
    assert (in_think[0], in_think[1]["degenerate_truncation"], in_think[1]["truncated_in_think"]) == (0.0, 0.0, True)
    off = BehaviourConfig(repetition_strength=0, runaway_strength=0, truncation_strength=0,
                          truncation_in_think_strength=0, turn_budget_strength=0)
    assert behaviour_multiplier(texts, finish_reason="length", config=off)[0] == 1.0


@pytest.mark.parametrize("finish, factor", [("turn_budget", 0.5), ("answered", 1.0), ("stop", 1.0)])
def test_running_out_of_tool_turns_is_penalised(finish, factor):
    multiplier, parts = behaviour_multiplier([CALL, CALL], finish_reason=finish)
    assert parts["turn_budget"] == factor and multiplier == pytest.approx(factor)
    assert not parts["truncated"]  # a separate factor from the mid-turn token-budget cut
    off = BehaviourConfig(turn_budget_strength=0)
    assert behaviour_multiplier([CALL, CALL], finish_reason=finish, config=off)[0] == 1.0


@pytest.mark.parametrize("violations, strength, factor", [(0, 1.0, 1.0), (1, 1.0, 0.0), (1, 0.5, 0.5), (3, 0.5, 0.0)])
def test_collateral_damage_scales_reward_by_forbidden_violations(violations, strength, factor):
    config = BehaviourConfig(collateral_strength=strength)
    multiplier, parts = behaviour_multiplier([CALL, "Done."], finish_reason="answered",
                                             forbidden_violations=violations, config=config)
    assert parts["collateral_damage"] == factor and parts["forbidden_violations"] == violations
    assert multiplier == pytest.approx(factor)
    with pytest.raises(ValueError, match="must be counts"):
        behaviour_multiplier([CALL], finish_reason="answered", forbidden_violations=-1)


@pytest.mark.parametrize("errors, strength, factor", [(2, 0.0, 1.0), (0, 0.25, 1.0), (1, 0.25, 0.75), (5, 0.25, 0.0)])
def test_malformed_calls_scale_reward_by_format_errors(errors, strength, factor):
    config = BehaviourConfig(malformed_strength=strength)
    multiplier, parts = behaviour_multiplier([CALL, "Done."], finish_reason="answered", format_errors=errors,
                                             config=config)
    assert parts["malformed_calls"] == factor and parts["format_errors"] == errors
    assert multiplier == pytest.approx(factor)
    with pytest.raises(ValueError, match="must be counts"):
        behaviour_multiplier([CALL], finish_reason="answered", format_errors=-1)
