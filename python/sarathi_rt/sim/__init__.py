"""Trace-driven serving simulation: the real schedulers with cost models for the device."""
from .cost import CostModel, LinearCostModel, TableCostModel, VidurCostModel, interpolate_measured
from .hardware import A100, H100, H200, HARDWARE, Hardware, get_hardware, infer_hardware
from .simulator import PipelineLatency, SimResult, simulate

__all__ = ["A100", "CostModel", "H100", "H200", "HARDWARE", "Hardware", "LinearCostModel", "PipelineLatency", "SimResult",
           "TableCostModel", "VidurCostModel", "get_hardware", "infer_hardware", "interpolate_measured",
           "simulate"]
