"""A run's records, real or simulated: per-request and per-step metrics and their summary
(`metrics`), the SLO-first view of them (`slo`), a step's compute and memory bounds
(`roofline`) and drawing the results (`plots`, needs matplotlib). The tools that drive an
engine to get these records live above the engine, in `sarathi_rt.harness`. Import the
module you need: `metrics`, `slo` and `roofline` are torch-free, so the simulator can use
them."""
