"""``python -m megatron_flat rehearse``: a Megatron-LM launch line run on CPU, stock and flat.

The top product layer (``docs/architecture.md``, "Layers"), above the CPU backend:

- ``command``: the command: plans the runs, launches them, compares losses, gives a verdict;
- ``line``: the line's CPU form (what changes and why, announced);
- ``preflight``: what the runs will import that this environment lacks;
- ``probe``: the checkout parser's view of the line (run in a subprocess);
- ``worker``: one rank of one run (run under torchrun);
- ``resume``: the save-and-resume rehearsal's records.
"""
