"""Where a graph-replayed step's time goes on CUDA (random weights of a model's shape, bf16): for 1 row x 1
token, 1 x 8 and 8 x 1, the runner's `forward` over 50 passes, the captured graph replayed alone, the GPU's
busy time and kernels per pass under the torch profiler, the top kernels; for 1 x 1 also the host's ops.

    python3 benchmarks/device/profile_step.py MODEL_FOLDER   # (on the device machine: run.sh with PROFILE=1)
"""
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from draftwise.llm import LLM

CONTEXT = 256
llm = LLM(sys.argv[1], device="cuda", load_format="dummy", max_num_seqs=8, max_model_len=400, progress=False)
runner = llm.runner
print("step mode", runner.step_mode, "dtype", llm.dtype, flush=True)
for rows, tokens in ((1, 1), (1, 8), (8, 1)):
    handles = [runner.allocate() for _ in range(rows)]
    for handle in handles:
        runner.forward([handle], [[5 + i % 900 for i in range(CONTEXT)]], [1])

    def one_pass():
        runner.forward(handles, [[7] * tokens] * rows, [tokens] * rows)
        runner.synchronize()
        for handle in handles:
            runner.truncate(handle, CONTEXT)

    for _ in range(3):
        one_pass()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            one_pass()
    started = time.perf_counter()
    for _ in range(50):
        one_pass()
    forward_ms = (time.perf_counter() - started) / 50 * 1e3
    graph = runner.static_step._graphs[runner.static_step.bucket(rows, tokens, tokens > 1)][0]
    started = time.perf_counter()
    for _ in range(50):
        graph.replay()
    torch.cuda.synchronize()
    replay_ms = (time.perf_counter() - started) / 50 * 1e3
    if tokens == 1:  # the host's part: building the inputs, forward's return, the graph's launch
        step = runner.static_step
        bucket = step.bucket(rows, 1, False)
        lengths = [CONTEXT - 1] * rows  # (a position the rows' blocks hold: prepare does not grow them)
        started = time.perf_counter()
        for _ in range(200):
            step.prepare(bucket, handles, [[7]] * rows, lengths)
        prepare_us = (time.perf_counter() - started) / 200 * 1e6
        returned, waited, launched = [], [], []
        phases = {"prepare": [], "_send": [], "run": []}  # forward's own phases, timed where they run

        def timed(name, function):
            def wrapper(*args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return function(*args, **kwargs)
                finally:
                    phases[name].append(time.perf_counter() - t0)
            return wrapper

        for name in phases:
            setattr(step, name, timed(name, getattr(step, name)))
        for _ in range(50):
            t0 = time.perf_counter()
            runner.forward(handles, [[7]] * rows, [1] * rows)
            t1 = time.perf_counter()
            runner.synchronize()
            returned.append(t1 - t0)
            waited.append(time.perf_counter() - t1)
            for handle in handles:
                runner.truncate(handle, CONTEXT)
            t0 = time.perf_counter()
            graph.replay()
            launched.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
        median = lambda values: sorted(values)[len(values) // 2] * 1e6
        print(f"host ({rows} rows): prepare {prepare_us:.0f} us, forward returns after {median(returned):.0f} us and its wait "
              f"takes {median(waited):.0f} us more; graph.replay() alone returns after {median(launched):.0f} us",
              flush=True)
        print("host, inside forward: " + ", ".join(f"{name} {median(values):.0f} us" for name, values in phases.items())
              + " (run: the send and the graph's launch; the rest of forward is the runner's bookkeeping and the"
              " logits' copy)", flush=True)
        for name in phases:
            delattr(step, name)
    events = prof.key_averages()
    on_gpu = [e for e in events if e.self_device_time_total > 0]
    print(f"=== rows {rows} tokens {tokens}: forward {forward_ms:.3f} ms, graph replay alone {replay_ms:.3f} ms, "
          f"GPU busy {sum(e.self_device_time_total for e in on_gpu) / 5e3:.3f} ms, "
          f"{sum(e.count for e in on_gpu) / 5:.0f} kernels a pass", flush=True)
    print(events.table(sort_by="self_cuda_time_total", row_limit=16, max_name_column_width=70), flush=True)
    if rows == 1 and tokens == 1:
        print(events.table(sort_by="self_cpu_time_total", row_limit=16, max_name_column_width=70), flush=True)
    for handle in handles:
        runner.free(handle)
