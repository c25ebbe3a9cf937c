"""failure_cause picks the root cause of a failed vLLM start out of its log, not the consequence."""

from __future__ import annotations

from cluster.log_cause import failure_cause

ENGINE_FAILURE = """\
(APIServer pid=441) INFO 12-02 01:09:59 [api_server.py:1800] vLLM API server version 0.32.0
(EngineCore pid=500) ERROR 12-02 01:10:03 [core.py:708] EngineCore failed to start.
(EngineCore pid=500) ERROR 12-02 01:10:03 [core.py:708] Traceback (most recent call last):
(EngineCore pid=500) ERROR 12-02 01:10:03 [core.py:708]   File "/venv/vllm/v1/engine/core.py", line 699, in run_engine_core
(EngineCore pid=500) ERROR 12-02 01:10:03 [core.py:708]     engine_core = EngineCoreProc(*args, **kwargs)
(EngineCore pid=500) ERROR 12-02 01:10:03 [core.py:708] ValueError: The model's max seq len (4096) is larger than the maximum number of tokens that can be stored in KV cache (2048).
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""


def test_the_first_traceback_s_exception_is_the_cause_not_the_re_raise():
    cause = failure_cause(ENGINE_FAILURE.splitlines())
    assert cause.startswith("ValueError: The model's max seq len (4096)")


def test_an_out_of_memory_line_wins_over_any_traceback():
    lines = ENGINE_FAILURE.splitlines()
    lines.insert(3, "(EngineCore pid=500) ERROR 12-02 01:10:03 [core.py:708] torch.OutOfMemoryError: CUDA out of "
                    "memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.81 GiB")
    assert failure_cause(lines).startswith("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")


def test_without_a_traceback_the_first_error_line_and_without_one_nothing():
    lines = ["INFO 12-02 01:00:00 [x.py:1] starting", "ERROR 12-02 01:00:01 [x.py:2] Failed to load the weights: no such file"]
    assert failure_cause(lines) == "Failed to load the weights: no such file"
    assert failure_cause(["INFO 12-02 01:00:00 [x.py:1] starting", "bye"]) is None
    assert failure_cause([]) is None


def test_a_process_killed_by_the_kernel_says_so():
    assert failure_cause(["INFO loading", "Killed"]) == "Killed"


def test_an_engine_flag_vllm_does_not_know_is_named():
    lines = ["usage: api_server.py [-h] [--host HOST]", "                     [--port PORT] ...",
             "api_server.py: error: unrecognized arguments: --no-such-engine-flag 1"]
    assert failure_cause(lines) == "api_server.py: error: unrecognized arguments: --no-such-engine-flag 1"
