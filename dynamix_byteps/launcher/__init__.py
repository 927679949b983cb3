"""``bpslaunch``, the launcher of dynamix_byteps jobs.

Run ``bpslaunch --num-workers N -- python train.py`` (or ``python -m dynamix_byteps.launcher``)
to start N local workers; without ``--num-workers`` the BytePS ``DMLC_*`` environment
decides the role and the cluster. See :mod:`dynamix_byteps.launcher.launch` for the flags,
the environment contract and the exit codes, and ``bpslaunch --help``.

Modules: ``launch`` (entry point), ``cli`` (flags into a frozen ``LaunchConfig``, from
``config``), ``topology`` (hosts, interfaces, ports), ``specs`` and ``services`` (the processes
of a run and their environment; BytePS environment mode), ``elastic`` (the restart loop and the
agreement of several hosts' launchers), ``supervisor`` (spawn, output prefixing, failure
propagation, teardown), ``_subreaper`` (adopts and stops what the workers leave in sessions of
their own), ``_guardian`` (kills the job if the launcher dies).
"""

from dynamix_byteps.launcher.launch import main

__all__ = ["main"]
