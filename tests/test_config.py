"""ModelConfig: read from metadata, the published shapes, the presets, the structural rules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ds4lab.config import FLASH, PRO, ModelConfig, config_problems, preset
from ds4lab.errors import ModelFileError
from ds4lab.synth import metadata

ORACLE = Path(__file__).resolve().parents[2] / "shared" / "oracle" / "tiny-a"


def _fields(cfg: ModelConfig) -> dict:
    return {key: value for key, _, value in metadata(cfg, with_tokenizer=False)}


def test_flash_matches_ds4_constants():
    f = ModelConfig.flash()
    assert (f.n_layer, f.n_embd, f.n_head, f.head_dim, f.n_expert, f.n_ff_exp) == (43, 4096, 64, 512, 256, 2048)
    assert (f.q_lora_rank, f.o_lora_rank, f.n_out_group, f.indexer_top_k) == (1024, 1024, 8, 512)
    assert f.compress_ratios[:4] == (0, 0, 4, 128) and f.compress_ratios[42] == 4
    assert sum(r == 4 for r in f.compress_ratios) == 21 and sum(r == 128 for r in f.compress_ratios) == 20
    assert (f.hc_dim, f.hc_mix_dim, f.q_dim) == (16384, 24, 32768)
    assert f.shape_name == "flash" and f.model_id == 0


def test_pro_schedule_comes_from_ratios_not_layer_index():
    p = ModelConfig.pro()
    assert p.n_layer == 61 and p.n_embd == 7168 and p.shape_name == "pro" and p.model_id == 1
    assert p.compress_ratios[:3] == (128, 128, 4)
    assert sum(r == 4 for r in p.compress_ratios) == 30 and sum(r == 128 for r in p.compress_ratios) == 31
    assert ModelConfig.from_metadata(_fields(p)) == p


def test_round_trip_through_metadata_for_every_preset():
    for cfg in (FLASH, PRO, preset("tiny"), preset("small"), preset("flash-dims", 5)):
        assert ModelConfig.from_metadata(_fields(cfg)) == cfg


def test_oracle_config_json_keys():
    want = json.loads((ORACLE / "config.json").read_text())
    got = preset("tiny").to_json()
    assert got == {k: want[k] for k in got}


def test_every_missing_key_is_reported_at_once():
    fields = _fields(preset("tiny"))
    for key in ("deepseek4.block_count", "deepseek4.rope.freq_base", "deepseek4.attention.compress_ratios"):
        del fields[key]
    with pytest.raises(ModelFileError) as err:
        ModelConfig.from_metadata(fields, source="x.gguf")
    assert len(err.value.problems) == 3
    assert "deepseek4.block_count: required key is missing" in str(err.value)
    assert "x.gguf" in str(err.value)


def test_structural_rules():
    tiny = preset("tiny")
    assert config_problems(tiny) == []
    bad = tiny.replace(n_out_group=3, n_expert_used=40, compress_ratios=(0, 0, 4, 128, 4, 64))
    problems = "\n".join(config_problems(bad))
    assert "output_group_count" in problems and "expert_used_count" in problems and "compress_ratios" in problems


def test_flash_shape_is_checked_value_by_value():
    wrong = FLASH.replace(n_expert=128, compress_ratios=(4, *FLASH.compress_ratios[1:]))
    problems = config_problems(wrong)
    assert any("n_expert: expected 256" in p for p in problems)
    assert any("compress_ratios[0]: expected 0" in p for p in problems)


def test_hostile_values_are_bounded():
    fields = _fields(preset("tiny"))
    fields["deepseek4.block_count"] = 1 << 31
    fields["deepseek4.expert_group_count"] = 4
    fields["deepseek4.rope.freq_base"] = 1e300
    with pytest.raises(ModelFileError) as err:
        ModelConfig.from_metadata(fields)
    text = str(err.value)
    assert "block_count" in text and "expert_group_count" in text
    fields["deepseek4.block_count"] = 6
    fields["deepseek4.expert_group_count"] = 0
    with pytest.raises(ModelFileError, match="rope_freq_base: expected a positive finite value, found inf"):
        ModelConfig.from_metadata(fields)


def test_flash_dims_preset_uses_flash_widths():
    assert preset("flash-dims", 2).n_hash_layer == 2
    cfg = preset("flash-dims", 4)
    assert cfg.n_embd == 4096 and cfg.n_expert == 256 and cfg.compress_ratios == (0, 0, 4, 128)
    assert cfg.shape_name == "custom"
