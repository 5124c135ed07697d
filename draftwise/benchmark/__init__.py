"""`draftwise bench`: benchmark suites (`suites/`: speculative, plain, adaptive, concurrency, server-load,
quantization, drafting-options) that all run through one runner (`runner.py`): every config on its
own LLM in its own worker process (`workers.py`; no build-order bias), the configs interleaved item
by item with the first one rotating, a plain-vs-plain control in every table (its ratio is the run's
noise floor), one speedup definition (`summary.speedup`: total tokens over total seconds, config over
baseline), peers measured in the same run or shown as not run (`peers.py`), and each suite's tables
written as Markdown and JSON, with plots, and on request as a section of BENCHMARKS.md headed by the
exact command (`report.py`)."""
