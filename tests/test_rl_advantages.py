"""mercury_jax.rl.advantages against naive Python loops, the hand vector of docs/ALGORITHMS.md, and a sharded batch."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mercury_jax.rl import advantages as adv_lib

# fp32 scan against a float64 loop over <= 64 steps with |values|, |rewards| <= ~3: rounding stays below 1e-5.
ATOL = RTOL = 1e-5


def random_trajectories(rng, batch, steps, *, all_masked_rows=(), reward_on_masked=True):
    """Rows of different lengths: prompt (masked), alternating action / observation segments, then padding."""
    mask = np.zeros((batch, steps), bool)
    for b in range(batch):
        if b in all_masked_rows:
            continue
        length = rng.integers(1, steps + 1)
        t = rng.integers(0, max(1, length // 3))  # prompt
        acting = True
        while t < length:
            seg = int(rng.integers(1, 6))
            mask[b, t:min(t + seg, length)] = acting
            acting = not acting
            t += seg
    values = rng.normal(size=(batch, steps))
    rewards = np.where(mask, rng.normal(size=(batch, steps)) * (rng.random((batch, steps)) < 0.3), 0.0)
    if reward_on_masked:
        # Rewards on observation/padding tokens after the first action token: GAE must move, not drop, them.
        after_first = np.cumsum(mask, axis=-1) > 0
        extra = (~mask) & after_first & (rng.random((batch, steps)) < 0.2)
        rewards = rewards + np.where(extra, rng.normal(size=(batch, steps)), 0.0)
    return rewards, values, mask


def naive_gae(rewards, values, mask, gamma, lam, bootstrap):
    """Delete the observation tokens (moving their rewards to the preceding action), then textbook GAE."""
    batch, steps = rewards.shape
    adv = np.zeros((batch, steps))
    ret = np.zeros((batch, steps))
    gamma = np.broadcast_to(gamma, (batch,))
    lam = np.broadcast_to(lam, (batch,))
    for b in range(batch):
        idx = [t for t in range(steps) if mask[b, t]]
        r = [float(rewards[b, t]) for t in idx]
        for t in range(steps):
            if not mask[b, t] and rewards[b, t] != 0:
                before = [i for i, s in enumerate(idx) if s < t]
                assert before, "test data must keep rewards attributable"
                r[before[-1]] += rewards[b, t]
        v = [float(values[b, t]) for t in idx] + [float(bootstrap[b])]
        a_next = 0.0
        for i in reversed(range(len(idx))):
            delta = r[i] + gamma[b] * v[i + 1] - v[i]
            a_next = delta + gamma[b] * lam[b] * a_next
            adv[b, idx[i]] = a_next
            ret[b, idx[i]] = a_next + v[i]
    return adv, ret


def test_hand_vector_from_algorithms_md():
    mask = jnp.array([[1, 1, 0, 0, 1, 1]])
    values = jnp.array([[.1, .2, .3, .4, .5, .6]])
    rewards = jnp.array([[0, 0, 0, 0, 0, 1.0]])
    adv, ret = adv_lib.skip_observation_gae(rewards, values, mask, gamma=1.0, lam=0.5)
    np.testing.assert_allclose(adv[0, [0, 1, 4, 5]], [0.325, 0.45, 0.30, 0.40], atol=1e-6)
    np.testing.assert_array_equal(adv[0, [2, 3]], 0.0)
    np.testing.assert_allclose(ret[0, [0, 1, 4, 5]], np.array([0.325, 0.45, 0.30, 0.40]) + [.1, .2, .5, .6],
                               atol=1e-6)


@pytest.mark.parametrize("batch,steps", [(1, 1), (3, 7), (6, 33), (5, 64)])
@pytest.mark.parametrize("per_row", [False, True])
def test_gae_matches_naive_loop(batch, steps, per_row):
    rng = np.random.default_rng(batch * 100 + steps + per_row)
    rewards, values, mask = random_trajectories(rng, batch, steps, all_masked_rows=(batch - 1,) if batch > 2 else ())
    gamma = rng.uniform(0.9, 1.0, size=batch) if per_row else 0.97
    lam = rng.uniform(0.0, 1.0, size=batch) if per_row else 0.8
    bootstrap = rng.normal(size=batch) if per_row else np.zeros(batch)
    adv, ret = adv_lib.skip_observation_gae(rewards, values, mask, gamma=gamma, lam=lam,
                                            bootstrap_value=bootstrap if per_row else None)
    ref_adv, ref_ret = naive_gae(rewards, values, mask, gamma, lam, bootstrap)
    np.testing.assert_allclose(adv, ref_adv, atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(ret, ref_ret, atol=ATOL, rtol=RTOL)
    assert not np.any(np.asarray(adv)[~mask]) and not np.any(np.asarray(ret)[~mask])


def test_lambda_one_gamma_one_gives_monte_carlo_return():
    rng = np.random.default_rng(0)
    _, values, mask = random_trajectories(rng, 4, 40, reward_on_masked=False)
    final_reward = rng.normal(size=4)
    rewards = adv_lib.place_terminal_reward(final_reward, mask)
    _, ret = adv_lib.skip_observation_gae(rewards, values, mask, gamma=1.0, lam=1.0)
    np.testing.assert_allclose(ret, np.where(mask, final_reward[:, None], 0.0), atol=1e-5)


def test_reward_on_masked_token_moves_to_preceding_action_not_lost():
    mask = np.array([[1, 1, 0, 1, 1, 0, 0]], bool)
    values = np.array([[.1, .2, .3, .4, .5, .6, .7]])
    on_padding = np.zeros((1, 7)); on_padding[0, 6] = 1.0          # terminal reward on a padding token
    on_last_action = np.zeros((1, 7)); on_last_action[0, 4] = 1.0
    got = adv_lib.skip_observation_gae(on_padding, values, mask, gamma=1.0, lam=0.9)
    want = adv_lib.skip_observation_gae(on_last_action, values, mask, gamma=1.0, lam=0.9)
    np.testing.assert_array_equal(got[0], want[0])
    assert float(got[0][0, 4]) == pytest.approx(0.5)  # 1 - V


def test_unattributable_reward_is_an_error_eagerly_and_reported_under_jit():
    mask = np.array([[0, 1, 1], [0, 0, 0], [1, 1, 1]], bool)
    rewards = np.array([[1.0, 0, 0], [0, 0, 2.0], [0, 0, 1.0]])  # prompt reward; reward in an all-masked row
    with pytest.raises(ValueError, match=r"rows \[0, 1\].*place_terminal_reward"):
        adv_lib.skip_observation_gae(rewards, np.zeros((3, 3)), mask, gamma=1.0, lam=1.0)
    np.testing.assert_array_equal(adv_lib.unattributable_reward(rewards, mask), [1.0, 2.0, 0.0])
    traced = jax.jit(lambda r, m: adv_lib.skip_observation_gae(r, jnp.zeros((3, 3)), m, gamma=1.0, lam=1.0))
    # no eager check possible under jit (unattributable_reward is the in-graph report): the prompt reward of row 0
    # and the reward of the action-less row 1 are dropped, row 2's terminal reward reaches every action token
    adv, ret = traced(rewards, mask)
    np.testing.assert_array_equal(adv, [[0, 0, 0], [0, 0, 0], [1, 1, 1]])
    np.testing.assert_array_equal(ret, [[0, 0, 0], [0, 0, 0], [1, 1, 1]])
    with pytest.raises(ValueError, match="masked"):
        adv_lib.check_rewards(np.array([[0, 1.0, 0]]), np.array([[1, 0, 1]]), strict=True)
    adv_lib.check_rewards(np.array([[0, 1.0, 0]]), np.array([[1, 0, 1]]))  # movable: fine when not strict


def test_place_terminal_reward():
    mask = np.array([[1, 1, 0, 1, 0], [0, 0, 0, 0, 0], [0, 1, 0, 0, 0]], bool)
    out = adv_lib.place_terminal_reward(np.array([2.0, 3.0, -1.0]), mask)
    want = np.zeros((3, 5)); want[0, 3] = 2.0; want[2, 1] = -1.0
    np.testing.assert_array_equal(out, want)


def test_length_adaptive_lambda():
    mask = np.zeros((4, 10), bool)
    mask[0, :1] = True; mask[1, 2:5] = True; mask[2] = True
    lam = adv_lib.length_adaptive_lambda(mask, alpha=1.5)
    np.testing.assert_allclose(lam, [max(0.0, 1 - 1 / 1.5), 1 - 1 / 4.5, 1 - 1 / 15.0, 0.0], rtol=1e-6)
    np.testing.assert_allclose(adv_lib.length_adaptive_lambda(mask, alpha=0.5)[0], 0.0)  # clamped at 0


@pytest.mark.parametrize("std_normalize", [True, False])
def test_group_advantages_matches_numpy(std_normalize):
    rng = np.random.default_rng(1)
    rewards = rng.integers(0, 3, size=(6, 8)).astype(float)
    rewards[2] = 1.0  # all-equal group
    rewards[4] = 0.0
    adv, stats = adv_lib.group_advantages(rewards, std_normalize=std_normalize, return_stats=True)
    adv = np.asarray(adv)
    centred = rewards - rewards.mean(-1, keepdims=True)
    want = centred / (rewards.std(-1, keepdims=True) + 1e-6) if std_normalize else centred
    np.testing.assert_allclose(adv, want, atol=1e-5)
    np.testing.assert_array_equal(adv[[2, 4]], 0.0)
    zero = (rewards == rewards[:, :1]).all(-1)
    np.testing.assert_array_equal(stats["zero_variance"], zero)
    assert int(stats["num_zero_variance"]) == zero.sum()
    np.testing.assert_array_equal(stats["keep"], ~zero)
    assert adv_lib.group_advantages(rewards).shape == (6, 8)  # DESIGN signature: array only


def test_masked_whiten_and_broadcast():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(3, 9)) * 3 + 1
    mask = rng.random((3, 9)) < 0.6
    w = np.asarray(adv_lib.masked_whiten(x, mask))
    mean, var = x[mask].mean(), x[mask].var()  # population variance over the masked-in entries
    np.testing.assert_allclose(w, np.where(mask, (x - mean) / np.sqrt(var + 1e-8), 0.0), rtol=1e-5, atol=1e-6)
    scaled = np.asarray(adv_lib.masked_whiten(x, mask, shift_mean=False))
    np.testing.assert_allclose(scaled, np.where(mask, (x - mean) / np.sqrt(var + 1e-8) + mean, 0.0), rtol=1e-5,
                               atol=1e-6)
    b = adv_lib.broadcast_to_tokens(np.array([1.0, -2.0, 3.0]), mask)
    np.testing.assert_array_equal(b, np.where(mask, np.array([1.0, -2.0, 3.0])[:, None], 0.0))


def test_jit_and_sharded_batch_give_identical_results():
    rng = np.random.default_rng(3)
    batch, steps = 16, 48
    rewards, values, mask = random_trajectories(rng, batch, steps, all_masked_rows=(5,))
    rewards, values = rewards.astype(np.float32), values.astype(np.float32)

    def pipeline(r, v, m):
        lam = adv_lib.length_adaptive_lambda(m, alpha=1.5)
        adv, _ = adv_lib.skip_observation_gae(r, v, m, gamma=1.0, lam=lam)
        _, ret = adv_lib.skip_observation_gae(r, v, m, gamma=1.0, lam=1.0)
        return adv, ret, lam

    eager = pipeline(rewards, values, mask)
    jitted = jax.jit(pipeline)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    rows = NamedSharding(mesh, P("data", None))
    sharded_in = [jax.device_put(a, rows) for a in (rewards, values, mask)]
    sharded = jitted(*sharded_in)
    assert len(jax.devices()) == 8 and sharded[0].sharding.is_equivalent_to(rows, 2)
    for e, j, s in zip(eager, jitted(rewards, values, mask), sharded):
        np.testing.assert_array_equal(e, j)  # row-independent math: bitwise identical
        np.testing.assert_array_equal(e, s)
    # and all three are the right values: the naive loop with lambda = max(0, 1 - 1 / (1.5 L)) per row
    lengths = mask.sum(axis=1)
    lam = np.array([max(0.0, 1 - 1 / (1.5 * n)) if n else 0.0 for n in lengths])
    want_adv, _ = naive_gae(rewards, values, mask, 1.0, lam, np.zeros(batch))
    _, want_ret = naive_gae(rewards, values, mask, 1.0, 1.0, np.zeros(batch))
    for got, want in zip(sharded, (want_adv, want_ret, lam)):
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)
