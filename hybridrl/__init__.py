"""hybridrl: RLHF post-training (PPO, GRPO) on Megatron-Core with vLLM rollout.

The package is laid out as its architecture: ``protocol`` (DataProto batches between roles), ``config``
(typed run config), ``distributed`` (process launch and parallel layout math), ``mcore`` (everything that
touches Megatron-Core, including the CPU compatibility shims), and the RL parts built on top.
"""

__version__ = "0.1.0"

__all__ = ["RLHFDataset", "__version__"]


def __getattr__(name: str):
    # Lazy: ``import hybridrl`` stays torch-free so the CLI starts fast.
    if name == "RLHFDataset":
        from hybridrl.data import RLHFDataset

        return RLHFDataset
    raise AttributeError(f"module 'hybridrl' has no attribute {name!r}")
