"""Test and demo support: process groups, the tiny MoE GPT, the equivalence harness, and
a dense single-process MoE that dispatch engines are checked against (``moe_reference``)."""
