"""One module per policy; importing this package registers them all."""
from .decode_maximal import DecodeMaximalScheduler
from .orca import OrcaScheduler
from .request_level import RequestLevelScheduler
from .sarathi import SarathiScheduler
from .vllm import VLLMScheduler

__all__ = ["DecodeMaximalScheduler", "OrcaScheduler", "RequestLevelScheduler",
           "SarathiScheduler", "VLLMScheduler"]
