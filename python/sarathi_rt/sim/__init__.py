"""Serving without a model: the real schedulers driven by a cost model of the device
(`cost`: vidur per-operation profiles, tables, this engine's step profile in
`shape_model`), and what is planned on top of a simulation: the SLO-derived token budget
(`budget`), the highest rate meeting an SLO (`capacity`) and the cheapest deployment for
a target rate (`deploy`). Torch-free."""
from .cost import CostModel, LinearCostModel, TableCostModel, VidurCostModel, interpolate_measured
from .hardware import A100, H100, H200, HARDWARE, Hardware, get_hardware, infer_hardware
from .simulator import PipelineLatency, SimResult, simulate
from .speculation import AcceptanceDistribution, SimSpeculation

__all__ = ["A100", "AcceptanceDistribution", "CostModel", "H100", "H200", "HARDWARE", "Hardware", "LinearCostModel",
           "PipelineLatency", "SimResult", "SimSpeculation", "TableCostModel", "VidurCostModel", "get_hardware",
           "infer_hardware", "interpolate_measured", "simulate"]
