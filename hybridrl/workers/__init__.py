"""Role workers and how they are called: dispatch modes, resource pools, worker groups.

- :mod:`~hybridrl.workers.dispatch`: ``register(Dispatch.DP_COMPUTE | ONE_TO_ALL | LOCAL)``
- :mod:`~hybridrl.workers.group`: ``ResourcePool``, ``ClassWithInitArgs``, ``WorkerGroup``
"""

from hybridrl.workers.dispatch import Dispatch, register
from hybridrl.workers.group import ClassWithInitArgs, ResourceError, ResourcePool, WorkerGroup

__all__ = ["ClassWithInitArgs", "Dispatch", "ResourceError", "ResourcePool", "WorkerGroup", "register"]
