"""Small helpers every layer shares: dtype parsing (`dtypes`), the CPU's native BF16 and
the dtype rule it sets (`cpu`, torch-free), NVTX ranges for nsys (`nvtx`), a
read-only mapping that pickles (`frozen`) and the repeated argument checks (`checks`)."""
