"""Environment-failure records and the trainers' filter: `trainable` keeps exactly the unmarked trajectories in
order, placeholders are valid empty trajectories, and `env_failure` survives JSON (old records without it load)."""
from mercury_jax.rollout.failures import EnvironmentFailure, EpisodeFailure, failure_placeholder, trainable
from mercury_jax.rollout.trajectory import Trajectory, batch_trajectories


def trajectory(task_id, env_failure=None):
    return Trajectory(task_id=task_id, tokens=[1, 2, 3], action_mask=[0, 1, 1], rollout_logprobs=[0.0, -1.0, -2.0],
                      policy_versions=[-1, 0, 0], prompt_length=1, reward=1.0, env_failure=env_failure)


def test_trainable_keeps_the_unmarked_in_order_and_counts_the_rest():
    batch = [trajectory("a"), trajectory("b", "tool 'x' at turn 0: timed out"), trajectory("c"),
             failure_placeholder("d", "open: OSError: gone")]
    kept, dropped = trainable(batch)
    assert [t.task_id for t in kept] == ["a", "c"] and dropped == 2
    assert trainable([]) == ([], 0)
    assert trainable(iter(batch[:1])) == (batch[:1], 0)


def test_placeholder_is_an_empty_zero_reward_trajectory():
    placeholder = failure_placeholder("d", "open: OSError: gone")
    assert (placeholder.tokens, placeholder.reward, placeholder.num_action_tokens) == ([], 0.0, 0)
    assert placeholder.env_failure == "open: OSError: gone"
    batch = batch_trajectories([placeholder, trajectory("a")], 4)  # harmless if a consumer forgets to filter
    assert batch["lengths"].tolist() == [0, 3] and batch["rewards"][0].sum() == 0.0


def test_env_failure_round_trips_through_json_and_old_records_load():
    marked = trajectory("b", "tool 'x' at turn 0: timed out")
    assert Trajectory.from_json(marked.to_json()) == marked
    old = trajectory("a").to_json()
    del old["env_failure"]
    assert Trajectory.from_json(old).env_failure is None


def test_environment_failure_names_task_stage_and_error():
    error = EnvironmentFailure(EpisodeFailure("t05", 5, "grade", "KeyError: 'rubric'"),
                               failure_placeholder("t05", "grade: KeyError: 'rubric'"))
    assert str(error) == "task t05 (episode 5): the environment failed at grade: KeyError: 'rubric'"
    assert error.trajectory.task_id == "t05"
