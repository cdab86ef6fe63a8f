"""A verifiers (0.4) environment written with verifiers' own API only, as a user of
prime-rl writes one: a taskset of sums, an MCP tool that adds, and a rubric of two
weighted rewards. ``env=verifiers verifiers.env=vf_calc verifiers.path=tests/vf_envs``
trains it (tests/test_verifiers.py)."""

from vf_calc.taskset import CalcTaskset

__all__ = ["CalcTaskset"]
