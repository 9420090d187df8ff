"""A scripted stand-in for the rollout `Engine` (tests inject it through `rollouts.Seams(make_engine=...)`): every
turn is a known function of its request id, so rewards computed from the sampled tokens can be predicted."""
from __future__ import annotations

from mercury_jax.rollout.engine import Sample


class ScriptedEngine:
    """Stands in for `Engine`: request r samples `script(r)` then the stop token, log-prob -0.5 each, tagged with
    the weights version last published to it."""
    made: list = []

    def __init__(self, model, *, num_slots, max_length, policy_version=0, **_):
        self.num_slots, self.max_length, self.policy_version = num_slots, max_length, policy_version
        self.results, self.queue, self.versions = {}, [], []
        ScriptedEngine.made.append(self)

    def update_weights(self, model, version=None):
        self.policy_version = version
        self.versions.append(version)

    def submit(self, request):
        self.queue.append(request)

    def step(self):
        for request in self.queue:
            tokens = script(request.request_id)[:request.max_new_tokens - 1] + [request.stop_token_ids[0]]
            history = self.results[request.continue_from].history if request.continue_from is not None else []
            self.results[request.request_id] = Sample(
                request.request_id, tokens, [-0.5] * len(tokens), "stop", history=history + request.prompt + tokens,
                policy_versions=[self.policy_version] * len(tokens))
        self.queue = []
        return False

    def release(self, request_id):
        pass

    def forget(self, request_id):
        return self.results.pop(request_id)


def script(request_id: int) -> list[int]:
    """1 to 4 ordinary token ids (the tiny vocabulary's specials sit below 20)."""
    return [20 + (7 * request_id + 3 * i) % 200 for i in range(1 + request_id % 4)]
