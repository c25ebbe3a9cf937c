"""The tiny MiMo-V2 checkpoint does what its construction promises (checked on the tensors)."""

import json

import pytest
import torch
from safetensors.torch import load_file

from rollout.tiny_checkpoint import TinyCheckpointSpec, write_checkpoint

SMALL = dict(vocab_size=512, hidden_size=256, num_layers=2, intermediate_size=512, num_heads=4, num_kv_heads=2, head_dim=64, golden_prompts=20)


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x / x.pow(2).mean(-1, keepdim=True).sqrt()


def greedy_next(tensors) -> torch.Tensor:
    """Main model: zeroed o_proj/down_proj leave the embedding in the residual stream."""
    embed = tensors["model.embed_tokens.weight"].float()
    logits = _rms(embed) @ tensors["lm_head.weight"].float().T
    return logits.argmax(-1)


def mtp_draft(tensors, layer: int = 0) -> torch.Tensor:
    """MTP layer: eh_proj reads the embedding of the token it is given; attention and MLP add nothing."""
    embed = tensors["model.embed_tokens.weight"].float()
    eh = tensors[f"model.mtp.layers.{layer}.eh_proj.weight"].float()
    h = torch.cat([_rms(embed), torch.zeros_like(embed)], dim=1) @ eh.T
    return (_rms(h) @ tensors["lm_head.weight"].float().T).argmax(-1)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = {}
    for name, extra in {"ok": {}, "noisy": {"draft_noise": 8.0}, "broken": {"broken": True}}.items():
        path = write_checkpoint(tmp_path_factory.mktemp(name), TinyCheckpointSpec(**SMALL, **extra, mtp_layers=3))
        out[name] = (path, load_file(str(path / "model.safetensors")))
    return out


def test_files_and_config_that_vllm_reads(built):
    path, _ = built["ok"]
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors", "golden.jsonl"):
        assert (path / name).exists(), name
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["MiMoV2ForCausalLM"]
    assert config["model_type"] == "mimo_v2_flash"
    assert len(config["hybrid_layer_pattern"]) == config["num_hidden_layers"]
    assert config["num_nextn_predict_layers"] == 3
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(path).model_type == "mimo_v2_flash"


def test_greedy_next_token_is_the_successor_and_golden_follows_it(built):
    path, tensors = built["ok"]
    nxt = greedy_next(tensors)
    ordinary = torch.arange(1, nxt.numel())
    # One cycle over the ordinary tokens: a permutation with no fixed point.
    assert sorted(nxt[ordinary].tolist()) == ordinary.tolist()
    assert not (nxt[ordinary] == ordinary).any()
    for line in (path / "golden.jsonl").read_text().splitlines():
        item = json.loads(line)
        token, chain = item["prompt_token_ids"][-1], []
        for _ in item["expected_token_ids"]:
            token = int(nxt[token])
            chain.append(token)
        assert chain == item["expected_token_ids"]


def test_mtp_drafts_are_right_without_noise_and_degrade_with_it(built):
    _, ok = built["ok"]
    _, noisy = built["noisy"]
    target = greedy_next(ok)[1:]
    assert (mtp_draft(ok)[1:] == target).float().mean() == 1.0
    noisy_rate = (mtp_draft(noisy)[1:] == greedy_next(noisy)[1:]).float().mean()
    assert noisy_rate < 0.5
    # Later MTP layers (which vLLM 0.32 does not load) are exact.
    assert (mtp_draft(noisy, layer=2)[1:] == greedy_next(noisy)[1:]).float().mean() == 1.0


def test_broken_checkpoint_changes_most_golden_continuations(built):
    ok_path, _ = built["ok"]
    _, broken = built["broken"]
    nxt = greedy_next(broken)
    differ = 0
    lines = (ok_path / "golden.jsonl").read_text().splitlines()
    for line in lines:
        item = json.loads(line)
        token, chain = item["prompt_token_ids"][-1], []
        for _ in item["expected_token_ids"]:
            token = int(nxt[token])
            chain.append(token)
        differ += chain != item["expected_token_ids"]
    assert differ / len(lines) > 0.9


def test_bad_spec_is_rejected():
    with pytest.raises(ValueError, match="head_dim"):
        TinyCheckpointSpec(head_dim=16, num_heads=64)
    with pytest.raises(ValueError, match="draft_noise"):
        TinyCheckpointSpec(draft_noise=-1)
