"""Small helpers every layer shares: dtype parsing (`dtypes`) and NVTX ranges for nsys
(`nvtx`)."""
