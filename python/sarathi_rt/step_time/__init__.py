"""What a step costs: the shape of a step (`StepShape`), the protocol of a model that
predicts a step's time from it (`StepTimeModel`), the adaptive budget's search over
step sizes (`adaptive_prefill_tokens`), and the engine's online fitted model
(`OnlineStepTimeModel`). One package, torch-free, so the scheduler, the simulator and the
engine all read step time the same way."""
from .online import OnlineStepTimeModel, features, fit_nonnegative
from .shape import (MAX_RATE_PROBES, StepShape, StepTimeModel, adaptive_prefill_tokens, fastest_chunk_alone,
                    predict)

__all__ = ["MAX_RATE_PROBES", "OnlineStepTimeModel", "StepShape", "StepTimeModel", "adaptive_prefill_tokens",
           "fastest_chunk_alone", "features", "fit_nonnegative", "predict"]
