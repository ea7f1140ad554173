"""The cluster KV pool (issue 58): Mooncake Store as a DRAM tier shared by every engine.

- ``engines.pool.master``: start and stop the pool's master and metadata server;
- ``engines.pool.store``: a client that mounts a segment and puts and gets blocks, every
  fault a counted miss;
- ``engines.pool.keys``: a block's pool key (its chained hash in a namespace of everything
  else that makes KV bytes differ).

Importing this package does not import Mooncake: ``store`` imports it at ``connect()``.
"""

from engines.pool.keys import PoolNamespace, pool_key, pool_keys, prompt_pool_keys
from engines.pool.master import MasterConfig, PoolMaster, PoolUnavailable, find_master_binary
from engines.pool.store import PoolStore, StoreConfig

__all__ = [
    "MasterConfig",
    "PoolMaster",
    "PoolNamespace",
    "PoolStore",
    "PoolUnavailable",
    "StoreConfig",
    "find_master_binary",
    "pool_key",
    "pool_keys",
    "prompt_pool_keys",
]
