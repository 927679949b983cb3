"""The training simulator: a synchronous data-parallel job whose batch sizes a policy controls.

* :mod:`.params`: :class:`SimParams` (per-worker speeds, communication, statistical model), JSON;
* :mod:`.dynamics`: :class:`Simulator`, the model itself (numpy only);
* :mod:`.randomise`: per-episode domain randomisation;
* :mod:`.env`: :class:`DynamixSimEnv`, the gymnasium environment (imports gymnasium);
* :mod:`.evaluate`: run any :class:`~dynamix_byteps.policy.base.Policy` through episodes;
* :mod:`.fit`: :class:`SimParams` fitted to a real run's decision log (``dynamix sim fit``, :mod:`dynamix_byteps.cli.sim`).
"""

from dynamix_byteps.policy.sim.dynamics import Interval, Simulator
from dynamix_byteps.policy.sim.params import (
           CommParams,
           SimParams,
           StatParams,
           Window,
           WorkerParams,
           from_scenario,
           reference,
)

__all__ = ["CommParams", "Interval", "SimParams", "Simulator", "StatParams", "Window", "WorkerParams",
           "from_scenario", "reference"]
