"""Generation: prefill and decode profiled, from ``profile_generation`` to its report and JSON file.
Owns the entry points, the marked runs, the result and its metrics, the report, the picture and the file."""
