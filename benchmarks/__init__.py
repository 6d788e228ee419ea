"""The benchmarks: each module is run from the repository root as ``python -m benchmarks.<name>``.

The modules with a leading underscore are what several benchmarks share (accelerator timing, engine
subprocesses, model shapes, the embedded pool's files, tables and results); they are not run.
"""
