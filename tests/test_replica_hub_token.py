"""`--hf-token` never on a replica's command line: it reaches vLLM by its environment.

A command line is visible to every user of the host (ps), and vLLM prints its non-default
arguments into the raw server log on the node (the copy in the run directory is scrubbed; the
node's is not). The replica moves the token into HF_TOKEN (cluster.replica.hub_token_out_of).
"""

from __future__ import annotations

import pytest

from cluster.engine_spec import EngineSpec
from cluster.replica import VLLMReplicaServer, hub_token_out_of

SECRET = "hf_s3cretTOKENvalue"


@pytest.mark.parametrize("args", [
    ["--hf-token", SECRET], [f"--hf-token={SECRET}"], ["--hf_token", SECRET], ["--hf-tok", SECRET],
])
def test_the_hub_token_leaves_the_command_for_the_environment(tmp_path, args):
    engine = EngineSpec(model="m", device="cpu", extra_args=["--max-num-seqs", "4", *args])
    command, env = VLLMReplicaServer("canary-0", "canary", engine, str(tmp_path)).planned_launch(8000)
    assert not any(SECRET in arg for arg in command), command
    assert not any(arg.startswith("--hf") for arg in command)
    assert env["HF_TOKEN"] == SECRET
    assert command[-2:] == ["--max-num-seqs", "4"]


def test_a_bare_flag_is_dropped_and_other_flags_stay():
    assert hub_token_out_of(["x", "--hf-token", "--dtype", "bf16"]) == (["x", "--dtype", "bf16"], None)
    assert hub_token_out_of(["x", "--hf-config-path", "p"]) == (["x", "--hf-config-path", "p"], None)
