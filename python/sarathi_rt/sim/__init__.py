"""Trace-driven serving simulation: the real schedulers with cost models for the device."""
from .cost import (A100, CostModel, Hardware, LinearCostModel, TableCostModel, VidurCostModel,
                   interpolate_measured)
from .simulator import SimResult, simulate

__all__ = ["A100", "CostModel", "Hardware", "LinearCostModel", "SimResult", "TableCostModel",
           "VidurCostModel", "interpolate_measured", "simulate"]
