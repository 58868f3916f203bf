"""Role workers and how they are called: dispatch modes, resource pools, worker groups.

- :mod:`~hybridrl.workers.dispatch`: ``register(Dispatch.DP_COMPUTE | ONE_TO_ALL | LOCAL)``
- :mod:`~hybridrl.workers.group`: ``ResourcePool``, ``ClassWithInitArgs``, ``WorkerGroup``
- :mod:`~hybridrl.workers.ray_pool` / :mod:`~hybridrl.workers.ray_group`: Ray mode's ``RayResourcePool``,
  ``RayClassWithInitArgs``, ``RayWorkerGroup``, ``MegatronRayWorkerGroup`` (Ray itself loads on first use)
"""

from hybridrl.workers.dispatch import Dispatch, register
from hybridrl.workers.group import ClassWithInitArgs, ResourceError, ResourcePool, WorkerGroup
from hybridrl.workers.ray_group import MegatronRayWorkerGroup, RayClassWithInitArgs, RayWorkerGroup
from hybridrl.workers.ray_pool import RayResourcePool

__all__ = ["ClassWithInitArgs", "Dispatch", "MegatronRayWorkerGroup", "RayClassWithInitArgs", "RayResourcePool",
           "RayWorkerGroup", "ResourceError", "ResourcePool", "WorkerGroup", "register"]  # fmt: skip
