"""Pure-Python scheduling policy (no tensors): which requests run how many tokens in
each step, and which KV blocks they own. Embeddable on its own."""
from .base import Scheduler, create_scheduler
from .block_manager import BlockManager
from .chunking import suggest_chunk_size
from .qos import QoSClass
from .config import SchedulerConfig
from .batch_plan import BatchPlan, PlanEntry
from .prefix_cache import PrefixCacheStats, block_hashes
from .policies import (DecodeMaximalScheduler, OrcaScheduler, RequestLevelScheduler,
                       SarathiScheduler, VLLMScheduler)
from .registry import available_policies, get_policy, register_policy
from .request import RequestInfo, RequestStatus

__all__ = [
    "BatchPlan", "BlockManager", "DecodeMaximalScheduler", "OrcaScheduler", "PlanEntry", "PrefixCacheStats",
    "QoSClass",
    "RequestInfo", "RequestLevelScheduler", "RequestStatus", "SarathiScheduler",
    "Scheduler", "SchedulerConfig", "VLLMScheduler", "available_policies",
    "block_hashes", "create_scheduler", "get_policy", "register_policy", "suggest_chunk_size",
]
