"""hybridrl: RLHF post-training (PPO, GRPO) on Megatron-Core with vLLM rollout.

The package is laid out as its architecture: ``protocol`` (DataProto batches between roles), ``config``
(typed run config), ``distributed`` (process launch and parallel layout math), ``mcore`` (everything that
touches Megatron-Core, including the CPU compatibility shims), and the RL parts built on top.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
