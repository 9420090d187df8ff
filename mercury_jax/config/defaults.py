"""The one table of config defaults: the value an optional field takes where a config lacks it.

The experiment configs (`experiments/*.py`) spell out every field, so these apply to configs written before a
field existed (an older run's `config.json`, read by the sweep and the export, or resumed) and to hand-built
sections in tests. Code reads such a field with `setting(section, name)`, never with a default of its own.
"""
from __future__ import annotations

DEFAULTS = {
    "device_layout": "consecutive",           # config: how device groups are cut from the devices
    "micro_batches": 1,                       # sft / grpo: passes per learner step
    "data": "",                               # sft: the corpus files ("": the world's oracle chats)
    "data_workers": 0,                        # sft: grain worker processes
    "packing_bins": 8,                        # sft: rows open at once while packing
    "skip_bad_records": False,                # sft: skip (and count) records that cannot be trained on
    "actor_micro_batches": 1,                 # sao
    "critic_micro_batches": 1,                # sao
    "policy_loss": "dis",                     # sao / group_baseline: the actor's loss ("dis" | "ppo")
    "warmup_steps": 0,                        # optimiser sections: linear warm-up steps (0: none)
    "grad_clip": 0.0,                         # optimiser sections: global-norm clip (0: off)
    "eps": 1e-8,                              # optimiser sections: Adam's epsilon
    "weight_decay": 0.0,                      # optimiser sections
    "replica": {},                            # rollout: one replica's mesh shape ({}: a single engine)
    "param_dtype": "",                        # rollout: the rollout weights' dtype ("": the learner's)
    "atomic_pattern": "",                     # tokenizer: a SentencePiece user-defined symbol pattern
    "nonfinite": "raise",                     # train: what a non-finite update does ("raise" | "skip")
    "max_skipped": 0,                         # train: how many non-finite updates "skip" may skip
}


def setting(section, name: str):
    """`section[name]`, or the default of `DEFAULTS` where the section (a ConfigDict, a dict or None) lacks it."""
    if section is not None and name in section:
        return section[name]
    if name not in DEFAULTS:
        raise KeyError(f"config field {name!r} is missing and has no default in config/defaults.py")
    return DEFAULTS[name]
