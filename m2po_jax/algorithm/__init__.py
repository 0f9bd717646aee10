"""The pure math of docs/algorithm.md: M2PO masks and scopes, the published variants,
PPO / GSPO / SAPO losses, rejection sampling, advantages, penalties, the proximal.

Imports only `common`; needs jax, nothing else.
"""
