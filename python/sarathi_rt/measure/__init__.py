"""Measuring a run, real or simulated: per-request and per-step metrics and their summary
(`metrics`), the SLO-first view of them (`slo`), replaying a workload against the engine
(`replay`) or an HTTP endpoint (`http_replay`), timing the engine by batch shape
(`shape_profiling`, on the one step timer of `step_timing`), A/B pairs of processes against
another build (`ab_pairs`), a step's compute and memory bounds (`roofline`) and drawing
the results (`plots`, needs matplotlib). Import the module
you need: `metrics`, `slo` and `roofline` are torch-free, so the simulator can use them."""
