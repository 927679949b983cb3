"""Test and benchmark infrastructure: not used by training jobs themselves.

:mod:`dynamix_byteps.testing.netns` emulates several hosts on one Linux machine with network
namespaces and rate-limited links (needs root and iproute2's ``ip`` and ``tc``), and runs one
``bpslaunch`` job across them.
"""
