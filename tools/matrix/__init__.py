"""The performance matrix behind tools.bench_matrix, one module per job.

- cells.py: the cells (names, parameters, sequence lengths), their FLOPs and bytes, floors, timing
  plans and run-time estimates. Pure Python.
- report.py: ratios to the best peer, to each peer and to the floor, the summary, the markdown
  section, the heat map and the A/B comparison, all from the JSON alone. Pure Python (matplotlib for
  the heat map).
- run.py: the supervisor (prewarm, worker restarts, budget) and the worker's cell loop, written
  against a small measuring interface so that both run on the CPU in the tests.
- gpu.py: that interface on CUDA through torch: inputs, hipattn and its peers, event timing, SM
  clocks, ceilings. The only module that needs a GPU.
"""
