# Put this folder first on PYTHONPATH to run as a macOS or Windows laptop does: Triton ships no
# builds there, so `import triton` fails. (`make test` runs its smoke subset this way.)
raise ImportError("triton is unavailable in this environment (.ci/no-triton)")
