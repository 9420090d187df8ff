"""Data with grain: SFT chat corpora (files -> rendered, masked, packed rows per data shard) and the seeded task
orders the RL stages walk (docs/DATA.md)."""
