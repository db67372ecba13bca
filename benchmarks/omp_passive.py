"""OpenMP workers that wait passively, for the benchmarks that run torch on a small, shared box.
Import it before torch (the import sorter keeps it there: "omp_passive" sorts before "torch").

torch's OpenMP (libgomp) workers spin after each parallel operation by default. Left over from a
gather or scatter, they take the cores the transport's threads and the other process need: on
this 2-core machine, under load, `gather_kv` of 16 blocks moved 0.02 GB/s spinning and 0.25 GB/s
passive. An OMP_WAIT_POLICY already set is kept. libgomp reads it when it starts, so the
variable must be in the environment before torch is loaded; child processes inherit it."""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
