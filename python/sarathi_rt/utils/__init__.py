"""Small helpers every layer shares: dtype parsing (`dtypes`), NVTX ranges for nsys
(`nvtx`) and a read-only mapping that pickles (`frozen`)."""
