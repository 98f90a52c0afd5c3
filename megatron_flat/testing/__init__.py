"""Test and demo support: process groups, the tiny MoE GPT, the equivalence harness."""
