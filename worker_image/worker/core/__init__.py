"""Engine core without torch: requests, paged KV-cache bookkeeping (BlockPool, KVCacheManager) and the continuous-batching Scheduler."""
