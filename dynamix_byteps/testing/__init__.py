"""Test and benchmark infrastructure: not used by training jobs themselves.

:mod:`dynamix_byteps.testing.netns` emulates several hosts on one Linux machine with network
namespaces, rate-limited links and receiver-side random loss (needs root and iproute2's ``ip`` and
``tc``; loss also ``nft``), and runs one ``bpslaunch`` job across them;
:mod:`dynamix_byteps.testing.faults` fires fault schedules at such a job;
:mod:`dynamix_byteps.testing.delay_proxy` adds latency to one TCP service (no netem needed).
"""
